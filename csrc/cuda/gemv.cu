// CUDA decode GEMV family: y = epilogue(x[B, K] @ w[N, K]^T), 1 <= B <= 64, bf16/fp16, fp32 accumulation,
// with an optional RMSNorm prologue and the epilogues of csrc/ops.h (plain, + residual, SiLU(gate) * up,
// RoPE + KV-cache write, logits). One kernel per decode-step matmul: the norms, RoPE, cache writes, residual
// adds and SwiGLU of a Llama layer ride along with the weight stream instead of being ~40 small kernels.
//
// Memory-bound: the goal is to stream w once at HBM speed.
//   block   = 8 warps on M tiles of 16 output rows; warp v takes k-slices v, v + 8, ... of 128 columns (U = 4
//             vectors of 32; in-block split-K); the 8 partial tiles are summed through shared memory in warp
//             order. Grid = one block per M tiles (a grid of the blocks resident at once, each looping over
//             tiles with its ring running on across them, lost: gate/up 51.7 against 39.8 us a layer, H100,
//             b58d89b; likely blocks that waited for o-proj's to leave still had their whole share of tiles).
//             M = 1 up to 16 slots; above, M = 2 tiles share every x vector a warp loads from L2 (one tile per
//             block read x NT / 2 times per weight byte: batch-64 step 13.45
//             -> 10.58 ms, NOTES.md).
//   math    = tensor cores, mma.sync m16n8k16: the 16 rows are the MMA's m, the batch its n, in NT tiles of 8
//             (NT = 1, 2, 4, 8 for B <= 8, 16, 32, 64); rows >= B are clamped copies never stored.
//   loads   = w streams through a per-thread ring in shared memory (cp.async, L2 only): a lane copies the 16-byte
//             vectors it will itself multiply (rows g and g + 8 of its tile, g = lane / 4), R steps ahead, and
//             waits for its own copies only: no barrier in the loop. The bytes in flight (64 KB per block at
//             R = 8; 4 with a norm epilogue above 8 slots, as measured) no longer cost registers: the register version,
//             which loaded U vectors before any math, reached 2.6-3.55 TB/s at batch 1 and spilled at U = 8
//             (step 2.32 -> 2.23 ms, batch 64 10.58 -> 6.41, NOTES.md). x, read by every block, comes from L2,
//             XP steps ahead in registers up to 16 slots, above through the ring with the weights (6.65 -> 6.48
//             ms at batch 64 on an H100: with one step ahead the step waited on x's round trip). Blocks in
//             clusters of 2 or 4 sharing x through their rings (ld.shared::cluster, a cluster barrier a step)
//             lost: 6.71 -> 10.23 / 11.80 ms on an H100, and so did 8 warps on 8 row tiles with x in shared
//             memory, read once per 128 rows (6.49 -> 6.92 ms, gate/up alone; NOTES.md). At up to 8 slots
//             (RC) the warp copies a round (U steps) together instead, 2 rows x 256 contiguous bytes an
//             instruction, into its own swizzled slot, a __syncwarp a round: whole 128-byte lines per request
//             (batch-1 GEMVs +4-21%, step 2.47 -> 2.39 ms on an H100; row_copies).
//   norm    = x is read whole by every block anyway: the block sums x^2 from the vectors it loads, feeds
//             x * norm_weight (rounded to T) to the MMAs and scales the sums by rsqrt(mean + eps) at the end.
//             From kGemvPrenormMinRows rows on (PRE), that arithmetic (B x K per block, 8x the MMAs' instructions
//             at 64 rows) runs once, in a pre-pass kernel that writes x * norm_weight and each row's scale,
//             summed in this kernel's order (the same bits as batch 1's fused norm), and the GEMV reads those
//             (H100, same call: batch-64 step 6.467 -> 6.000 ms; 4 row tiles a block for gate/up on top, x's L2
//             traffic 2x the weights' instead of 3x, lost: 5.989 -> 6.037; NOTES.md).
//   rows    = which weight rows a tile's rows g / g + 8 are is the epilogue's choice: SiLU pairs gate row i
//             with up row i, RoPE pairs head dims d and d + D/2, so each lane holds both halves it combines.
//   PDL     = the block copies its first R weight steps (weights are constant), lets the next kernel launch,
//             then waits for the previous kernel before touching x, the residual or the lengths (read at L2:
//             an SM's L1 may hold lines from before the previous kernel's writes, which made graphed steps
//             differ run to run). What the epilogue reads (residual, positions) is fetched right after the
//             wait, so no block ends on an L2 round trip. With GemvArgs::ahead (o-proj, the head) the blocks
//             also ask L2 for a later kernel's first weights, where GemvArgs::ahead_at says (gemv_ahead).
//   batch   = the k-split (8 warps x 4 vectors) and every summation order depend on K only, never on B:
//             each slot's row is computed the same way whatever else is in the batch.
// Every load address is in bounds (clamped rows, the k-tail reads its row start with x zeroed). No host sync,
// no allocation; one launch on the caller's stream.
#include "gemv_common.cuh"

