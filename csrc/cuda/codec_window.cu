// The streaming codec's layer input in one pass: the residual add that ends the unit before, Snake, the padding
// mask and the concatenation after the lane's kept samples (and, for a residual unit, Snake of the whole window).
// In torch these were 3-5 kernels per layer (add, Snake, the mask's multiply, cat, a second Snake) plus the mask's
// own kernels from (first, length) each call: at one lane and 8 frames the launches, not the bytes, were their
// cost (bench_codec_stream's profile: ~75 of the call's 227 kernels). The mask is computed from each lane's first
// frame and length here. Each step rounds as torch's ops do (snake.cuh; the add and the mask's multiply are IEEE
// fp32), so the window holds the bits the torch layer made. A thread owns 4 channels of one sample (a float4 where
// C % 4 == 0 and every row is 16-byte aligned, else scalars); a grid-stride loop over (lane, sample, group).
#include "../ops.h"
#include "common.cuh"
#include "snake.cuh"
#include "vec.cuh"

namespace higgs_rt {
namespace {

using cuda::snake1;
using cuda::snake_inv;

template <bool kVec>
__device__ __forceinline__ void load4(const float* p, int n, float* v) {
  if (kVec) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    for (int j = 0; j < n; ++j) v[j] = p[j];
  }
}

template <bool kVec>
__device__ __forceinline__ void store4(float* p, int n, const float* v) {
  if (kVec) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    for (int j = 0; j < n; ++j) p[j] = v[j];
  }
}

template <bool kVec>
__global__ void codec_window_kernel(CodecWindowArgs a) {
  const int64_t groups = (a.C + 3) / 4, span = a.keep + a.W, total = a.B * span * groups;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = i % groups, row = i / groups, j = row % span, b = row / span, c0 = g * 4;
    const int n = int(a.C - c0 < 4 ? a.C - c0 : 4);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (j < a.keep) {
      load4<kVec>(a.state + (b * a.keep + j) * a.C + c0, n, v);
    } else {
      const int64_t t = j - a.keep;
      load4<kVec>(a.x + b * a.x_sb + t * a.x_st + c0, n, v);
      if (a.addend != nullptr) {
        float r[4];
        load4<kVec>(a.addend + b * a.a_sb + t * a.a_st + c0, n, r);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = __fadd_rn(v[e], r[e]);
      }
      if (a.alpha != nullptr) {
        float al[4] = {0.f, 0.f, 0.f, 0.f};
        load4<kVec>(a.alpha + c0, n, al);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = snake1(v[e], al[e], snake_inv(al[e]));
      }
      const int64_t pos = a.first[b] * a.rate - a.lag + t;
      const float m = pos >= 0 && pos < a.length[b] * a.rate ? 1.0f : 0.0f;
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = __fmul_rn(v[e], m);
    }
    store4<kVec>(a.full + row * a.C + c0, n, v);
    if (a.alpha_full != nullptr) {
      float al[4] = {0.f, 0.f, 0.f, 0.f};
      load4<kVec>(a.alpha_full + c0, n, al);
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = snake1(v[e], al[e], snake_inv(al[e]));
      store4<kVec>(a.snaked + row * a.C + c0, n, v);
    }
  }
}

}  // namespace

void codec_window_cuda(const CodecWindowArgs& a, int device, void* stream) {
  const int64_t total = a.B * (a.keep + a.W) * ((a.C + 3) / 4);
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  using cuda::aligned16;
  const bool vec = a.C % 4 == 0 && a.x_sb % 4 == 0 && a.x_st % 4 == 0 && a.a_sb % 4 == 0 && a.a_st % 4 == 0 &&
                   aligned16(a.x) && aligned16(a.addend) && aligned16(a.state) && aligned16(a.alpha) &&
                   aligned16(a.alpha_full) && aligned16(a.full) && aligned16(a.snaked);
  cuda::launch_grid_stride(vec ? codec_window_kernel<true> : codec_window_kernel<false>, total, a, device, stream,
                           "codec_window_kernel");
}

}  // namespace higgs_rt
