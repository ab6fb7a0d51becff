// CUDA decode attention (flash-decoding): out[b, h] = softmax(q[b, h] . K[b, h / G, :len] * D^-0.5) @ V[..., :len]
// with len = clamp(lengths[b], 0, S) read on the device, so the launch is static (CUDA-graph safe).
//
//   split kernel  grid (nsplit, Hkv * head groups, B), 128 threads. Slot b's [0, len) keys are cut into nsplit
//                 ranges of `per` keys (whole tiles), so every block works at any length and blocks past len
//                 skip the loop. A block serves GM query heads of one KV head (GQA: K/V read once per group).
//                 A key row is read by D / VEC threads, 16 bytes each; a tile is UK rows per thread whose K and
//                 V loads are all issued before any math (forced, see the loop; checked in the SASS). Scores:
//                 per-thread partial dots, xor-shuffle sum over the row's threads; online softmax in fp32 (log2
//                 domain) per row class, then the 128 / (D / VEC) row classes merge through shared memory.
//   combine       grid (B * Hq), D threads: out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M). Skipped when
//                 nsplit == 1 (the split kernel then normalizes and writes out directly).
// nsplit is chosen by the caller from the shapes only (higgs_rt.ops._attention_splits). Keys at or past len are
// never read (the cache there may hold garbage). len == 0 gives zeros. No host sync, no allocation (the fp32
// workspace comes from the caller); launches on the caller's stream.
#include <cmath>

#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ void load_f32(const float* p, float* out) {  // 16 bytes -> 4 floats
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void load_f32(const __nv_bfloat16* p, float* out) {  // 16 bytes -> 8 floats
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(w[i] << 16);
    out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load_f32(const __half* p, float* out) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    out[2 * i] = f.x, out[2 * i + 1] = f.y;
  }
}

// Keys per split: ceil(len / nsplit) rounded up to whole tiles. Both kernels must agree.
__device__ __forceinline__ int64_t split_keys(int64_t len, int nsplit, int tile) {
  const int64_t per = (len + nsplit - 1) / nsplit;
  return (per + tile - 1) / tile * tile;
}

__device__ __forceinline__ int64_t slot_length(const int64_t* lengths, int b, int64_t S) {
  const int64_t len = lengths[b];
  return len < 0 ? 0 : (len > S ? S : len);
}

// T: cache dtype; D: head dim; GM: query heads per block; UK: key rows per thread per tile.
template <typename T, int D, int GM, int UK>
__global__ void __launch_bounds__(kThreads)
    decode_attention_split_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                  const int64_t* __restrict__ lengths, T* __restrict__ out, float* __restrict__ ws_acc,
                                  float* __restrict__ ws_ml, int Hq, int Hkv, int64_t S, int nsplit, int groups,
                                  float scale_log2, uint32_t opaque_zero) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int TPK = D / VEC;         // threads per key row
  constexpr int NKR = kThreads / TPK;  // key rows per pass (row classes)
  constexpr int TILE = NKR * UK;       // key rows per tile
  static_assert(TPK >= 1 && TPK <= 32 && (TPK & (TPK - 1)) == 0, "a key row must map onto 1..32 lanes");
  const float kNegInf = -INFINITY;

  const int split = blockIdx.x;
  const int hk = blockIdx.y / groups, grp = blockIdx.y % groups;
  const int b = blockIdx.z;
  const int G = Hq / Hkv;
  const int g0 = grp * GM;                   // first query head (within the KV head's group) of this block
  const int ng = min(GM, G - g0);            // query heads served here
  const int tid = threadIdx.x, kr = tid / TPK, dc = tid % TPK;
  const int64_t head0 = int64_t(b) * Hq + int64_t(hk) * G + g0;  // (b, first query head) row index

  const int64_t len = slot_length(lengths, b, S);
  const int64_t per = split_keys(len, nsplit, TILE);
  const int64_t start = min(int64_t(split) * per, len), end = min(start + per, len);

  float qf[GM][VEC];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < ng) {
      load_f32(q + (head0 + g) * D + dc * VEC, qf[g]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[g][i] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[g][i] = 0.f;
    }
  }

  float m[GM], l[GM], acc[GM][VEC];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = kNegInf, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  const int64_t kv0 = (int64_t(b) * Hkv + hk) * S * D + dc * VEC;
  const T* kp = k + kv0;
  const T* vp = v + kv0;
  for (int64_t key0 = start; key0 < end; key0 += TILE) {  // block-uniform bounds: every lane shuffles
    // Unconditional loads; a key past `end` reads row key0 instead (never memory past len, which may hold
    // garbage) and gets score -inf below, so p = 0.
    uint4 kraw[UK], vraw[UK];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int64_t key = key0 + u * NKR + kr;
      const int64_t row = key < end ? key : key0;
      kraw[u] = __ldg(reinterpret_cast<const uint4*>(kp + row * D));
      vraw[u] = __ldg(reinterpret_cast<const uint4*>(vp + row * D));
    }
    // Left alone, ptxas issues some V loads only after the score shuffles (a second round trip per tile).
    // Every loaded word, masked by a zero it cannot see through, feeds every K vector: all loads go first.
    uint32_t all = 0;
