// CUDA delay-pattern revert: out[b, t, k] = clamp(in[b, offset + t + k, k], 0, K - 1), one thread per output.
#include "../ops.h"
#include "common.cuh"

namespace higgs_rt {
namespace {

__global__ void delay_revert_kernel(const int64_t* __restrict__ in, int64_t* __restrict__ out, int64_t S, int64_t Q,
                                    int64_t L, int64_t offset, int64_t K, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i % Q;
    const int64_t t = (i / Q) % L;
    const int64_t b = i / (Q * L);
    const int64_t code = in[(b * S + offset + t + k) * Q + k];
    out[i] = code < 0 ? 0 : (code >= K ? K - 1 : code);
  }
}

}  // namespace

void delay_revert_cuda(const DelayRevertArgs& a, int device, void* stream) {
  const int64_t total = a.B * a.L * a.Q;
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  constexpr int kThreads = 256;
  delay_revert_kernel<<<cuda::grid_for(total, kThreads), kThreads, 0, cuda::as_stream(stream)>>>(
      a.in, a.out, a.S, a.Q, a.L, a.offset, a.K, total);
  cuda::check_launch("delay_revert_kernel");
}

}  // namespace higgs_rt