namespace higgs_rt {
namespace {

// RMSNorm's scale for batch column `col` of batch tile nt, from the sums of squares per warp sq[kWarps][NT][8],
// added in warp order.
template <int NT>
__device__ __forceinline__ float norm_scale(const float* sq, int nt, int col, int64_t K, float eps) {
  float s = 0.f;
#pragma unroll
  for (int v = 0; v < kWarps; ++v) s += sq[(v * NT + nt) * 8 + col];
  return rsqrtf(s / float(K) + eps);
}

// NT: batch tiles of 8; U: 16-byte vectors per lane per row per round (the k-split: warp v takes columns
// [32 U (v + 8 r), 32 U (v + 8 r + 1)) in round r); M: row tiles per block, sharing every x vector a warp loads;
// R: weight steps in flight per thread (a step = one vector of each of the block's 2 M rows per lane);
// XR: x (and the norm weight) travel through the ring too, R steps ahead, instead of XP steps ahead in
// registers (at NT = 8 registers allow one step: the step then waits an L2 round trip for x).
// PRE: a norm epilogue's x was normed by gemv_prenorm_kernel: x is p.prenorm, the scales follow it.
// MINB: blocks per SM the registers must allow.
// RC: the weights are copied a round (U steps) at a time by the warp's lanes together, 256 contiguous bytes of
// each of the tile's 16 rows, 16 lanes a row, and read back through a swizzled warp-own slot (see row_copies).
template <typename T, int NT, int U, int M, int R, Epi E, bool XR, bool PRE, int MINB, bool RC = false>
__global__ void __launch_bounds__(kWarps * 32, MINB) gemv_kernel(const GemvArgs p, int64_t tiles) {
  static_assert(!PRE || has_norm(E), "the pre-pass serves the norm epilogues");
  static_assert(!RC || (M == 1 && !XR && U == 4 && R % U == 0), "row copies: one tile, x in registers, whole rounds");
  constexpr bool kNorm = has_norm(E) && !PRE;  // the norm's arithmetic in this kernel
  constexpr int kSlot = 2 * M + (XR ? NT + (kNorm ? 1 : 0) : 0);  // ring vectors per thread per step
  constexpr int kWarpK = 4 * kVec;     // k covered by the 4 lanes of a group per vector: 32
  constexpr int kIterK = kWarpK * U;   // k per warp per round
  constexpr int kThreads = kWarps * 32;
  // The ops that take the hint. The head asks first thing at placement 1 too: after its wait, beside its ring's
  // pointers, the hint's code spilled 4-20 bytes at 80 registers (ptxas, sm_90a).
  constexpr bool kAhead = E == Epi::kResidual || E == Epi::kNormLogits;
  if (kAhead && (p.ahead_at == 0 || (E == Epi::kNormLogits && p.ahead_at == 1))) gemv_ahead(p);
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
  const int64_t k_lane_end = K - kVec * t;  // vector j at k0 + 32 j is in range iff k0 + 32 j < k_lane_end
  const int64_t k_warp = int64_t(warp) * kIterK;
  const int steps = K > k_warp ? int((K - k_warp + kWarps * kIterK - 1) / (kWarps * kIterK)) * U : 0;
  auto k_of = [&](int s) { return k_warp + int64_t(s / U) * (kWarps * kIterK) + kWarpK * (s % U); };

  // The ring: slot s % R of thread i holds step s's vectors at ring[(s % R) * kSlot + v][i]: v = 2 m (+ 1) for
  // tile m's rows g (g + 8), then with XR x's NT vectors and the norm weight's. A thread reads back only what
  // it copied itself, so a cp.async wait is the only synchronisation (RC: a warp's lanes read each other's
  // copies, after a __syncwarp).
  extern __shared__ uint4 ring[];
  const T* x = static_cast<const T*>(PRE ? p.prenorm : p.x);
  const T* gamma = static_cast<const T*>(p.norm_weight);
  auto slot_of = [&](int s) { return ring + (s % R) * kSlot * kThreads + threadIdx.x; };
  auto lane_off = [&](int s) {  // past K: the row start, multiplied by x = 0
    const int64_t k = k_of(s);
    return k < k_lane_end ? k + kVec * t : int64_t(0);
  };
  auto issue_w = [&](int s) {  // step s's weights (nothing past the last step)
    if (s >= steps) return;
    const int64_t off = lane_off(s);
    uint4* slot = slot_of(s);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      cp_async16(slot + (2 * m) * kThreads, wa[m] + off);
      cp_async16(slot + (2 * m + 1) * kThreads, wb[m] + off);
    }
  };
  auto issue_x = [&](int s) {  // XR: step s's x rows (slots past B: row 0, never stored) and norm weight
    if (s >= steps) return;
    const int64_t off = lane_off(s);
    uint4* slot = slot_of(s) + 2 * M * kThreads;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int row = nt * 8 + g;
      cp_async16(slot + nt * kThreads, x + int64_t(row < p.B ? row : 0) * K + off);
    }
    if constexpr (kNorm) cp_async16(slot + NT * kThreads, gamma + off);
  };
  auto issue = [&](int s) {  // one commit group per step, empty past the last
    issue_w(s);
    if constexpr (XR) issue_x(s);
    cp_async_commit();
  };
  // RC: round r's 16 rows x 256 bytes of this warp's k-slice in the warp's own 4 KB of ring slot r % RR, row i's
  // 16-byte chunk c at i * 16 + (c ^ 4 (i & 1)): a quarter warp's reads (rows 2q, 2q + 1, chunks 4 j + t) then
  // fall in 8 distinct bank groups. Lane l copies chunk l % 16 of rows 2 i + l / 16 (tile_rows gives row g as
  // a base + g, so rows 0-7 and 8-15 follow from the lane's own; their addresses are computed a round at a
  // time: 8 pointers held in registers spilled at 3 blocks an SM).
  constexpr int RR = RC ? R / U : 1;
  const int64_t ra0 = ra[0] - g, rb0 = rb[0] - g;
  auto round_slot = [&](int r) { return ring + ((r % RR) * kWarps + warp) * 256; };
  auto issue_round = [&](int r) {  // one commit group per round, empty past the last
    if (r * U < steps) {
      const int c = lane % 16;
      const int64_t k = k_of(r * U) + kVec * c;
      const int64_t off = k < K ? k : 0;  // past K: the row start, multiplied by x = 0
      uint4* slot = round_slot(r);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = 2 * i + lane / 16;
        const int64_t wr = row < 8 ? ra0 + row : rb0 + (row - 8);
        cp_async16(slot + row * 16 + (c ^ ((row & 1) << 2)), w + (wr < N ? wr : N - 1) * K + off);
      }
    }
    cp_async_commit();
  };
  // Weights are constant: the first R steps stream while the previous kernel drains (copied after the wait
  // instead, the step took 2.51 ms against 2.26). With XR their x follows the wait, a group per step: the
  // groups are then w0..w(R-1), x0..x(R-1), then a step's w and x together, so R - 1 groups follow step s's
  // last one at its turn in the loop, as without XR.
  if constexpr (RC) {
#pragma unroll
    for (int r = 0; r < RR; ++r) issue_round(r);
  } else {
#pragma unroll
    for (int s = 0; s < R; ++s) {
      issue_w(s);
      cp_async_commit();
    }
  }
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  if constexpr (XR) {
#pragma unroll
    for (int s = 0; s < R; ++s) {
      issue_x(s);
      cp_async_commit();
    }
  }

  // What the epilogue reads that an earlier kernel wrote, fetched now so no block ends on an L2 round trip.
  Pending<T, M, E, PRE> pending;
  if (warp < NT) pending.fetch(p, ra, rb, warp * 8 + 2 * t);

  // x (and the norm weight) for step s + XP are loaded while step s is multiplied: a step's x is an L2 round
  // trip, which would otherwise sit between every two steps (measured: 2.32 -> 2.64 ms per step at batch 1).
  // With XR the ring holds them and XP is unused.
  constexpr int XP = NT <= 2 ? U : (NT == 4 ? 2 : 1);
  static_assert(U % XP == 0, "x slots must divide a round");
  uint4 xq[XR ? 1 : XP][XR ? 1 : NT], gq[XR ? 1 : XP];
  auto fetch_x = [&](int s, uint4(&vx)[XR ? 1 : NT], uint4& gv) {
    if (XR || s >= steps) return;
    const int64_t k = k_of(s);
    const bool in_k = k < k_lane_end;
    const int64_t off = in_k ? k + kVec * t : 0;
#pragma unroll
    for (int nt = 0; nt < (XR ? 1 : NT); ++nt) {
      const int row = nt * 8 + g;
      vx[nt] = in_k ? cuda::load_cg(x + int64_t(row < p.B ? row : 0) * K + off) : make_uint4(0, 0, 0, 0);  // past K: 0
    }
    if constexpr (kNorm) gv = ld_cached(gamma + off);
  };
  if constexpr (!XR) {
#pragma unroll
    for (int i = 0; i < XP; ++i) fetch_x(i, xq[i], gq[i]);
  }
  if constexpr (E == Epi::kResidual) {
    if (p.ahead_at == 1) gemv_ahead(p);  // behind this block's reads of the previous kernel's output
  }

  float acc[M][NT][4] = {};
  float sumsq[NT] = {};
  for (int s0 = 0; s0 < steps; s0 += U) {  // steps is whole rounds
    if constexpr (RC) {
      cp_async_wait<RR - 1>();  // this lane's copies of round s0 / U have landed,
      __syncwarp();             // and so have the other lanes'
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int s = s0 + j;
      uint4 vx[NT];
      float gm[kNorm ? kVec : 1];
      if constexpr (!XR) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) vx[nt] = xq[j % XP][nt];
        if constexpr (kNorm) unpack<T>(gq[j % XP], gm);
        fetch_x(s + XP, xq[j % XP], gq[j % XP]);
      }
      uint4 va[M], vb[M];
      if constexpr (RC) {
        const uint4* slot = round_slot(s0 / U);
        const int c = (4 * j + t) ^ ((g & 1) << 2);
        va[0] = slot[g * 16 + c];
        vb[0] = slot[(g + 8) * 16 + c];
      } else {
        cp_async_wait<R - 1>();  // step s has landed
        const uint4* slot = slot_of(s);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          va[m] = slot[(2 * m) * kThreads];
          vb[m] = slot[(2 * m + 1) * kThreads];
        }
      }
      if constexpr (XR) {
        const bool in_k = k_of(s) < k_lane_end;  // past K the ring holds the row start: x = 0 there
        const uint4* slot = slot_of(s);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) vx[nt] = in_k ? slot[(2 * M + nt) * kThreads] : make_uint4(0, 0, 0, 0);
        if constexpr (kNorm) unpack<T>(slot[(2 * M + NT) * kThreads], gm);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if constexpr (kNorm) {
          float xf[kVec];
          unpack<T>(vx[nt], xf);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            sumsq[nt] = fmaf(xf[i], xf[i], sumsq[nt]);
            xf[i] *= gm[i];
          }
          vx[nt] = pack<T>(xf);
        }
        // A regs: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); B: (k 2t..), (k 2t+8..)
        // Each accumulator takes its MMAs in the order of k whatever M and NT are: the sums do not depend on B.
