// Snake, one element, as torch rounds it: x + 1 / (alpha + 1e-9) * sin(alpha * x)^2, each step one IEEE fp32
// operation (__f*_rn: no contraction into FMA) and the precise sinf. Shared by every kernel that applies it.
#pragma once

namespace higgs_rt::cuda {

__device__ __forceinline__ float snake_inv(float alpha) { return __fdiv_rn(1.0f, __fadd_rn(alpha, 1e-9f)); }

__device__ __forceinline__ float snake1(float x, float alpha, float inv) {
  const float s = sinf(__fmul_rn(alpha, x));
  return __fadd_rn(x, __fmul_rn(inv, __fmul_rn(s, s)));
}

}  // namespace higgs_rt::cuda
