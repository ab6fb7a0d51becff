// CUDA decode GEMV family: y = epilogue(x[B, K] @ w[N, K]^T), 1 <= B <= 64, bf16/fp16, fp32 accumulation,
// with an optional RMSNorm prologue and the epilogues of csrc/ops.h (plain, + residual, SiLU(gate) * up,
// RoPE + KV-cache write, logits). One kernel per decode-step matmul: the norms, RoPE, cache writes, residual
// adds and SwiGLU of a Llama layer ride along with the weight stream instead of being ~40 small kernels.
//
// Memory-bound: the goal is to stream w once at HBM speed.
//   block   = 8 warps on M tiles of 16 output rows; warp v takes k-slices v, v + 8, ... (in-block split-K);
//             the 8 partial tiles are summed through shared memory in warp order. Grid = one block per M tiles.
//             M = 1 up to 16 slots; above, M = 2 tiles share every x vector a warp loads from L2 (with one
//             tile per block x is read NT / 2 times per weight byte: batch-64 step 13.45 -> 10.58 ms, NOTES.md).
//   math    = tensor cores, mma.sync m16n8k16: the 16 rows are the MMA's m, the batch its n, in NT tiles of 8
//             (NT = 1, 2, 4, 8 for B <= 8, 16, 32, 64); rows >= B are clamped copies never stored.
//   loads   = every lane issues 2 * U 16-byte loads of w (rows g and g + 8 of its tile, g = lane / 4) before
//             any math: U KB of w in flight per warp (an opaque zero ties every loaded word into the first MMA,
//             else ptxas interleaves loads and MMAs: checked in the SASS). w bypasses L1; x, read by every
//             block, stays in L1/L2.
//   norm    = x is read whole by every block anyway: the block sums x^2 from the vectors it loads, feeds
//             x * norm_weight (rounded to T) to the MMAs and scales the sums by rsqrt(mean + eps) at the end.
//   rows    = which weight rows a tile's rows g / g + 8 are is the epilogue's choice: SiLU pairs gate row i
//             with up row i, RoPE pairs head dims d and d + D/2, so each lane holds both halves it combines.
//   PDL     = the block lets the next kernel launch, then waits for the previous kernel before touching x (read
//             at L2: an SM's L1 may hold lines from before the previous kernel's writes, which made graphed
//             steps differ run to run). Streaming the block's weight rows into L2 before the wait was measured
//             slower (H200, B = 1, 20 chained calls: 3072 -> 16384 at 3.07 TB/s with it, 3.55 without; the step
//             2.64 -> 2.38 ms), as was U = 8 or 12 for K = 3072 (2.3 and 2.0 TB/s on 3072 -> 5120 against 2.7).
//   batch   = the k-split (8 warps x U vectors) and every summation order depend on K only, never on B:
//             each slot's row is computed the same way whatever else is in the batch.
// Every load address is in bounds (clamped rows, the k-tail reads its row start with x zeroed). No host sync,
// no allocation; one launch on the caller's stream.
#include <cstdlib>
#include <type_traits>

#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

constexpr int kWarps = 8;
constexpr int kVec = 8;  // elements per 16-byte vector
using Epi = GemvEpilogue;