#pragma unroll
        for (int m = 0; m < M; ++m) {
          mma<T>(acc[m][nt], va[m].x, vb[m].x, va[m].y, vb[m].y, vx[nt].x, vx[nt].y);
          mma<T>(acc[m][nt], va[m].z, vb[m].z, va[m].w, vb[m].w, vx[nt].z, vx[nt].w);
        }
      }
      if constexpr (!RC) issue(s + R);  // into the slot just read (its values are in registers, consumed above)
    }
    if constexpr (RC) {
      __syncwarp();  // every lane has read the round's slot
      issue_round(s0 / U + RR);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the reduction's scratch

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
        const float scale = kNorm ? norm_scale<NT>(sq, nt, 2 * t + h, K, p.eps) : (PRE ? pending.scale[h] : 1.f);
        store<T, M, E>(p, pending, m, ra[m], rb[m], nt * 8 + 2 * t + h, h, c[h] * scale, c[2 + h] * scale);
      }
    }
  }
  if (kAhead && p.ahead_at == 2) gemv_ahead(p);  // once the block's work is done
}

// The norm GEMVs' pre-pass from kGemvPrenormMinRows rows on: one warp per row writes x * norm_weight (rounded to
// T) and the row's scale rsqrt(mean(x^2) + eps) into p.prenorm. Lane 4 v + t sums the squares of the vectors that
// lane t of gemv_kernel's warp v multiplies (U = 4: k = 128 v + 1024 r + 32 j + 8 t), in that order, and the
// lanes' and warps' sums are added as there, so each row's scale has the bits of the fused norm at batch 1. All
// of a lane's loads are issued before its arithmetic (one L2 round trip for K <= 3072); the norm weight's before
// the PDL wait.
template <typename T, int kMaxVec>
__global__ void __launch_bounds__(kWarps * 32) gemv_prenorm_kernel(const GemvArgs p) {
  const int lane = threadIdx.x % 32, v = lane / 4, t = lane % 4;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32, K = p.K;
  if (row >= p.B) return;
  // (a lane with no vector below K never waits for the previous kernel: it reads and writes nothing, its sum is 0)
  auto k_of = [&](int i) { return int64_t(v) * 128 + int64_t(i / 4) * 1024 + 32 * (i % 4) + kVec * t; };
  const T* gamma = static_cast<const T*>(p.norm_weight);
  const T* x = static_cast<const T*>(p.x) + row * K;
  T* xn = static_cast<T*>(p.prenorm) + row * K;
  float s = 0.f;
  for (int i0 = 0; k_of(i0) < K; i0 += kMaxVec) {  // kMaxVec is whole rounds: k_of(i0) is the lane's next vector
    uint4 gv[kMaxVec], xv[kMaxVec];
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i)
      if (k_of(i0 + i) < K) gv[i] = ld_cached(gamma + k_of(i0 + i));
    if (i0 == 0) {
      cuda::allow_next_grid();
      cuda::wait_for_previous_grid();
    }
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i)
      if (k_of(i0 + i) < K) xv[i] = cuda::load_cg(x + k_of(i0 + i));