#pragma unroll
    for (int u = 0; u < UK; ++u) all ^= kraw[u].x ^ vraw[u].x;
    all &= opaque_zero;
#pragma unroll
    for (int u = 0; u < UK; ++u) kraw[u].x ^= all;
    float s[UK][GM];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      float kf[VEC];
      load_f32(reinterpret_cast<const T*>(&kraw[u]), kf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot = fmaf(qf[g][i], kf[i], dot);
#pragma unroll
        for (int off = TPK / 2; off > 0; off /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        s[u][g] = key0 + u * NKR + kr < end ? dot : kNegInf;
      }
    }
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      float mt = m[g];
#pragma unroll
      for (int u = 0; u < UK; ++u) mt = fmaxf(mt, s[u][g]);
      const float ms = mt == kNegInf ? 0.f : mt;  // all masked so far: keep exp2 finite (it gives 0)
      const float c = exp2f(m[g] - ms);
      l[g] *= c;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[g][i] *= c;
      m[g] = mt;
    }
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      float vf[VEC];
      load_f32(reinterpret_cast<const T*>(&vraw[u]), vf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = exp2f(s[u][g] - (m[g] == kNegInf ? 0.f : m[g]));
        l[g] += p;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
  }

  // Merge the NKR row classes: rescale each to the block max, then sum.
  __shared__ float sm_m[NKR][GM], sm_l[NKR][GM];
  __shared__ float sm_acc[NKR][GM][D];
  if (dc == 0) {
#pragma unroll
    for (int g = 0; g < GM; ++g) sm_m[kr][g] = m[g], sm_l[kr][g] = l[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    float mx = kNegInf;
    for (int r = 0; r < NKR; ++r) mx = fmaxf(mx, sm_m[r][g]);
    const float c = exp2f(m[g] - (mx == kNegInf ? 0.f : mx));
#pragma unroll
    for (int i = 0; i < VEC; ++i) sm_acc[kr][g][dc * VEC + i] = acc[g][i] * c;
  }
  __syncthreads();
  for (int idx = tid; idx < ng * D; idx += kThreads) {
    const int g = idx / D, d = idx % D;
    float mx = kNegInf;
    for (int r = 0; r < NKR; ++r) mx = fmaxf(mx, sm_m[r][g]);
    const float ms = mx == kNegInf ? 0.f : mx;
    float total_l = 0.f, total = 0.f;
    for (int r = 0; r < NKR; ++r) {
      total_l += sm_l[r][g] * exp2f(sm_m[r][g] - ms);
      total += sm_acc[r][g][d];
    }
    const int64_t head = head0 + g;
    if (nsplit == 1) {
      out[head * D + d] = cuda::from_f32<T>(total_l > 0.f ? total / total_l : 0.f);
    } else {
      const int64_t part = head * nsplit + split;
      ws_acc[part * D + d] = total;
      if (d == 0) ws_ml[2 * part] = mx, ws_ml[2 * part + 1] = total_l;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    decode_attention_combine_kernel(const float* __restrict__ ws_acc, const float* __restrict__ ws_ml,
                                    T* __restrict__ out, int nsplit, int D) {
  const int64_t head = blockIdx.x;
  const float* ml = ws_ml + head * nsplit * 2;
  float mx = -INFINITY;
  for (int s = 0; s < nsplit; ++s) mx = fmaxf(mx, ml[2 * s]);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float total_l = 0.f, total = 0.f;
    if (mx != -INFINITY) {
      for (int s = 0; s < nsplit; ++s) {
        const float c = exp2f(ml[2 * s] - mx);
        if (c > 0.f) {  // empty splits (m = -inf) contribute nothing
          total_l += ml[2 * s + 1] * c;
          total += ws_acc[(head * nsplit + s) * D + d] * c;
        }
      }
    }
    out[head * D + d] = cuda::from_f32<T>(total_l > 0.f ? total / total_l : 0.f);
  }
}

template <typename T, int D, int GM>
void launch_split(const DecodeAttentionArgs& a, cudaStream_t stream) {
  constexpr int UK = GM >= 8 ? 2 : 4;  // bound registers: q, acc are GM x VEC floats per thread
  const int64_t G = a.Hq / a.Hkv;
  const int64_t groups = (G + GM - 1) / GM;
  const int64_t gy = a.Hkv * groups;
  if (a.nsplit > 0x7fffffff || gy > 65535 || a.B > 65535)
    throw std::invalid_argument("higgs_rt decode_attention: grid too large (B, heads or splits)");
  const dim3 grid(unsigned(a.nsplit), unsigned(gy), unsigned(a.B));
  const float scale_log2 = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);  // D^-0.5 * log2(e)
  float* ws_acc = static_cast<float*>(a.workspace);
  float* ws_ml = ws_acc == nullptr ? nullptr : ws_acc + a.B * a.Hq * a.nsplit * D;
  decode_attention_split_kernel<T, D, GM, UK><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(a.q), static_cast<const T*>(a.k), static_cast<const T*>(a.v), a.lengths,
      static_cast<T*>(a.out), ws_acc, ws_ml, int(a.Hq), int(a.Hkv), a.S, int(a.nsplit), int(groups), scale_log2,
      /*opaque_zero=*/0u);
  cuda::check_launch("decode_attention_split_kernel");
  if (a.nsplit > 1) {
    const int64_t heads = a.B * a.Hq;
    if (heads > 0x7fffffff) throw std::invalid_argument("higgs_rt decode_attention: too many heads");
    decode_attention_combine_kernel<T><<<unsigned(heads), D, 0, stream>>>(ws_acc, ws_ml, static_cast<T*>(a.out),
                                                                          int(a.nsplit), D);
    cuda::check_launch("decode_attention_combine_kernel");
  }
}