__device__ __forceinline__ uint4 ld_stream(const void* p) {  // read-once weights: skip L1
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) {  // norm weights: constant, shared by all blocks
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

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

template <typename T, Epi E>
__device__ __forceinline__ void store(const GemvArgs& p, int64_t tile, int g, int64_t ra, int64_t rb, int batch,
                                      float ca, float cb) {
  if (batch >= p.B) return;
  if constexpr (E == Epi::kPlain || E == Epi::kResidual || E == Epi::kNormLogits) {
    const int64_t base = int64_t(batch) * p.N;
    if constexpr (E == Epi::kResidual) {
      const T* res = static_cast<const T*>(p.residual) + base;
      if (ra < p.N) ca += cuda::to_f32(__ldcg(res + ra));
      if (rb < p.N) cb += cuda::to_f32(__ldcg(res + rb));
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
    int64_t pos = __ldcg(p.lengths + batch);
    pos = pos < 0 ? 0 : (pos > p.S - 1 ? p.S - 1 : pos);
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

// NT: batch tiles of 8; U: 16-byte vectors per lane per row per iteration; M: row tiles per block, sharing
// every x vector a warp loads (M = 1 at small batch; above, x would be read from L2 NT / 2 times per weight).
template <typename T, int NT, int U, int M, Epi E>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const GemvArgs p, int64_t tiles, uint32_t opaque_zero) {
  constexpr bool kNorm = has_norm(E);
  constexpr int kWarpK = 4 * kVec;     // k covered by the 4 lanes of a group per vector: 32
  constexpr int kIterK = kWarpK * U;   // k per warp per iteration
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t N = p.N, K = p.K;
  int64_t tile[M], ra[M], rb[M];
  const T* wa[M];
  const T* wb[M];
  const T* w = static_cast<const T*>(p.w);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    tile[m] = int64_t(blockIdx.x) * M + m;
    tile_rows<E>(p, tile[m] < tiles ? tile[m] : tiles - 1, g, ra[m], rb[m]);  // a tile past the end: loaded, not stored
    wa[m] = w + (ra[m] < N ? ra[m] : N - 1) * K;
    wb[m] = w + (rb[m] < N ? rb[m] : N - 1) * K;
  }

  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();

  const T* x = static_cast<const T*>(p.x);
  const T* gamma = static_cast<const T*>(p.norm_weight);
  const int64_t k_lane_end = K - kVec * t;  // vector j at k0 + 32 j is in range iff k0 + 32 j < k_lane_end
  float acc[M][NT][4] = {};
  float sumsq[NT] = {};

  for (int64_t k0 = int64_t(warp) * kIterK; k0 < K; k0 += int64_t(kWarps) * kIterK) {
    int64_t off[U];
    uint4 va[M][U], vb[M][U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = k0 + kWarpK * j;
      off[j] = k < k_lane_end ? k + kVec * t : 0;
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < U; ++j) {
        va[m][j] = ld_stream(wa[m] + off[j]);
        vb[m][j] = ld_stream(wb[m] + off[j]);
      }
    }
    uint32_t all = 0;  // depends on every weight load; `& opaque_zero` makes it 0 without the compiler knowing
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int j = 0; j < U; ++j) all ^= va[m][j].x ^ vb[m][j].x;
    }
    all &= opaque_zero;
    float gm[kNorm ? U : 1][kVec];
    if constexpr (kNorm) {
#pragma unroll
      for (int j = 0; j < U; ++j) unpack<T>(ld_cached(gamma + off[j]), gm[j]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int row = nt * 8 + g;
      const T* xr = x + int64_t(row < p.B ? row : 0) * K;
      uint4 vx[U];
#pragma unroll
      for (int j = 0; j < U; ++j) vx[j] = cuda::load_cg(xr + off[j]);  // x: the previous kernel's output
      vx[0].y ^= all;  // every MMA below waits for every weight load
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (k0 + kWarpK * j >= k_lane_end) vx[j] = make_uint4(0, 0, 0, 0);  // past K: contributes 0
        if constexpr (kNorm) {
          float xf[kVec];
          unpack<T>(vx[j], xf);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            sumsq[nt] = fmaf(xf[i], xf[i], sumsq[nt]);
            xf[i] *= gm[j][i];
          }
          vx[j] = pack<T>(xf);
        }
        // A regs: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); B: (k 2t..), (k 2t+8..)
        // Each accumulator takes its MMAs in the order of k whatever M and NT are: the sums do not depend on B.
#pragma unroll
        for (int m = 0; m < M; ++m) {
          mma<T>(acc[m][nt], va[m][j].x, vb[m][j].x, va[m][j].y, vb[m][j].y, vx[j].x, vx[j].y);
          mma<T>(acc[m][nt], va[m][j].z, vb[m][j].z, va[m][j].w, vb[m][j].w, vx[j].z, vx[j].w);
        }
      }
    }
  }

  // acc[m][nt]: [0] = C[g][2t], [1] = C[g][2t+1], [2] = C[g+8][2t], [3] = C[g+8][2t+1] (C[row][batch - 8 nt]).
  extern __shared__ float smem[];  // partial[kWarps][NT][4][32], then sq[kWarps][NT][8]
  float* sq = smem + kWarps * NT * 4 * 32;
  if constexpr (kNorm) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float s = sumsq[nt];
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (t == 0) sq[(warp * NT + nt) * 8 + g] = s;
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m > 0) __syncthreads();  // the previous tile's partials are read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) smem[((warp * NT + nt) * 4 + i) * 32 + lane] = acc[m][nt][i];
    }
    __syncthreads();
    if (tile[m] >= tiles) continue;
    for (int nt = warp; nt < NT; nt += kWarps) {
      float c[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < kWarps; ++v) s += smem[((v * NT + nt) * 4 + i) * 32 + lane];
        c[i] = s;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // batch columns 2t, 2t + 1 of this batch tile
        float scale = 1.f;
        if constexpr (kNorm) {
          float s = 0.f;
#pragma unroll
          for (int v = 0; v < kWarps; ++v) s += sq[(v * NT + nt) * 8 + 2 * t + h];
          scale = rsqrtf(s / float(K) + p.eps);
        }
        store<T, E>(p, tile[m], g, ra[m], rb[m], nt * 8 + 2 * t + h, c[h] * scale, c[2 + h] * scale);
      }
    }
  }
}