#pragma unroll
    for (int i = 0; i < kMaxVec; ++i) {
      if (k_of(i0 + i) >= K) continue;  // (the fused kernel adds x = 0 there: no change to the sum)
      float xf[kVec], gm[kVec];
      unpack<T>(xv[i], xf);
      unpack<T>(gv[i], gm);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        s = fmaf(xf[e], xf[e], s);
        xf[e] *= gm[e];
      }
      *reinterpret_cast<uint4*>(xn + k_of(i0 + i)) = pack<T>(xf);
    }
  }
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  float total = 0.f;  // norm_scale's order: warp 0's sum first
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += __shfl_sync(0xffffffffu, s, 4 * w);
  if (lane == 0) const_cast<float*>(prenorm_scale<T>(p))[row] = rsqrtf(total / float(K) + p.eps);
}

// Weight steps in flight per thread at up to 16 slots (H200, batch 1, 20 chained calls, 54cc071): 8 (64 KB of w
// per block) for the plain and residual GEMVs (3072 -> 3072 at 2.71 TB/s against 2.29 with 4; 8192 -> 3072 3.02
// against 2.60), 4 for the norm epilogues at 9-16 slots. At up to 8 slots the norm GEMVs (q/k/v, gate/up, logits)
// also copy 8 steps ahead: H100, one call (efa55a8, frame_latency_gpu_h100_efa55a8{,_ring_norm_8}.json) b1 2.507
// -> 2.501 ms, b8 2.761 -> 2.739, b8 at 500 positions 2.922 -> 2.904, b1 at 2000 2.596 -> 2.570; 12 steps (the
// whole K = 3072 slice of a block in flight before its PDL wait, two blocks an SM) lost: b1 2.646. Measuring only:
// $HIGGS_RT_GEMV_RING = 4 or 8 forces one everywhere; $HIGGS_RT_GEMV_RING_NORM = 4 or 12 sets the norm GEMVs' at
// up to 8 slots. Above 16 slots a block holds 2 row tiles and 4 steps (64 KB).
inline int ring_steps(Epi e, int nt) {
  static const int forced = cuda::env_int("HIGGS_RT_GEMV_RING", 0);
  static const int norm = cuda::env_int("HIGGS_RT_GEMV_RING_NORM", 8);
  if (forced == 4 || forced == 8) return forced;
  if (!has_norm(e)) return 8;
  return nt > 1 ? 4 : (norm == 4 || norm == 12 ? norm : 8);
}

