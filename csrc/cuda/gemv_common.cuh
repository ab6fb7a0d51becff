// The decode GEMV family's shared pieces (gemv.cu's k-split kernels and gemv_tiled.cu's tiled ones): the MMA,
// which weight rows a 16-row tile multiplies, the epilogues' reads and stores, and the shared-memory opt-in. Both
// kernels feed each output the same MMAs in the same order and store it through `store`, so a row's bits do not
// depend on which kernel ran.
#pragma once

#include <type_traits>

#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {

// gemv_tiled.cu: whether `a` runs as the tiled GEMM on `device` (its plan_for: 17-64 rows, by default above 32, K %
// 1024 == 0, a norm epilogue's x normed by the pre-pass, the shapes where it wins), and its launch, after that
// pre-pass.
bool gemv_tiled_applies(const GemvArgs& a, int device);
void gemv_tiled_cuda(const GemvArgs& a, int device, cudaStream_t stream);

namespace {

constexpr int kWarps = 8;
constexpr int kVec = 8;  // elements per 16-byte vector
using Epi = GemvEpilogue;

__device__ __forceinline__ uint4 ld_cached(const void* p) {  // norm weights: constant, shared by all blocks
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

using cuda::allow_smem;
using cuda::cp_async16;
using cuda::cp_async_commit;
using cuda::cp_async_wait;
using cuda::fits_smem;
using cuda::fits_smem_twice;

// C (16x8, f32) += A (16x16) * B (16x8), A and B of type T (bf16 or f16): one warp-wide tensor-core MMA.
#define HIGGS_RT_MMA_16816(ab)                                                                             \
  asm("mma.sync.aligned.m16n8k16.row.col.f32." ab "." ab ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
      "{%0, %1, %2, %3};"                                                                                  \
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                     \
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1))

template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "mma: bf16 or f16 only");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    HIGGS_RT_MMA_16816("bf16");
  } else {
    HIGGS_RT_MMA_16816("f16");
  }
}
#undef HIGGS_RT_MMA_16816

template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[kVec]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = cuda::to_f32(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[kVec]) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = cuda::from_f32<T>(f[i]);
  return v;
}

__host__ __device__ constexpr bool has_norm(Epi e) { return e == Epi::kNormSilu || e == Epi::kNormRope || e == Epi::kNormLogits; }

// Weight rows of tile `tile`'s rows g (first) and g + 8 (second).
template <Epi E>
__device__ __forceinline__ void tile_rows(const GemvArgs& p, int64_t tile, int g, int64_t& ra, int64_t& rb) {
  if constexpr (E == Epi::kNormSilu) {  // gate row i, up row i
    ra = tile * 8 + g;
    rb = ra + p.N / 2;
  } else if constexpr (E == Epi::kNormRope) {  // head dims d, d + D/2
    const int64_t per_head = p.D / 16;
    ra = (tile / per_head) * p.D + (tile % per_head) * 8 + g;
    rb = ra + p.D / 2;
  } else {
    ra = tile * 16 + g;
    rb = ra + 8;
  }
}

// GemvArgs::ahead: this block's share of the ahead runs' 128-byte lines, asked of L2 at GemvArgs::ahead_at (the bus
// is otherwise idle through decode attention at few slots: NOTES.md), a prefetch a line or, with ahead_bulk on
// sm_90, one bulk prefetch a run by one thread (the per-line prefetches held o-proj's blocks 2-5 us on an H100:
// an SM's requests are finite).
__device__ __noinline__ void ahead_lines(const char* base, int64_t run_bytes, int64_t runs, int64_t stride, int bulk) {
  const unsigned per_part = unsigned((run_bytes + 127) / 128), lines = per_part * unsigned(runs);
  const unsigned share = (lines + gridDim.x - 1) / gridDim.x, first = blockIdx.x * share;
  const unsigned last = first + share < lines ? first + share : lines;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bulk) {  // one bulk request per run the block's lines touch, by one thread: no warp waits on it
    if (threadIdx.x == 0) {
      for (unsigned i = first; i < last;) {
        const unsigned part = i / per_part, end = min(last, (part + 1) * per_part);
        const unsigned from = (i - part * per_part) * 128, to = min((end - part * per_part) * 128, unsigned(run_bytes));
        cuda::prefetch_l2_bulk(base + int64_t(part) * stride + from, to - from);
        i = end;
      }
    }
    return;
  }
#endif
  for (unsigned i = first + threadIdx.x; i < last; i += blockDim.x)
    cuda::prefetch_l2(base + int64_t(i / per_part) * stride + int64_t(i % per_part) * 128);
}

