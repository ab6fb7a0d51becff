// CUDA Snake (the codec's activation), masked: out = (x + 1 / (alpha + 1e-9) * sin(alpha * x)^2) * mask.
// One pass instead of torch's five (mul, sin, pow, mul, add) and the mask's sixth: the streaming codec runs 36
// of them per call, and at one lane their launches, at 64 lanes their memory traffic, were half of its time
// (bench_codec_stream's profile). Each step is rounded as torch rounds it (snake.cuh), so the result is torch's,
// bit for bit. Each thread owns 4 channels (a float4 when
// C % 4 == 0 and the rows are 16-byte aligned, else scalars); a grid-stride loop over (b, t, channel group).
#include "../ops.h"
#include "common.cuh"
#include "snake.cuh"

namespace higgs_rt {
namespace {

using cuda::snake1;

template <bool kVec>
__global__ void snake_kernel(SnakeArgs a) {
  const int64_t groups = (a.C + 3) / 4, total = a.B * a.T * groups;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i % groups, row = i / groups, t = row % a.T, b = row / a.T, c0 = g * 4;
    const float* x = a.x + b * a.x_sb + t * a.x_st + c0;
    float* out = a.out + row * a.C + c0;
    const float m = a.mask != nullptr ? a.mask[b * a.mask_sb + t] : 1.0f;
    float v[4], al[4];
    const int n = int(a.C - c0 < 4 ? a.C - c0 : 4);
    if (kVec) {
      const float4 xv = *reinterpret_cast<const float4*>(x), av = *reinterpret_cast<const float4*>(a.alpha + c0);
      v[0] = xv.x, v[1] = xv.y, v[2] = xv.z, v[3] = xv.w, al[0] = av.x, al[1] = av.y, al[2] = av.z, al[3] = av.w;
    } else {
      for (int j = 0; j < n; ++j) v[j] = x[j], al[j] = a.alpha[c0 + j];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (kVec || j < n) {
        const float y = snake1(v[j], al[j], cuda::snake_inv(al[j]));
        v[j] = a.mask != nullptr ? __fmul_rn(y, m) : y;
      }
    }
    if (kVec) {
      *reinterpret_cast<float4*>(out) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
      for (int j = 0; j < n; ++j) out[j] = v[j];
    }
  }
}

}  // namespace

void snake_cuda(const SnakeArgs& a, int device, void* stream) {
  const int64_t total = a.B * a.T * ((a.C + 3) / 4);
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  const bool vec = a.C % 4 == 0 && a.x_sb % 4 == 0 && a.x_st % 4 == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.alpha) % 16 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
  cuda::launch_grid_stride(vec ? snake_kernel<true> : snake_kernel<false>, total, a, device, stream, "snake_kernel");
}

}  // namespace higgs_rt