// The residual GEMVs (o-proj, down) at up to 8 slots copy 12 steps ahead (96 KB a block, two blocks an SM), so
// the o-proj (K = 3072: 12 steps a warp) has all its weights in flight before its PDL wait, while attention leaves
// the bus idle (12-15 us a layer at batch 1). H100, 53a38e2, one call: batch 1 2.660 -> 2.598 ms, batch 8 2.896 ->
// 2.807, batch 64 unchanged; test_gemv passed under it; 8 of 8 server probes gave a request the same codes beside
// 63 others as alone (355badf, once the prefill's groups were fixed). Only where two blocks fit an SM. Loading
// all 12 of x's steps at once after the wait (one L2 round trip instead of three in a row) did not pay: batch 1
// 2.485 against 2.473 ms, batch 8 2.691 / 2.696, batch 64 5.771 / 5.752 (H100, 08f4d80, same call).
// $HIGGS_RT_GEMV_RING_RESIDUAL=8 keeps the plain 8-step ring, for measuring.
inline bool deep_residual_ring() {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_RING_RESIDUAL", 12) != 8;
  return on;
}

// Above 16 slots x travels through the ring (XR) where the device's shared memory holds it, else XP steps
// ahead in registers. At batch 64 (H100, 8a18196, one run) XR took the step from 6.653 to 6.482 ms; 4 row tiles
// a block for gate/up on top (x's L2 traffic halved, 255 registers with spills) lost: 6.890 (9a3793e).
// $HIGGS_RT_GEMV_XRING=0 keeps x in registers, for measuring.
inline bool x_ring_wanted() {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_XRING", 1) != 0;
  return on;
}

