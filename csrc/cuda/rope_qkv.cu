// The fused q/k/v projection split into heads, with rotate-half RoPE on q and k, in one pass: torch runs it as
// ten kernels per layer (neg, cat, two multiplies and an add for each of q and k) plus the copies that make q, k
// and v contiguous for attention.
// One thread per output element, in the input's order (reads coalesced; each head's D outputs are contiguous in
// q, k or v). A q or k element d takes its partner d -/+ D/2 from the same head: out = round(round(x * cos) +
// round(r * sin)), r = -x[d + D/2] below D/2 and x[d - D/2] above, each step one IEEE operation rounded to the
// dtype as torch's (bf16 products are exact in fp32): the result is torch's, bit for bit.
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

template <typename T>
__global__ void rope_qkv_kernel(RopeQkvArgs a) {
  using cuda::from_f32;
  using cuda::to_f32;
  const int64_t heads = a.Hq + 2 * a.Hkv, half = a.D / 2, total = a.B * a.T * heads * a.D;
  const T* qkv = static_cast<const T*>(a.qkv);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % a.D, h = (i / a.D) % heads, bt = i / (a.D * heads), t = bt % a.T, b = bt / a.T;
    T value = qkv[i];
    if (h < a.Hq + a.Hkv) {
      const int64_t at = (a.cos_sb != 0 ? b * a.cos_sb : 0) + t * a.D + d;
      const float c = to_f32(static_cast<const T*>(a.cos)[at]), s = to_f32(static_cast<const T*>(a.sin)[at]);
      const float partner = to_f32(qkv[d < half ? i + half : i - half]);
      const T xc = from_f32<T>(__fmul_rn(to_f32(value), c));
      const T rs = from_f32<T>(__fmul_rn(d < half ? -partner : partner, s));
      value = from_f32<T>(__fadd_rn(to_f32(xc), to_f32(rs)));
    }
    if (h < a.Hq) {
      static_cast<T*>(a.q)[((b * a.Hq + h) * a.T + t) * a.D + d] = value;
    } else if (h < a.Hq + a.Hkv) {
      static_cast<T*>(a.k)[((b * a.Hkv + h - a.Hq) * a.T + t) * a.D + d] = value;
    } else {
      static_cast<T*>(a.v)[((b * a.Hkv + h - a.Hq - a.Hkv) * a.T + t) * a.D + d] = value;
    }
  }
}

}  // namespace

void rope_qkv_cuda(const RopeQkvArgs& a, int device, void* stream) {
  const int64_t total = a.B * a.T * (a.Hq + 2 * a.Hkv) * a.D;
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  const int threads = 256;
  const unsigned blocks = cuda::grid_for(total, threads, int64_t(cuda::sm_count(device)) * 16);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    rope_qkv_kernel<T><<<blocks, threads, 0, cuda::as_stream(stream)>>>(a);
  });
  cuda::check_launch("rope_qkv_kernel");
}

}  // namespace higgs_rt
