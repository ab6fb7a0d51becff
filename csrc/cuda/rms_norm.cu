// RMSNorm of the prompt forward's rows, with the residual add before it: one kernel for what torch runs as nine
// (add; float; pow; mean; add eps; rsqrt; mul; cast; mul by the weight) and, in a mixed text/audio prompt, for both
// norms and the where that picks one per row. The prefill of a 46-token prompt spent 1.3 of its 4.4 ms of GPU time
// in these small kernels (bench_frame_latency's prefill_profile, 2289d6e).
// One block per row. The row's 16-byte vectors (x, the residual, the row's weight) are all loaded first into
// registers (up to kMaxVecs per thread: H <= 8192 in bf16/fp16, 4096 in fp32), then added (the sum written back
// rounded, as torch's add rounds it) and squared, a block reduction gives the fp32 sum of squares, and the same
// registers are scaled and weighted, each product rounded to the dtype as torch rounds it. Only the order of the
// sum of squares differs from torch's reduction. The first version looped over scalar loads with the sum's store
// in the loop (no load could be issued past a store that might alias): 9.1 us per call at 64 rows x 3072 on the
// H200 (f91e4b7). Other widths and unaligned rows take the scalar loop.
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"
#include "vec.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxVecs = 4;

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < kThreads / 32; ++j) total += partial[j];
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_vec_kernel(RmsNormArgs a) {
  using namespace cuda;
  constexpr int N = kVecElems<T>;
  const int64_t row = blockIdx.x;
  const int nvec = int(a.H / N);
  const uint4* __restrict__ x = reinterpret_cast<const uint4*>(static_cast<const T*>(a.x) + row * a.H);
  const uint4* __restrict__ res =
      a.residual != nullptr ? reinterpret_cast<const uint4*>(static_cast<const T*>(a.residual) + row * a.H) : nullptr;
  uint4* __restrict__ sum = res != nullptr ? reinterpret_cast<uint4*>(static_cast<T*>(a.sum) + row * a.H) : nullptr;
  uint4* __restrict__ out = reinterpret_cast<uint4*>(static_cast<T*>(a.out) + row * a.H);
  const bool audio = a.audio_rows != nullptr && a.audio_rows[row];
  const uint4* __restrict__ w = reinterpret_cast<const uint4*>(audio ? a.audio_weight : a.weight);

  uint4 xs[kMaxVecs], rs[kMaxVecs], ws[kMaxVecs];
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < nvec) {
      xs[j] = x[i];
      ws[j] = w[i];
      if (res != nullptr) rs[j] = res[i];
    }
  }
  float v[kMaxVecs][N];
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < nvec) {
      unpack<T>(xs[j], v[j]);
      if (res != nullptr) {
        float r[N];
        unpack<T>(rs[j], r);
#pragma unroll
        for (int e = 0; e < N; ++e) v[j][e] = rounded<T>(__fadd_rn(v[j][e], r[e]));
        sum[i] = pack<T>(v[j]);
      }
#pragma unroll
      for (int e = 0; e < N; ++e) squares = __fadd_rn(squares, __fmul_rn(v[j][e], v[j][e]));
    }
  }
  const float scale = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(squares), float(a.H)), a.eps));
#pragma unroll
  for (int j = 0; j < kMaxVecs; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < nvec) {
      float wf[N], o[N];
      unpack<T>(ws[j], wf);
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = __fmul_rn(wf[e], rounded<T>(__fmul_rn(v[j][e], scale)));
      out[i] = pack<T>(o);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RmsNormArgs a) {
  using cuda::from_f32;
  using cuda::to_f32;
  const int64_t row = blockIdx.x;
  const T* __restrict__ x = static_cast<const T*>(a.x) + row * a.H;
  const T* __restrict__ res = a.residual != nullptr ? static_cast<const T*>(a.residual) + row * a.H : nullptr;
  T* __restrict__ sum = res != nullptr ? static_cast<T*>(a.sum) + row * a.H : nullptr;
  T* __restrict__ out = static_cast<T*>(a.out) + row * a.H;
  const bool audio = a.audio_rows != nullptr && a.audio_rows[row];
  const T* __restrict__ w = static_cast<const T*>(audio ? a.audio_weight : a.weight);

  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < a.H; i += kThreads) {
    float v = to_f32(x[i]);
    if (res != nullptr) {
      const T s = from_f32<T>(__fadd_rn(v, to_f32(res[i])));
      sum[i] = s;
      v = to_f32(s);
    }
    squares = __fadd_rn(squares, __fmul_rn(v, v));
  }
  const float scale = rsqrtf(__fadd_rn(__fdiv_rn(block_sum(squares), float(a.H)), a.eps));
  const T* src = res != nullptr ? sum : x;
  for (int64_t i = threadIdx.x; i < a.H; i += kThreads) {
    const T normed = from_f32<T>(__fmul_rn(to_f32(src[i]), scale));
    out[i] = from_f32<T>(__fmul_rn(to_f32(w[i]), to_f32(normed)));
  }
}

}  // namespace

void rms_norm_cuda(const RmsNormArgs& a, int device, void* stream) {
  if (a.R == 0 || a.H == 0) return;
  cuda::DeviceGuard guard(device);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int N = cuda::kVecElems<T>;
    const bool vec = a.H % N == 0 && a.H / N <= kThreads * kMaxVecs && cuda::aligned16(a.x) &&
                     cuda::aligned16(a.out) && cuda::aligned16(a.weight) &&
                     (a.audio_weight == nullptr || cuda::aligned16(a.audio_weight)) &&
                     (a.residual == nullptr || (cuda::aligned16(a.residual) && cuda::aligned16(a.sum)));
    if (vec)
      rms_norm_vec_kernel<T><<<unsigned(a.R), kThreads, 0, cuda::as_stream(stream)>>>(a);
    else
      rms_norm_kernel<T><<<unsigned(a.R), kThreads, 0, cuda::as_stream(stream)>>>(a);
  });
  cuda::check_launch("rms_norm_kernel");
}

}  // namespace higgs_rt