template <int NT, int M, int R, bool XR, bool kNorm>
constexpr size_t smem_bytes() {
  constexpr size_t kRing = sizeof(uint4) * R * (2 * M + (XR ? NT + (kNorm ? 1 : 0) : 0)) * kWarps * 32;
  constexpr size_t kReduce = sizeof(float) * kWarps * NT * (4 * 32 + 8);
  return kRing > kReduce ? kRing : kReduce;
}

template <typename T, int NT, int M, int R, Epi E, bool XR = false, bool PRE = false, int MINB = (NT == 1 ? 3 : 1),
          bool RC = false>
void launch(const GemvArgs& a, int64_t tiles, cudaStream_t stream, int device) {
  constexpr size_t kSmem = smem_bytes<NT, M, R, XR, has_norm(E) && !PRE>();  // RC's rounds fill the same bytes
  auto* kernel = gemv_kernel<T, NT, 4, M, R, E, XR, PRE, MINB, RC>;
  static const bool sized = allow_smem(kernel, kSmem);  // once per kernel
  (void)sized;
  cuda::launch(kernel, dim3(unsigned((tiles + M - 1) / M)), dim3(kWarps * 32), kSmem, stream, device,
               cuda::kPdlGemv, "gemv_kernel", a, tiles);
}

// Measuring only ($HIGGS_RT_GEMV_PAIRS=1): gate/up and the logits at up to 8 slots in blocks of 2 row tiles, 6 ring
// steps, two blocks an SM, instead of 1 tile, 8 steps, three an SM: gate/up's 1024 blocks then run in 1.94 waves of
// the GPU's 264 slots (an H100's or H200's 132 SMs) instead of 2.59 of 396, and the logits' 513 tiles in 0.97 of
// one instead of 1.30; about the same bytes in flight an SM (2 x 96 KB against 3 x 64 KB), each block's fixed
// costs (ramp, reduction, stores) spread over twice the bytes. The same sums in the same order.
inline bool pair_tiles() {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_PAIRS", 0) == 1;
  return on;
}

// At up to 8 slots the one-tile GEMVs copy their weights a round at a time, each warp instruction 2 rows x 256
// contiguous bytes (whole 128-byte lines), instead of each lane the vectors it multiplies (8 rows x 64 bytes an
// instruction: each line asked for by two instructions). H100, 2d55665, one call: batch 1 2.470 -> 2.393 ms
// (2.389 repeated), batch 8 2.661 -> 2.487, batch 8 at 500 positions 2.794 -> 2.621, batch 1 at 2000 2.542 ->
// 2.435; the chained batch-1 GEMVs +4-21% (3072 -> 16384 2.69 -> 3.03 TB/s, 3072 -> 8208 2.38 -> 2.87), ahead
// of cuBLAS on every shape. A __syncwarp a round is the price. The same vectors reach the same MMAs: the sums
// do not change (test_gemv's batch-invariance tests compare these against the 9-64-slot kernels).
// $HIGGS_RT_GEMV_ROWS=0 keeps each lane's own copies, for measuring.
inline bool row_copies() {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_ROWS", 1) != 0;
  return on;
}