// Query heads per block: exactly G for G <= 4 (Llama-3.2-3B / Higgs: G = 3), else 8 (padded; groups larger
// than 8 take several blocks per KV head, each re-reading K/V).
template <typename T, int D>
void launch_heads(const DecodeAttentionArgs& a, cudaStream_t stream) {
  switch (a.Hq / a.Hkv) {
    case 1: return launch_split<T, D, 1>(a, stream);
    case 2: return launch_split<T, D, 2>(a, stream);
    case 3: return launch_split<T, D, 3>(a, stream);
    case 4: return launch_split<T, D, 4>(a, stream);
    default: return launch_split<T, D, 8>(a, stream);
  }
}

template <typename T>
void launch_dim(const DecodeAttentionArgs& a, cudaStream_t stream) {
  switch (a.D) {
    case 64: return launch_heads<T, 64>(a, stream);
    case 128: return launch_heads<T, 128>(a, stream);
    default: throw std::invalid_argument("higgs_rt decode_attention: head dim must be 64 or 128");
  }
}

}  // namespace

void decode_attention_cuda(const DecodeAttentionArgs& a, int device, void* stream) {
  if (a.B == 0 || a.Hq == 0) return;
  if (a.Hkv < 1 || a.Hq % a.Hkv != 0 || a.S < 0 || a.nsplit < 1)
    throw std::invalid_argument("higgs_rt decode_attention: bad sizes");
  if (a.nsplit > 1 && a.workspace == nullptr)
    throw std::invalid_argument("higgs_rt decode_attention: nsplit > 1 needs a workspace");
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.k) |
                         reinterpret_cast<uintptr_t>(a.v) | reinterpret_cast<uintptr_t>(a.workspace);
  if (bits % 16 != 0) throw std::invalid_argument("higgs_rt decode_attention: q, caches, workspace must be 16-byte aligned");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  cuda::dispatch(a.dtype, [&](auto t) { launch_dim<typename decltype(t)::type>(a, s); });
}

}  // namespace higgs_rt
