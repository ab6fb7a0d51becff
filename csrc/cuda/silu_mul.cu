// SwiGLU of a fused gate/up projection, silu(gate) * up, in one pass (torch: silu, then the multiply, each a
// kernel and a round trip through memory). silu(g) = g / (1 + exp(-g)) in fp32 with the precise expf and an IEEE
// division, rounded to the dtype, then the product rounded: torch's bits. A grid-stride loop over [R, I].
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  using cuda::from_f32;
  using cuda::to_f32;
  const int64_t total = a.R * a.I;
  const T* gu = static_cast<const T*>(a.gu);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.I, c = i % a.I;
    const float g = to_f32(gu[r * 2 * a.I + c]);
    const T silu = from_f32<T>(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
    static_cast<T*>(a.out)[i] = from_f32<T>(__fmul_rn(to_f32(silu), to_f32(gu[r * 2 * a.I + a.I + c])));
  }
}

}  // namespace

void silu_mul_cuda(const SiluMulArgs& a, int device, void* stream) {
  const int64_t total = a.R * a.I;
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  const int threads = 256;
  const unsigned blocks = cuda::grid_for(total, threads, int64_t(cuda::sm_count(device)) * 16);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    silu_mul_kernel<T><<<blocks, threads, 0, cuda::as_stream(stream)>>>(a);
  });
  cuda::check_launch("silu_mul_kernel");
}

}  // namespace higgs_rt