// Where a block asks L2 for GemvArgs::ahead (gemv_ahead): $HIGGS_RT_L2_AHEAD_AT = 0 first thing, 1 (the default)
// after its PDL wait and its reads of the previous kernel's output (o-proj and down; the head: first thing), 2
// once its outputs are stored. H100, f949e68, 16 MB of gate/up asked by o-proj, one call against none: at 1 with
// bulk prefetches b1 2.375 / 2.398 ms, b1 at 2000 positions 2.444 / 2.467, b8 2.503 / 2.507, b8 at 500 2.637 /
// 2.645 (a line at a time 2.385 ... b8 2.537, 334b903); at 0 2.440 / 2.597 (b1 / b8), at 2 2.460 / 2.573: asked
// while attention runs, the hint slows attention's own loads. An earlier hint kernel lost too (b1 2.663 -> 3.150).
inline int ahead_at() {
  static const int at = cuda::env_int("HIGGS_RT_L2_AHEAD_AT", 1);
  return at >= 0 && at <= 2 ? at : 1;
}

// On sm_90 a block's share of the ahead hint goes as one bulk prefetch a run (the copy engine's), issued by one
// thread, instead of a prefetch a 128-byte line by every thread: the default; $HIGGS_RT_L2_AHEAD_BULK=0 asks by
// lines (measuring), as every device before sm_90 does.
inline bool ahead_bulk() {
  static const bool on = cuda::env_int("HIGGS_RT_L2_AHEAD_BULK", 1) != 0;
  return on;
}

template <typename T, int NT, int R, Epi E>
void launch_one_tile(const GemvArgs& a, int64_t tiles, cudaStream_t s, int device) {
  if constexpr (NT == 1) {
    if (row_copies()) return launch<T, 1, 1, R, E, false, false, 3, true>(a, tiles, s, device);
  }
  launch<T, NT, 1, R, E>(a, tiles, s, device);
}

template <typename T, int NT, Epi E>
void launch_ring(const GemvArgs& a, int64_t tiles, cudaStream_t s, int device) {
  if constexpr ((E == Epi::kNormSilu || E == Epi::kNormLogits) && NT == 1) {
    if (pair_tiles() && fits_smem_twice(device, smem_bytes<1, 2, 6, false, true>()))
      return launch<T, 1, 2, 6, E, false, false, 2>(a, tiles, s, device);
  }
  if constexpr (E == Epi::kResidual && NT == 1) {
    if (deep_residual_ring() && fits_smem_twice(device, smem_bytes<1, 1, 12, false, false>()))
      return launch_one_tile<T, 1, 12, E>(a, tiles, s, device);
  }
  if constexpr (has_norm(E) && NT == 1) {
    if (ring_steps(E, NT) == 12 && fits_smem_twice(device, smem_bytes<1, 1, 12, false, true>()))
      return launch<T, 1, 1, 12, E>(a, tiles, s, device);
  }
  if (ring_steps(E, NT) == 4) return launch<T, NT, 1, 4, E>(a, tiles, s, device);
  return launch_one_tile<T, NT, 8, E>(a, tiles, s, device);
}

// The XR variant above 16 slots, where it is wanted and the device's shared memory holds it (the 8-batch-tile
// ring, 3 steps of 13 vectors a thread, is 156 KB; the 4-batch-tile one, 4 steps of 9, 144 KB: the A100's 163 KB
// hold both).
template <int NT, int M, int R, Epi E>
bool use_x_ring(int device) {
  if (!x_ring_wanted()) return false;
  return fits_smem(device, smem_bytes<NT, M, R, true, has_norm(E)>());
}

// The norm's pre-pass where the op gave its workspace (kGemvPrenormMinRows rows and up) and the x ring runs.
// $HIGGS_RT_GEMV_PRENORM=0 keeps the norm in every block, for measuring.
inline bool prenorm_wanted(const GemvArgs& a) {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_PRENORM", 1) != 0;
  return on && a.prenorm != nullptr && a.B >= kGemvPrenormMinRows && x_ring_wanted();
}