// Row tiles per block above 16 slots: 2 (halves the x traffic from L2; 255 registers, a few bytes spilled where
// the norm prologue rides along), or 1 with $HIGGS_RT_GEMV_TILES=1, for measuring. Either gives the same bits.
inline int tiles_per_block(int64_t B) {
  static const int forced = [] {
    const char* v = std::getenv("HIGGS_RT_GEMV_TILES");
    return v ? std::atoi(v) : 2;
  }();
  return B > 16 && forced != 1 ? 2 : 1;
}

template <typename T, int NT, int U, int M, Epi E>
void launch(const GemvArgs& a, int64_t tiles, cudaStream_t stream, int device) {
  const size_t smem = sizeof(float) * kWarps * NT * (4 * 32 + 8);
  cuda::launch(gemv_kernel<T, NT, U, M, E>, dim3(unsigned((tiles + M - 1) / M)), dim3(kWarps * 32), smem, stream,
               device, cuda::kPdlGemv, "gemv_kernel", a, tiles, /*opaque_zero=*/0u);
}

template <typename T, int U, Epi E>
void launch_batch(const GemvArgs& a, int64_t tiles, cudaStream_t s, int device) {
  if (a.B <= 8) return launch<T, 1, U, 1, E>(a, tiles, s, device);
  if (a.B <= 16) return launch<T, 2, U, 1, E>(a, tiles, s, device);
  const bool two = U == 4 && tiles_per_block(a.B) == 2;  // U = 8 with 2 tiles spills (255 registers)
  if (a.B <= 32) return two ? launch<T, 4, U, 2, E>(a, tiles, s, device) : launch<T, 4, U, 1, E>(a, tiles, s, device);
  return two ? launch<T, 8, U, 2, E>(a, tiles, s, device) : launch<T, 8, U, 1, E>(a, tiles, s, device);
}

// U = 4 vectors (32 KB of w in flight per block) for K < 4096; U = 8 (64 KB) for the long rows of the MLP down
// projection (K = 8192, N = 3072: only 192 blocks). With K = 3072 (8192) every warp runs 3 (4) iterations.
// Only the plain and residual epilogues meet the long rows; the others take U = 4 for any K.
template <typename T>
void launch_for(const GemvArgs& a, cudaStream_t s, int device) {
  switch (a.epilogue) {
    case Epi::kPlain:
      return a.K >= 4096 ? launch_batch<T, 8, Epi::kPlain>(a, (a.N + 15) / 16, s, device)
                         : launch_batch<T, 4, Epi::kPlain>(a, (a.N + 15) / 16, s, device);
    case Epi::kResidual:
      return a.K >= 4096 ? launch_batch<T, 8, Epi::kResidual>(a, (a.N + 15) / 16, s, device)
                         : launch_batch<T, 4, Epi::kResidual>(a, (a.N + 15) / 16, s, device);
    case Epi::kNormSilu: return launch_batch<T, 4, Epi::kNormSilu>(a, a.N / 16, s, device);
    case Epi::kNormRope: return launch_batch<T, 4, Epi::kNormRope>(a, a.N / 16, s, device);
    case Epi::kNormLogits: return launch_batch<T, 4, Epi::kNormLogits>(a, (a.N + 15) / 16, s, device);
  }
}

}  // namespace

void gemv_cuda(const GemvArgs& a, int device, void* stream) {
  if (a.N == 0 || a.B == 0) return;
  if (a.B < 1 || a.B > 64 || a.K % 8 != 0 || a.K < 8) throw std::invalid_argument("higgs_rt gemv: need 1 <= B <= 64, K % 8 == 0");
  if ((reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.w)) % 16 != 0 ||
      (has_norm(a.epilogue) && reinterpret_cast<uintptr_t>(a.norm_weight) % 16 != 0))
    throw std::invalid_argument("higgs_rt gemv: x, w and the norm weight must be 16-byte aligned");
  if (a.epilogue == Epi::kNormSilu && a.N % 16 != 0) throw std::invalid_argument("higgs_rt gemv: gate/up rows % 16 != 0");
  if (a.epilogue == Epi::kNormRope && (a.D % 16 != 0 || a.N != (a.Hq + 2 * a.Hkv) * a.D))
    throw std::invalid_argument("higgs_rt gemv: qkv rows must be (Hq + 2 Hkv) * D with D % 16 == 0");
  if ((a.N + 15) / 16 > 0x7fffffff) throw std::invalid_argument("higgs_rt gemv: N too large");
  if (a.dtype == TableDType::kFloat32) throw std::invalid_argument("higgs_rt gemv: dtype must be bfloat16 or float16");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  cuda::dispatch(a.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if constexpr (!std::is_same_v<T, float>) launch_for<T>(a, s, device);  // tensor-core MMAs take 16-bit inputs
  });
}

}  // namespace higgs_rt
