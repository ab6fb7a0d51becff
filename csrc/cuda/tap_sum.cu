// The end of a one-lane streaming convolution: the K per-tap products (one batched GEMM over strided views of the
// input, higgs_rt/codec/gemm.py) summed k ascending, the bias added and, where the next layer is a residual unit's
// inner Snake, Snake applied: one pass instead of torch's sum, add and Snake (3 kernels). At one lane and 8 frames
// the 22 sums and 22 bias adds were 122 of the call's 764 us and 44 of its 227 kernels (bench_codec_stream's
// profile, f91e4b7). IEEE fp32 adds in a fixed order (no FMA) and snake.cuh's Snake: the same bits at any width.
// A thread owns 4 consecutive outputs (a float4 where C % 4 == 0 and the tensors are 16-byte aligned).
#include "../ops.h"
#include "common.cuh"
#include "snake.cuh"
#include "vec.cuh"

namespace higgs_rt {
namespace {

template <bool kVec>
__global__ void tap_sum_kernel(TapSumArgs a) {
  const int64_t groups = (a.N + 3) / 4;
  for (int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i0 = g * 4;
    const int n = int(a.N - i0 < 4 ? a.N - i0 : 4);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < a.K; ++k) {
      const float* p = a.p + k * a.N + i0;
      if (kVec) {
        const float4 f = *reinterpret_cast<const float4*>(p);
        const float v[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = k == 0 ? v[e] : __fadd_rn(acc[e], v[e]);
      } else {
        for (int e = 0; e < n; ++e) acc[e] = k == 0 ? p[e] : __fadd_rn(acc[e], p[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (kVec || e < n) {
        const int64_t c = (i0 + e) % a.C;
        if (a.bias != nullptr) acc[e] = __fadd_rn(acc[e], a.bias[c]);
        if (a.alpha != nullptr) acc[e] = cuda::snake1(acc[e], a.alpha[c], cuda::snake_inv(a.alpha[c]));
      }
    }
    if (kVec) {
      *reinterpret_cast<float4*>(a.out + i0) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    } else {
      for (int e = 0; e < n; ++e) a.out[i0 + e] = acc[e];
    }
  }
}

}  // namespace

void tap_sum_cuda(const TapSumArgs& a, int device, void* stream) {
  if (a.N == 0) return;
  cuda::DeviceGuard guard(device);
  const bool vec = a.C % 4 == 0 && cuda::aligned16(a.p) && cuda::aligned16(a.out);
  cuda::launch_grid_stride(vec ? tap_sum_kernel<true> : tap_sum_kernel<false>, (a.N + 3) / 4, a, device, stream,
                           "tap_sum_kernel");
}

}  // namespace higgs_rt
