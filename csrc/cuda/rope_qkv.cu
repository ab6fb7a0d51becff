// The fused q/k/v projection split into heads, with rotate-half RoPE on q and k, in one pass: torch runs it as
// ten kernels per layer (neg, cat, two multiplies and an add for each of q and k) plus the copies that make q, k
// and v contiguous for attention.
// A q or k element d takes its partner d -/+ D/2 from the same head: out = round(round(x * cos) + round(r * sin)),
// r = -x[d + D/2] below D/2 and x[d - D/2] above, each step one IEEE operation rounded to the dtype as torch's
// (bf16 products are exact in fp32): the result is torch's, bit for bit.
// Each thread owns one 16-byte vector of a head's lower half and the matching vector of its upper half (the
// partners of each other): four vector loads (x, cos and sin for both halves), two stores, the index arithmetic
// once per 2 x 16 bytes. The first version took one element per thread with int64 division for every index:
// 4.7 us at 46 tokens, 19.3 us at 393 on the H200 (f91e4b7). Heads whose half is not a whole number of vectors,
// or unaligned tensors, take the element loop.
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"
#include "vec.cuh"

namespace higgs_rt {
namespace {

template <typename T>
__device__ __forceinline__ T* head_row(const RopeQkvArgs& a, int64_t b, int64_t t, int64_t h) {
  if (h < a.Hq) return static_cast<T*>(a.q) + ((b * a.Hq + h) * a.T + t) * a.D;
  if (h < a.Hq + a.Hkv) return static_cast<T*>(a.k) + ((b * a.Hkv + h - a.Hq) * a.T + t) * a.D;
  return static_cast<T*>(a.v) + ((b * a.Hkv + h - a.Hq - a.Hkv) * a.T + t) * a.D;
}

template <typename T>
__global__ void rope_qkv_vec_kernel(RopeQkvArgs a) {
  using namespace cuda;
  constexpr int N = kVecElems<T>;
  const int64_t heads = a.Hq + 2 * a.Hkv, half = a.D / 2, per_head = half / N, total = a.B * a.T * heads * per_head;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = i % per_head, h = (i / per_head) % heads, bt = i / (per_head * heads), t = bt % a.T,
                  b = bt / a.T;
    const T* lo = static_cast<const T*>(a.qkv) + (bt * heads + h) * a.D + c * N;
    uint4 xl = *reinterpret_cast<const uint4*>(lo), xh = *reinterpret_cast<const uint4*>(lo + half);
    if (h < a.Hq + a.Hkv) {
      const int64_t at = (a.cos_sb != 0 ? b * a.cos_sb : 0) + t * a.D + c * N;
      float x0[N], x1[N], c0[N], c1[N], s0[N], s1[N], o0[N], o1[N];
      unpack<T>(xl, x0);
      unpack<T>(xh, x1);
      unpack<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(a.cos) + at), c0);
      unpack<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(a.cos) + at + half), c1);
      unpack<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(a.sin) + at), s0);
      unpack<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(a.sin) + at + half), s1);
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o0[e] = __fadd_rn(rounded<T>(__fmul_rn(x0[e], c0[e])), rounded<T>(__fmul_rn(-x1[e], s0[e])));
        o1[e] = __fadd_rn(rounded<T>(__fmul_rn(x1[e], c1[e])), rounded<T>(__fmul_rn(x0[e], s1[e])));
      }
      xl = pack<T>(o0);
      xh = pack<T>(o1);
    }
    T* dst = head_row<T>(a, b, t, h) + c * N;
    *reinterpret_cast<uint4*>(dst) = xl;
    *reinterpret_cast<uint4*>(dst + half) = xh;
  }
}

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
    head_row<T>(a, b, t, h)[d] = value;
  }
}

}  // namespace

void rope_qkv_cuda(const RopeQkvArgs& a, int device, void* stream) {
  const int64_t total = a.B * a.T * (a.Hq + 2 * a.Hkv) * a.D;
  if (total == 0) return;
  cuda::DeviceGuard guard(device);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    constexpr int N = cuda::kVecElems<T>;
    const bool vec = (a.D / 2) % N == 0 && cuda::aligned16(a.qkv) && cuda::aligned16(a.cos) &&
                     cuda::aligned16(a.sin) && cuda::aligned16(a.q) && cuda::aligned16(a.k) && cuda::aligned16(a.v);
    cuda::launch_grid_stride(vec ? rope_qkv_vec_kernel<T> : rope_qkv_kernel<T>, vec ? total / (2 * N) : total, a,
                             device, stream, "rope_qkv_kernel");
  });
}

}  // namespace higgs_rt