template <typename T>
void launch_prenorm(const GemvArgs& a, cudaStream_t s, int device) {
  cuda::launch(gemv_prenorm_kernel<T, 12>, dim3(unsigned((a.B + kWarps - 1) / kWarps)), dim3(kWarps * 32), 0, s,
               device, cuda::kPdlGemv, "gemv_prenorm_kernel", a);
}

// Two blocks an SM for the pre-normed GEMVs whose grid (2-tile blocks) is larger than the SMs (q/k/v, gate/up,
// logits; o-proj and down have 96 blocks), each with a shallower ring (R2 steps): twice the warps to hide the
// latency, all blocks of q/k/v resident at once (one block an SM left 1.2 waves), about as many bytes in flight.
// The arithmetic is the same kernel's: the ring's depth and the blocks' placement change no sum.
// $HIGGS_RT_GEMV_TWO_BLOCKS=0 keeps one block an SM, for measuring.
template <int NT, int R2>
bool two_blocks_wanted(int64_t tiles, int device) {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_TWO_BLOCKS", 1) != 0;
  return on && (tiles + 1) / 2 > cuda::sm_count(device) &&
         fits_smem_twice(device, smem_bytes<NT, 2, R2, true, false>());
}

// Above 16 slots: the x ring where it fits, with the norm's pre-pass where wanted.
template <typename T, int NT, int R, Epi E>
void launch_x_ring(const GemvArgs& a, int64_t tiles, cudaStream_t s, int device) {
  if constexpr (has_norm(E)) {
    if (prenorm_wanted(a) && fits_smem(device, smem_bytes<NT, 2, R, true, false>())) {
      launch_prenorm<T>(a, s, device);
      constexpr int R2 = NT == 8 ? 2 : 3;
      if (two_blocks_wanted<NT, R2>(tiles, device)) return launch<T, NT, 2, R2, E, true, true, 2>(a, tiles, s, device);
      return launch<T, NT, 2, R, E, true, true>(a, tiles, s, device);
    }
  }
  if (use_x_ring<NT, 2, R, E>(device)) return launch<T, NT, 2, R, E, true>(a, tiles, s, device);
  return launch<T, NT, 2, (NT == 8 ? 4 : R), E>(a, tiles, s, device);
}

// NT batch tiles of 8; above 16 slots M = 2 row tiles per block share every x vector a warp loads (x is
// otherwise read from L2 NT / 2 times per weight byte: batch-64 step 13.45 -> 10.58 ms, NOTES.md).
template <typename T, Epi E>
void launch_batch(const GemvArgs& a, int64_t tiles, cudaStream_t s, int device) {
  if (a.B > 16 && (!has_norm(E) || prenorm_wanted(a)) && gemv_tiled_applies(a, device)) {  // the same sums, tiled
    if constexpr (has_norm(E)) launch_prenorm<T>(a, s, device);
    return gemv_tiled_cuda(a, device, s);
  }
  if (a.B <= 8) return launch_ring<T, 1, E>(a, tiles, s, device);
  if (a.B <= 16) return launch_ring<T, 2, E>(a, tiles, s, device);
  if (a.B <= 32) return launch_x_ring<T, 4, 4, E>(a, tiles, s, device);
  return launch_x_ring<T, 8, 3, E>(a, tiles, s, device);
}

template <typename T>
void launch_for(const GemvArgs& a, cudaStream_t s, int device) {
  switch (a.epilogue) {
    case Epi::kPlain: return launch_batch<T, Epi::kPlain>(a, (a.N + 15) / 16, s, device);
    case Epi::kResidual: return launch_batch<T, Epi::kResidual>(a, (a.N + 15) / 16, s, device);
    case Epi::kNormSilu: return launch_batch<T, Epi::kNormSilu>(a, a.N / 16, s, device);
    case Epi::kNormRope: return launch_batch<T, Epi::kNormRope>(a, a.N / 16, s, device);
    case Epi::kNormLogits: return launch_batch<T, Epi::kNormLogits>(a, (a.N + 15) / 16, s, device);
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
  GemvArgs args = a;
  args.ahead_at = ahead_at();
  args.ahead_bulk = ahead_bulk() ? 1 : 0;
  cuda::dispatch(a.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if constexpr (!std::is_same_v<T, float>) launch_for<T>(args, s, device);  // tensor-core MMAs take 16-bit inputs
  });
}

}  // namespace higgs_rt