// (a call, not inlined: inlined at its call sites it moved the logits kernels' allocation into 4-20 bytes of
// spills at 80 registers, ptxas sm_90a; the arguments go by value, so the kernel's parameters stay in place)
__device__ __forceinline__ void gemv_ahead(const GemvArgs& p) {
  if (p.ahead != nullptr)
    ahead_lines(static_cast<const char*>(p.ahead), p.ahead_part_bytes, p.ahead_parts, p.ahead_stride, p.ahead_bulk);
}

// The pre-pass's workspace: x * norm_weight [B, K] of T, then each row's scale [B] fp32.
template <typename T>
__device__ __forceinline__ const float* prenorm_scale(const GemvArgs& p) {
  return reinterpret_cast<const float*>(static_cast<const T*>(p.prenorm) + p.B * p.K);
}

// What an epilogue reads that an earlier kernel wrote, for the batch columns 2t, 2t + 1 of the storing warp's
// tile: fetched right after the PDL wait, so that no block ends on an L2 round trip.
template <typename T, int M, Epi E, bool PRE>
struct Pending {
  float res[M][2][2] = {};  // kResidual: residual[batch][ra / rb]
  int64_t pos[2] = {};      // kNormRope: the slot's position, clamp(lengths[batch], 0, S - 1)
  float scale[2] = {};      // PRE: the row's norm scale, from the pre-pass

  __device__ __forceinline__ void fetch(const GemvArgs& p, const int64_t (&ra)[M], const int64_t (&rb)[M], int b0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int batch = b0 + h;
      if (batch >= p.B) continue;
      if constexpr (PRE) scale[h] = __ldcg(prenorm_scale<T>(p) + batch);
      if constexpr (E == Epi::kResidual) {
        const T* r = static_cast<const T*>(p.residual) + int64_t(batch) * p.N;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (ra[m] < p.N) res[m][h][0] = cuda::to_f32(__ldcg(r + ra[m]));
          if (rb[m] < p.N) res[m][h][1] = cuda::to_f32(__ldcg(r + rb[m]));
        }
      } else if constexpr (E == Epi::kNormRope) {
        const int64_t len = __ldcg(p.lengths + batch);
        pos[h] = len < 0 ? 0 : (len > p.S - 1 ? p.S - 1 : len);
      }
    }
  }
};

template <typename T, int M, Epi E, bool PRE>
__device__ __forceinline__ void store(const GemvArgs& p, const Pending<T, M, E, PRE>& pending, int m, int64_t ra,
                                      int64_t rb, int batch, int h, float ca, float cb) {
  if (batch >= p.B) return;
  if constexpr (E == Epi::kPlain || E == Epi::kResidual || E == Epi::kNormLogits) {
    const int64_t base = int64_t(batch) * p.N;
    if constexpr (E == Epi::kResidual) {
      ca += pending.res[m][h][0];
      cb += pending.res[m][h][1];
    }
    if constexpr (E == Epi::kNormLogits) {
      float* y = static_cast<float*>(p.y) + base;
      if (ra < p.N) y[ra] = cuda::to_f32(cuda::from_f32<T>(ca));
      if (rb < p.N) y[rb] = cuda::to_f32(cuda::from_f32<T>(cb));
    } else {
      T* y = static_cast<T*>(p.y) + base;
      if (ra < p.N) y[ra] = cuda::from_f32<T>(ca);
      if (rb < p.N) y[rb] = cuda::from_f32<T>(cb);
    }
  } else if constexpr (E == Epi::kNormSilu) {
    const int64_t hidden = p.N / 2;
    const float silu = ca / (1.f + expf(-ca));
    static_cast<T*>(p.y)[int64_t(batch) * hidden + ra] = cuda::from_f32<T>(silu * cb);
  } else {  // kNormRope
    const int64_t D = p.D, half = D / 2, head = ra / D, d = ra % D;
    const int64_t pos = pending.pos[h];
    float oa = ca, ob = cb;
    if (head < p.Hq + p.Hkv) {
      float sn, cs;
      sincosf(float(pos) * p.inv_freq[d], &sn, &cs);
      oa = ca * cs - cb * sn;
      ob = cb * cs + ca * sn;
    }
    T* dst;
    if (head < p.Hq) {
      dst = static_cast<T*>(p.y) + (int64_t(batch) * p.Hq + head) * D;
    } else {
      const bool is_k = head < p.Hq + p.Hkv;
      const int64_t kv_head = head - p.Hq - (is_k ? 0 : p.Hkv);
      dst = static_cast<T*>(is_k ? p.k_cache : p.v_cache) + ((int64_t(batch) * p.Hkv + kv_head) * p.S + pos) * D;
    }
    dst[d] = cuda::from_f32<T>(oa);
    dst[d + half] = cuda::from_f32<T>(ob);
  }
}

}  // namespace
}  // namespace higgs_rt
