// CUDA RVQ lookup: out[r] = sum_q table[q, clamp(codes[r, q], 0, K - 1)], fp32 accumulation in q order.
// Grid: x strides over rows, y tiles D; each thread owns one 16-byte vector of D (scalar if misaligned).
// The codes are read after the PDL wait and at L2 (an earlier kernel may have written them). With `early`
// ($HIGGS_RT_RVQ_EARLY=1, measuring) the kernel is launched with PDL and lets the next one start at once: in the
// decode step the first QKV GEMV then copies its weights while this runs (the step's first kernels, the keys'
// clamp and add and this lookup, took ~6 us on an H100 before that GEMV could start).
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int VEC>
__global__ void rvq_lookup_kernel(const int64_t* __restrict__ codes, const T* __restrict__ table, T* __restrict__ out,
                                  int64_t rows, int64_t Q, int64_t K, int64_t D, int early) {
  using V = Vec<T, VEC>;
  if (early) cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  const int64_t v = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (v >= D / VEC) return;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
#pragma unroll 4
    for (int64_t q = 0; q < Q; ++q) {
      int64_t k = __ldcg(codes + r * Q + q);
      k = k < 0 ? 0 : (k >= K ? K - 1 : k);
      const V x = reinterpret_cast<const V*>(table + (q * K + k) * D)[v];
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += cuda::to_f32(x.v[i]);
    }
    V y;
#pragma unroll
    for (int i = 0; i < VEC; ++i) y.v[i] = cuda::from_f32<T>(acc[i]);
    reinterpret_cast<V*>(out + r * D)[v] = y;
  }
}

inline bool early_trigger() {
  static const bool on = cuda::env_int("HIGGS_RT_RVQ_EARLY", 0) == 1;
  return on;
}

template <typename T, int VEC>
void launch(const RvqLookupArgs& a, cudaStream_t stream, int device) {
  const int64_t nvec = a.D / VEC;
  const int threads = int(std::min<int64_t>(128, (nvec + 31) / 32 * 32));
  const dim3 grid(cuda::grid_for(a.rows, 1), cuda::grid_for(nvec, threads, 1 << 30));
  if (grid.y > 65535) throw std::invalid_argument("higgs_rt rvq_lookup: D too large");
  const int early = early_trigger() ? 1 : 0;
  cuda::launch(rvq_lookup_kernel<T, VEC>, grid, dim3(unsigned(threads)), 0, stream, device,
               early ? cuda::kPdlGemv : 0, "rvq_lookup_kernel", a.codes, static_cast<const T*>(a.table),
               static_cast<T*>(a.out), a.rows, a.Q, a.K, a.D, early);
}

// 16-byte vectors when D and both pointers allow it, else one element per thread.
template <typename T>
void launch_vectorized(const RvqLookupArgs& a, cudaStream_t stream, int device) {
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(a.table) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  if (aligned && a.D % kVec == 0)
    launch<T, kVec>(a, stream, device);
  else
    launch<T, 1>(a, stream, device);
}

}  // namespace

void rvq_lookup_cuda(const RvqLookupArgs& a, int device, void* stream) {
  if (a.rows == 0 || a.D == 0) return;
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  cuda::dispatch(a.dtype, [&](auto t) { launch_vectorized<typename decltype(t)::type>(a, s, device); });
}

}  // namespace higgs_rt
