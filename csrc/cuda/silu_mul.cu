// SwiGLU of a fused gate/up projection, silu(gate) * up, in one pass (torch: silu, then the multiply, each a
// kernel and a round trip through memory). silu(g) = g / (1 + exp(-g)) in fp32 with the precise expf and an IEEE
// division, rounded to the dtype, then the product rounded: torch's bits. Each thread owns 16-byte vectors of gate
// and up (the first version, one element per thread with int64 division for every index, took 3.7 us at 46 rows
// of 8192 on the H200, f91e4b7); widths that are not whole vectors, or unaligned tensors, take the element loop.
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"
#include "vec.cuh"

namespace higgs_rt {
namespace {

template <typename T>
__device__ __forceinline__ float silu_times(float g, float up) {
  return __fmul_rn(cuda::rounded<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g)))), up);
}

template <typename T>
__global__ void silu_mul_vec_kernel(SiluMulArgs a) {
  using namespace cuda;
  constexpr int N = kVecElems<T>;
  const int64_t per_row = a.I / N, total = a.R * per_row;
  const T* gu = static_cast<const T*>(a.gu);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, c = i % per_row;
    float g[N], u[N], o[N];
    unpack<T>(*reinterpret_cast<const uint4*>(gu + r * 2 * a.I + c * N), g);
    unpack<T>(*reinterpret_cast<const uint4*>(gu + r * 2 * a.I + a.I + c * N), u);
#pragma unroll
    for (int e = 0; e < N; ++e) o[e] = silu_times<T>(g[e], u[e]);
    reinterpret_cast<uint4*>(a.out)[i] = pack<T>(o);
  }
}

template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  using cuda::from_f32;
  using cuda::to_f32;
  const int64_t total = a.R * a.I;
  const T* gu = static_cast<const T*>(a.gu);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.I, c = i % a.I;
    static_cast<T*>(a.out)[i] = from_f32<T>(silu_times<T>(to_f32(gu[r * 2 * a.I + c]), to_f32(gu[r * 2 * a.I + a.I + c])));
  }
}

}  // namespace

void silu_mul_cuda(const SiluMulArgs& a, int device, void* stream) {
  const int64_t total = a.R * a.I;
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int N = cuda::kVecElems<T>;
    const bool vec = a.I % N == 0 && cuda::aligned16(a.gu) && cuda::aligned16(a.out);
    cuda::launch_grid_stride(vec ? silu_mul_vec_kernel<T> : silu_mul_kernel<T>, vec ? total / N : total, a, device,
                             stream, "silu_mul_kernel");
  });
}

}  // namespace higgs_rt
