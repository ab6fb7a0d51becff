// CUDA decode attention (flash-decoding with a fused combine): out[b, h] = softmax(q[b, h] . K[b, h / G, :len]
// * D^-0.5) @ V[..., :len] with len = clamp(lengths[b], 0, S) read on the device, so the launch is static
// (CUDA-graph safe).
//
//   chunks   slot b's keys [0, len) are cut into chunks of kAttentionChunk (64) keys. A block serves GM query
//            heads of one KV head (GQA: K/V read once per group) and walks chunks c, c + C, ... below len (c its
//            chunk block, C the grid's chunk blocks); each chunk's unnormalised partial (sum of p v, max, sum of
//            p) goes to the workspace. The chunk boundaries depend on nothing but the chunk size, so a slot's
//            result is the same whatever the batch size and grid (batch invariance); the grid only sets how many
//            blocks share the work.
//   in chunk a key row is read by D / VEC threads, 16 bytes each; a tile is UK rows per thread whose K and V
//            loads are all issued before any math (forced, see the loop; checked in the SASS); at one slot both
//            tiles of a chunk load at once (LT = 2) and are multiplied one after the other, as one at a time.
//            Scores: per-thread partial dots, xor-shuffle sum over the row's threads; online softmax in fp32
//            (log2 domain) per row class, then the 128 / (D / VEC) row classes merge through shared memory.
//   ring     (NST > 0, 2-8 slots) the K and V rows go through a per-thread ring of NST tiles in shared memory
//            instead (cp.async, L2 only): tile t + NST is copied while tile t is multiplied, the next chunk's
//            tiles included, so a block keeps loads in flight through its math and its chunk merges. A thread
//            reads back only the vectors it copied: a cp.async wait is the only synchronisation. The same rows
//            reach the same threads' registers as with loads, so the sums and the bits do not change.
//   early    every key row but the newest was written by earlier steps: a block fetches its first tile before
//            the PDL wait, at the length it reads then; after the wait it re-reads the length and fetches
//            again only the newest row (or the whole tile, if the length was still being written), in the same
//            round trip as q.
//   combine  blocks past the last chunk leave at once; one chunk in all: its block writes the output. Else the
//            last block of each (slot, KV head, head group) to finish (an atomic counter over the blocks that
//            own a chunk, reset by that block for the next call) merges the chunks in chunk order: out =
//            sum_c acc_c 2^(m_c - M) / sum_c l_c 2^(m_c - M), every chunk's loads in flight together. No second
//            launch.
// Keys at or past len are never read (the cache there may hold garbage). len == 0 gives zeros. No host sync,
// no allocation (workspace and counters come from the caller); launches on the caller's stream with PDL.
#include <cmath>
#include <type_traits>

#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 128;
constexpr int kChunkMajor = 1, kEarlyExit = 2;  // the kernel's `layout` bits (chunk_major_grid, early_exit)

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

__device__ __forceinline__ int64_t slot_length(const int64_t* lengths, int b, int64_t S) {
  const int64_t len = __ldcg(lengths + b);
  return len < 0 ? 0 : (len > S ? S : len);
}

// The merge of `nchunks` partials for a block's ng query heads, in chunk order. Up to kThreads chunks, the pairs
// and the first sums in one round trip: thread c loads chunk c's (max, denominator) pairs and keeps them, and with
// them every thread loads the sums of the first kEarly chunks it will add (the max, the weights and the sums were
// three round trips in a row). Further sums go with 8 chunks' loads in flight (a walk of one load per chunk cost
// an L2 round trip each: +11 us per layer at 2000 positions, NOTES.md); beyond kThreads chunks the pairs are read
// again in stages of kStage. The same operations in the same order either way: the bits do not change.
template <typename T, int GM, int D, int kEarly>
__device__ __forceinline__ void combine(const float* ws_acc, const float* ws_ml, T* __restrict__ out, int64_t head0,
                                        int ng, int nchunks, int max_chunks) {
  constexpr int kStage = 128, kCols = D / 4, kItems = (GM * kCols + kThreads - 1) / kThreads, kInFlight = 8;
  static_assert(kEarly >= 1 && kEarly <= kInFlight, "the early sums are the first group's");
  const float kNegInf = -INFINITY;
  __shared__ float sm_w[GM][kStage], sm_lw[GM][kStage], sm_max[GM][kThreads / 32];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const bool held = nchunks <= kThreads && nchunks <= kStage;  // thread c keeps chunk c's pairs
  auto sums_of = [&](int g, int col, int c) {
    return reinterpret_cast<const float4*>(ws_acc + ((head0 + g) * max_chunks + c) * D) + col;
  };
  float4 early[kItems][kEarly];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = tid + it * kThreads;
    if (idx >= ng * kCols) break;
#pragma unroll
    for (int j = 0; j < kEarly; ++j)
      if (j < nchunks) early[it][j] = __ldcg(sums_of(idx / kCols, idx % kCols, j));
  }
  float mx[GM], cm[GM], cl[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) mx[g] = cm[g] = kNegInf, cl[g] = 0.f;
  if (held) {
    if (tid < nchunks) {
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        if (g >= ng) break;
        const float* ml = ws_ml + 2 * ((head0 + g) * max_chunks + tid);
        cm[g] = __ldcg(ml), cl[g] = __ldcg(ml + 1);
        mx[g] = cm[g];
      }
    }
  } else {
    for (int c = tid; c < nchunks; c += kThreads) {
#pragma unroll
      for (int g = 0; g < GM; ++g)
        if (g < ng) mx[g] = fmaxf(mx[g], __ldcg(ws_ml + 2 * ((head0 + g) * max_chunks + c)));
    }
  }
#pragma unroll
  for (int g = 0; g < GM; ++g) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx[g] = fmaxf(mx[g], __shfl_xor_sync(0xffffffffu, mx[g], off));
    if (lane == 0) sm_max[g][warp] = mx[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    mx[g] = kNegInf;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) mx[g] = fmaxf(mx[g], sm_max[g][w]);
  }
  float4 acc[kItems];
  float lsum[kItems];
#pragma unroll
  for (int it = 0; it < kItems; ++it) acc[it] = make_float4(0.f, 0.f, 0.f, 0.f), lsum[it] = 0.f;
  for (int c0 = 0; c0 < nchunks; c0 += kStage) {
    const int n = min(kStage, nchunks - c0);
    __syncthreads();  // the previous stage's weights are read
    if (held) {
      if (tid < n) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          if (g >= ng) break;
          const float w = mx[g] == kNegInf ? 0.f : exp2f(cm[g] - mx[g]);
          sm_w[g][tid] = w;
          sm_lw[g][tid] = cl[g] * w;
        }
      }
    } else {
      for (int idx = tid; idx < ng * n; idx += kThreads) {
        const int g = idx / n, c = idx % n;
        const float* ml = ws_ml + 2 * ((head0 + g) * max_chunks + c0 + c);
        const float w = mx[g] == kNegInf ? 0.f : exp2f(__ldcg(ml) - mx[g]);
        sm_w[g][c] = w;
        sm_lw[g][c] = __ldcg(ml + 1) * w;
      }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kItems; ++it) {
      const int idx = tid + it * kThreads;
      if (idx >= ng * kCols) break;
      const int g = idx / kCols, col = idx % kCols;
      auto add = [&](const float4& v, int c) {
        const float w = sm_w[g][c];
        acc[it].x = fmaf(v.x, w, acc[it].x), acc[it].y = fmaf(v.y, w, acc[it].y);
        acc[it].z = fmaf(v.z, w, acc[it].z), acc[it].w = fmaf(v.w, w, acc[it].w);
        lsum[it] += sm_lw[g][c];
      };
      int c = 0;
      if (c0 == 0) {  // the first chunks' sums, loaded with the pairs
#pragma unroll
        for (int j = 0; j < kEarly; ++j)
          if (j < n) add(early[it][j], j);
        c = kEarly;
      }
      for (; c < n; c += kInFlight) {
        float4 v[kInFlight];
#pragma unroll
        for (int j = 0; j < kInFlight; ++j)
          if (c + j < n) v[j] = __ldcg(sums_of(g, col, c0 + c + j));
#pragma unroll
        for (int j = 0; j < kInFlight; ++j) {
          if (c + j >= n) break;
          add(v[j], c + j);
        }
      }
    }
  }
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = tid + it * kThreads;
    if (idx >= ng * kCols) break;
    const int g = idx / kCols, col = idx % kCols;
    const float l = lsum[it];
    T* o = out + (head0 + g) * D + 4 * col;
    o[0] = cuda::from_f32<T>(l > 0.f ? acc[it].x / l : 0.f), o[1] = cuda::from_f32<T>(l > 0.f ? acc[it].y / l : 0.f);
    o[2] = cuda::from_f32<T>(l > 0.f ? acc[it].z / l : 0.f), o[3] = cuda::from_f32<T>(l > 0.f ? acc[it].w / l : 0.f);
  }
}

// The combine through the cluster's shared memory (CL, sm_90): chunk c's partial lies in block c % C's shared
// memory at slot c / C (C the cluster's blocks, which are the grid's chunk blocks of one (slot, head group)). After
// one cluster barrier the blocks share the output's columns; each merges every chunk's partial for its columns in
// chunk order with the arithmetic of combine() above (the same max, weights, fmaf order and division: the same
// bits), 8 chunks' loads in flight; a second barrier keeps every block's shared memory alive until its peers have
// read it.
template <typename T, int GM, int D>
__device__ __forceinline__ void cluster_combine(const float* part, const float* part_ml, T* __restrict__ out,
                                                int64_t head0, int ng, int nchunks, int cblocks, int rank) {
  constexpr int kCols = D / 4, kInFlight = 8;
  const float kNegInf = -INFINITY;
  cuda::cluster_sync();
  for (int idx = rank + cblocks * int(threadIdx.x); idx < ng * kCols; idx += cblocks * kThreads) {
    const int g = idx / kCols, col = idx % kCols;
    auto ml_of = [&](int c) {
      return cuda::peer_shared(part_ml, unsigned(c % cblocks)) + 2 * ((c / cblocks) * GM + g);
    };
    auto sums_of = [&](int c) {
      return reinterpret_cast<const float4*>(cuda::peer_shared(part, unsigned(c % cblocks)) +
                                             ((c / cblocks) * GM + g) * D) + col;
    };
    float mx = kNegInf;
    for (int c0 = 0; c0 < nchunks; c0 += kInFlight) {
      float m[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) m[j] = c0 + j < nchunks ? *ml_of(c0 + j) : kNegInf;
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) mx = fmaxf(mx, m[j]);
    }
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float lsum = 0.f;
    for (int c0 = 0; c0 < nchunks; c0 += kInFlight) {
      float m[kInFlight], l[kInFlight];
      float4 v[kInFlight];
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (c0 + j < nchunks) {
          const float* ml = ml_of(c0 + j);
          m[j] = ml[0], l[j] = ml[1], v[j] = *sums_of(c0 + j);
        }
      }
#pragma unroll
      for (int j = 0; j < kInFlight; ++j) {
        if (c0 + j >= nchunks) break;
        const float w = mx == kNegInf ? 0.f : exp2f(m[j] - mx);
        acc.x = fmaf(v[j].x, w, acc.x), acc.y = fmaf(v[j].y, w, acc.y);
        acc.z = fmaf(v[j].z, w, acc.z), acc.w = fmaf(v[j].w, w, acc.w);
        lsum += l[j] * w;
      }
    }
    T* o = out + (head0 + g) * D + 4 * col;
    const bool some = lsum > 0.f;
    o[0] = cuda::from_f32<T>(some ? acc.x / lsum : 0.f), o[1] = cuda::from_f32<T>(some ? acc.y / lsum : 0.f);
    o[2] = cuda::from_f32<T>(some ? acc.z / lsum : 0.f), o[3] = cuda::from_f32<T>(some ? acc.w / lsum : 0.f);
  }
  cuda::cluster_sync();
}

// T: cache dtype; D: head dim; GM: query heads per block; UK: key rows per thread per tile.
// LT: tiles loaded at once (their math stays a tile at a time: the same sums); MINB: blocks per SM the registers
// must allow (chunk_blocks sizes the grid by it); NST: tiles in the shared-memory ring (0: loads to registers);
// CL: the grid's chunk blocks of a (slot, head group) are one cluster and combine through its shared memory.
template <typename T, int D, int GM, int UK, int LT, int MINB, int NST, bool CL>
__global__ void __launch_bounds__(kThreads, MINB)
    decode_attention_kernel(const T* q, const T* k, const T* v, const int64_t* lengths, T* __restrict__ out,
                            float* ws, int* counters, int Hq, int Hkv, int64_t S, int max_chunks, int groups,
                            float scale_log2, uint32_t opaque_zero, int layout) {
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int TPK = D / VEC;         // threads per key row
  constexpr int NKR = kThreads / TPK;  // key rows per pass (row classes)
  constexpr int TILE = NKR * UK;       // key rows per tile
  constexpr int UL = UK * LT;          // key rows per thread per load
  constexpr int CHUNK = int(kAttentionChunk);
  static_assert(TPK >= 1 && TPK <= 32 && (TPK & (TPK - 1)) == 0, "a key row must map onto 1..32 lanes");
  static_assert(CHUNK % (TILE * LT) == 0, "a chunk must be whole loads");
  static_assert(NST == 0 || LT == 1, "the ring holds one tile a stage");
  const float kNegInf = -INFINITY;

  // The grid: (chunk blocks, KV heads x groups, slots), or with kChunkMajor (heads x groups, slots, chunk blocks),
  // whose launch order puts every slot's first chunks before any block past them (chunk_major_grid).
  const bool chunk_major = (layout & kChunkMajor) != 0;
  const int cblock = chunk_major ? blockIdx.z : blockIdx.x, cblocks = chunk_major ? gridDim.z : gridDim.x;
  const int hg = chunk_major ? blockIdx.x : blockIdx.y;
  const int b = chunk_major ? blockIdx.y : blockIdx.z, slots = chunk_major ? gridDim.y : gridDim.z;
  const int hk = hg / groups, grp = hg % groups;
  const int G = Hq / Hkv;
  const int g0 = grp * GM;                   // first query head (within the KV head's group) of this block
  const int ng = min(GM, G - g0);            // query heads served here
  const int tid = threadIdx.x, kr = tid / TPK, dc = tid % TPK;
  const int64_t head0 = int64_t(b) * Hq + int64_t(hk) * G + g0;  // (b, first query head) row index
  // workspace: per (b, query head, chunk) the sums [D], then per (b, query head, chunk) (max, denominator)
  float* ws_acc = ws;
  float* ws_ml = ws + int64_t(slots) * Hq * max_chunks * D;

  const int64_t kv0 = (int64_t(b) * Hkv + hk) * S * D + dc * VEC;
  const T* kp = k + kv0;
  const T* vp = v + kv0;
  // A load's K and V rows (LT tiles); a key at or past `end` reads row key0 instead (never memory past len, which
  // may hold garbage) and gets score -inf below, so p = 0.
  uint4 kraw[UL], vraw[UL];
  auto row_of = [&](int64_t key0, int u, int64_t end) {
    const int64_t key = key0 + u * NKR + kr;
    return key < end ? key : key0;
  };
  auto fetch = [&](int64_t key0, int64_t end) {
#pragma unroll
    for (int u = 0; u < UL; ++u) {
      const int64_t row = row_of(key0, u, end);
      kraw[u] = cuda::load_cg(kp + row * D);
      vraw[u] = cuda::load_cg(vp + row * D);
    }
  };
  // The ring (NST > 0): tile t's UK K rows then UK V rows at stage t % NST, thread tid's vectors at stride kThreads.
  extern __shared__ uint4 ring[];
  // CL: the block's chunk partials after the ring, the sums [slot][GM][D] then the (max, denominator) pairs
  float* part = reinterpret_cast<float*>(ring + NST * 2 * UK * kThreads);
  float* part_ml = part + int64_t((max_chunks + cblocks - 1) / cblocks) * GM * D;
  auto ring_at = [&](int t, int j) { return ring + ((t % (NST > 0 ? NST : 1)) * 2 * UK + j) * kThreads + tid; };
  auto copy_tile = [&](int t, int64_t key0, int64_t end) {
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      const int64_t row = row_of(key0, u, end);
      cuda::cp_async16(ring_at(t, u), kp + row * D);
      cuda::cp_async16(ring_at(t, UK + u), vp + row * D);
    }
  };
  // Every key row but the newest was written by earlier steps: the block's first tile is fetched before the PDL
  // wait, at the length read then (stale while the step's first kernels still write it: checked after the wait).
  const int64_t early_len = slot_length(lengths, b, S);
  const int64_t first = int64_t(cblock) * CHUNK;
  if (!CL && (layout & kEarlyExit) && cblock >= int(early_len / CHUNK) + 1) return;  // past one more key: early_exit
  if (first < early_len) {
    if constexpr (NST > 0) {
      copy_tile(0, first, min(first + CHUNK, early_len));
      cuda::cp_async_commit();
    } else {
      fetch(first, min(first + CHUNK, early_len));
    }
  }

  // o-proj launches now and copies nearly all its weights during this kernel's round trips; launched after the
  // chunks or at exit it lost (H100, b58d89b: b1 2.495 / 2.575 ms against 2.470; attention + o-proj 17.4 / 22.9
  // us against 17.0)
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  // One round trip after the wait: q, the length, and the newest row of the first load at the length read before
  // it (the QKV kernel has just written that row), all issued before any is used (they were three in a row). A
  // block that owned no chunk at that length loads q only once the length says it owns one now: the others leave
  // without waiting for loads they do not use.
  uint4 qraw[GM];
  auto load_q = [&] {
#pragma unroll
    for (int g = 0; g < GM; ++g)
      if (g < ng) qraw[g] = cuda::load_cg(q + (head0 + g) * D + dc * VEC);  // the QKV kernel's output
  };
  // (with the ring, the newest row goes to registers that replace its ring vectors when the first tile is read;
  // newest: the rows u of the first tile that read it, a row past the end reading the tile's first row)
  uint4 newest_k = {}, newest_v = {};
  unsigned newest = 0;
  if (first < early_len) {
    load_q();
    const int64_t end0 = min(first + CHUNK, early_len);
#pragma unroll
    for (int u = 0; u < UL; ++u) {
      if (row_of(first, u, end0) == early_len - 1) {
        if constexpr (NST > 0) {
          if (newest == 0) {
            newest_k = cuda::load_cg(kp + (early_len - 1) * D);
            newest_v = cuda::load_cg(vp + (early_len - 1) * D);
          }
          newest |= 1u << u;
        } else {
          kraw[u] = cuda::load_cg(kp + (early_len - 1) * D);
          vraw[u] = cuda::load_cg(vp + (early_len - 1) * D);
        }
      }
    }
  }
  const int64_t len = slot_length(lengths, b, S);
  const int nchunks = int((len + CHUNK - 1) / CHUNK);
  if (cblock >= max(nchunks, 1) && (!CL || nchunks <= 1)) {  // no chunk here (the combine counts the others only;
    if constexpr (NST > 0) cuda::cp_async_wait<0>();         // a cluster's blocks all reach its barriers)
    return;                                                  // (no copy may land in the next block's memory)
  }
  if (nchunks == 0) {  // len == 0: zeros
    if constexpr (NST > 0) cuda::cp_async_wait<0>();
    for (int idx = tid; idx < ng * D; idx += kThreads) out[head0 * D + idx] = cuda::from_f32<T>(0.f);
    return;
  }
  const int active = min(cblocks, nchunks);  // blocks that own a chunk
  if (first >= early_len) load_q();

  // The ring's copies run NST tiles ahead of the math, through the block's chunks in the order it walks them:
  // one commit group a tile (empty past the last), so the wait before tile t leaves NST - 1 groups in flight.
  int copy_chunk = cblock, copied = 0;  // the next tile to copy: its chunk, first key and ring index
  int64_t copy_key = first;
  auto advance = [&] {  // to the next tile of the walk
    if ((copy_key += TILE) >= min(int64_t(copy_chunk) * CHUNK + CHUNK, len))
      copy_chunk += cblocks, copy_key = int64_t(copy_chunk) * CHUNK;
    ++copied;
  };
  auto copy_next = [&] {
    if (copy_chunk < nchunks) {
      copy_tile(copied, copy_key, min(int64_t(copy_chunk) * CHUNK + CHUNK, len));
      advance();
    } else {
      ++copied;
    }
    cuda::cp_async_commit();
  };
  if constexpr (NST > 0) {
    if (first < early_len && early_len == len) {
      advance();  // the first tile is in flight since before the wait; its newest row is in registers
    } else {
      cuda::cp_async_wait<0>();  // a first tile copied at a stale length has landed: copy it again, at len
      newest = 0;
      copy_next();
    }
    while (copied < NST) copy_next();
  }
  int consumed = 0;  // ring tiles multiplied

  float qf[GM][VEC];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g < ng) {
      load_f32(reinterpret_cast<const T*>(&qraw[g]), qf[g]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[g][i] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[g][i] = 0.f;
    }
  }

  __shared__ float sm_m[NKR][GM], sm_l[NKR][GM];
  __shared__ float sm_acc[NKR][GM][D];
  for (int chunk = cblock; chunk < nchunks; chunk += cblocks) {  // block-uniform
  const int64_t start = int64_t(chunk) * CHUNK, end = min(start + CHUNK, len);
  float m[GM], l[GM], acc[GM][VEC];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = kNegInf, l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  for (int64_t key1 = start; key1 < end; key1 += TILE * LT) {  // block-uniform bounds: every lane shuffles
    if constexpr (NST > 0) {
      cuda::cp_async_wait<NST - 1>();  // this tile has landed
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        kraw[u] = *ring_at(consumed, u);
        vraw[u] = *ring_at(consumed, UK + u);
        if (consumed == 0 && (newest >> u & 1u)) kraw[u] = newest_k, vraw[u] = newest_v;
      }
    } else {
    // (the first load, fetched before the wait at the right length, has its newest row fetched again above)
    if (key1 != first || early_len != len) fetch(key1, end);
    // Left alone, ptxas issues some V loads only after the score shuffles (a second round trip per tile).
    // Every loaded word, masked by a zero it cannot see through, feeds every K vector: all loads go first.
    uint32_t all = 0;
#pragma unroll
    for (int u = 0; u < UL; ++u) all ^= kraw[u].x ^ vraw[u].x;
    all &= opaque_zero;
#pragma unroll
    for (int u = 0; u < UL; ++u) kraw[u].x ^= all;
    }
#pragma unroll
    for (int h = 0; h < LT; ++h) {  // a tile at a time, as with LT = 1; a tile past the end is skipped as there
    const int64_t key0 = key1 + h * TILE;
    if (key0 >= end) break;  // block-uniform
    float s[UK][GM];
#pragma unroll
    for (int u = 0; u < UK; ++u) {
      float kf[VEC];
      load_f32(reinterpret_cast<const T*>(&kraw[h * UK + u]), kf);
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
      load_f32(reinterpret_cast<const T*>(&vraw[h * UK + u]), vf);
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        const float p = exp2f(s[u][g] - (m[g] == kNegInf ? 0.f : m[g]));
        l[g] += p;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i]);
      }
    }
    }  // tile h
    if constexpr (NST > 0) {
      copy_next();  // into the stage just read (its vectors are consumed above)
      ++consumed;
    }
  }

  // Merge the NKR row classes: rescale each to the block max, then sum; the chunk's partial to the workspace
  // (one chunk in all: the output itself, which is what the combine below would make of it).
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
    if (nchunks == 1) {
      out[(head0 + g) * D + d] = cuda::from_f32<T>(total_l > 0.f ? total / total_l : 0.f);
      continue;
    }
    if constexpr (CL) {
      const int at = (chunk / cblocks) * GM + g;
      part[at * D + d] = total;
      if (d == 0) part_ml[2 * at] = mx, part_ml[2 * at + 1] = total_l;
    } else {
      const int64_t at = (head0 + g) * max_chunks + chunk;
      ws_acc[at * D + d] = total;
      if (d == 0) ws_ml[2 * at] = mx, ws_ml[2 * at + 1] = total_l;
    }
  }
  __syncthreads();  // the shared arrays are rewritten by the next chunk
  }  // chunk loop
  if (nchunks == 1) return;
  if constexpr (CL) {
    if constexpr (NST > 0) cuda::cp_async_wait<0>();  // (a block past the last chunk committed empty groups)
    cluster_combine<T, GM, D>(part, part_ml, out, head0, ng, nchunks, cblocks, cblock);
    return;
  }

  // The last active block of this (slot, KV head, head group) merges every chunk, in chunk order:
  // out = sum_c acc_c w_c / sum_c l_c w_c, w_c = 2^(m_c - M), M = max_c m_c.
  __shared__ bool last;
  __threadfence();  // this block's partials are visible before it is counted
  __syncthreads();
  if (tid == 0) {
    int* counter = counters + (int64_t(b) * Hkv + hk) * groups + grp;
    last = atomicAdd(counter, 1) == active - 1;
    if (last) *counter = 0;  // ready for the next call: every active block of this one has counted
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  // (8 early sums fit the one-slot kernel's registers; in the 4-per-SM kernel 4 or more spill)
  combine<T, GM, D, (LT > 1 ? 8 : 2)>(ws_acc, ws_ml, out, head0, ng, nchunks, max_chunks);
}

// Blocks per (slot, KV head, head group) along x: about `per_sm` per SM over the whole grid, at most the chunks of
// S. A function of the shapes only, so a CUDA graph stays valid; the result does not depend on it.
inline int chunk_blocks(int64_t slots_x_heads, int64_t max_chunks, int per_sm, int device) {
  const int64_t n = cuda::sm_count(device);
  return int(std::clamp<int64_t>((per_sm * n + slots_x_heads - 1) / slots_x_heads, 1, max_chunks));
}

// One slot, 128-wide heads and up to 3 query heads a block: a chunk's two 4-row tiles load at once, 3 blocks an
// SM (168 registers), so at short lengths a chunk is one round trip after the PDL wait, not two. H100, same call
// (65aa7ce): b1 2.511 against 2.536 ms at 100 positions, 2.600 against 2.616 at 2000. Not above one slot: b8 gained
// as much at 100 positions (2.732 against 2.759), but alone the kernel lost 6.5 us a layer at B = 8 and 500
// positions (a 3-per-SM grid leaves some blocks two chunks), a length the server's streams run at; at 64 slots
// 2-tile loads took the step from 5.89 to 6.84 ms (0f8a4db). The sums are a tile's at a time either way, so a
// slot's output does not depend on the batch. $HIGGS_RT_ATTN_LT (for measuring): 1 loads one tile at a time at
// one slot too; 2 loads whole chunks up to 16 slots, above one slot with a grid sized for 4 blocks an SM (so that
// at 8 slots no block holds two chunks below 576 positions): H100, 8dffc4f, b8 2.749 against 2.777 ms at 100
// positions but 2.975 against 2.948 at 500; at every batch b64 took 6.335 ms against 5.881 (that switch is gone).
inline bool chunk_loads(int64_t B) {
  static const int forced = cuda::env_int("HIGGS_RT_ATTN_LT", 0);
  return forced == 1 ? false : (forced == 2 ? B <= 16 : B == 1);
}

// The chunk blocks as the grid's slowest dimension at one slot and above 8 slots. The hardware starts a grid's
// blocks in x, y, z order; with chunks along x, the blocks of one slot's KV head past its last chunk (48 of 50 at
// one slot and 100 positions) start before the next head's first chunk and hold their SM slots until the QKV
// kernel ends (they learn that they own nothing only after the PDL wait), so the working blocks of the last heads
// start only as the QKV kernel's last blocks leave. H100, f2fafd9, two calls each: b1 2.395 / 2.395 ms against
// 2.413 / 2.415, b64 5.158 / 5.166 against 5.335 / 5.223; but b8 at 500 positions 2.665 / 2.663 against 2.650 /
// 2.649 and b1 at 2000 2.467 / 2.464 against 2.458 / 2.457 (consecutive chunks of one head no longer start
// together), b8 2.516 / 2.514 either way: not at 2-8 slots (the ring's). Which block serves a chunk is all that
// changes: not a sum. $HIGGS_RT_ATTN_ORDER (measuring): 0 never, 1 at every batch.
inline bool chunk_major_grid(int64_t B) {
  static const int forced = cuda::env_int("HIGGS_RT_ATTN_ORDER", -1);
  if (forced == 0 || forced == 1) return forced == 1;
  return B == 1 || B > 8;
}

// Measuring only ($HIGGS_RT_ATTN_EARLY_EXIT=1): a block past its slot's last chunk, counting one key more than
// the length read before the PDL wait, leaves at once instead of after the wait, so that the next kernel
// (o-proj) can launch, and its blocks take the SMs, during the QKV kernel's tail rather than after it. The one
// key covers the only in-flight writer of lengths in higgs-rt, the sampler's update (+1; a kernel that does not
// trigger early, as torch's, has ended before this one starts); a caller's own kernel that changed lengths by
// more while this one starts would lose chunks: hence a switch until measured.
inline bool early_exit() {
  static const bool on = cuda::env_int("HIGGS_RT_ATTN_EARLY_EXIT", 0) == 1;
  return on;
}

// The ring (128-wide heads, up to 3 query heads a block) at 2-8 slots: 3 tiles, 3 blocks an SM. H100, 4b0af59, the
// step against loads to registers in the same call: b8 2.717 against 2.744 ms at 100 positions, 2.847 against 2.916
// at 500; 2 tiles (4 blocks an SM) 2.726 / 2.874. Not at 64 slots, where the grid has blocks enough to hide the
// loads: 5.714 (3 tiles) and 5.368 (2) against 5.207; nor at one slot (the chunk loads above). 9-63 slots: not
// measured, left with loads. $HIGGS_RT_ATTN_RING (for measuring): 0 never, 2 or 3 tiles at 2-64 slots.
inline int ring_stages(int64_t B) {
  static const int forced = cuda::env_int("HIGGS_RT_ATTN_RING", -1);
  if (forced >= 0) return B > 1 && (forced == 2 || forced == 3) ? forced : 0;
  return B > 1 && B <= 8 ? 3 : 0;
}

// The workspace's chunks a (slot, query head) for a cache of S positions (at least one).
inline int64_t chunks_of(int64_t S) { return std::max<int64_t>(1, (S + kAttentionChunk - 1) / kAttentionChunk); }

// Measuring only ($HIGGS_RT_ATTN_CLUSTER=C, C in 2, 4, 8, 16; bf16 128-wide heads of up to 3 query heads a block,
// sm_90): the C chunk blocks of each (slot, head group) form a thread-block cluster, each keeps its chunks'
// partials in its shared memory, and cluster_combine merges them after a cluster barrier, instead of the
// partials through L2, a fence, an atomic counter and the last block's loads. Why: the attention's trace (H100,
// f949e68, b1 at 100 positions, medians a layer from the QKV kernel's end) gave q 0.75 us, the chunks 2.75, the
// counter 3.25 and the combine 3.5 of 11.75. The grid's chunk blocks become C at every batch (a block walks
// chunks c, c + C, ...); where the partials of ceil(S / 64 / C) chunks would not fit kClusterPartBytes, the
// default runs. The same sums in the same order: the bits do not change.
constexpr size_t kClusterPartBytes = 24 << 10;
inline int cluster_blocks() {
  static const int c = cuda::env_int("HIGGS_RT_ATTN_CLUSTER", 0);
  return c == 2 || c == 4 || c == 8 || c == 16 ? c : 0;
}
inline size_t cluster_part_bytes(int64_t max_chunks, int cblocks, int GM, int D) {
  return size_t((max_chunks + cblocks - 1) / cblocks) * GM * (D + 2) * sizeof(float);
}

template <typename T, int D, int GM, int UK, int LT, int MINB, int NST = 0, bool CL = false>
void launch_tiles(const DecodeAttentionArgs& a, cudaStream_t stream, int device, int grid_per_sm = MINB) {
  const int64_t G = a.Hq / a.Hkv;
  const int64_t groups = (G + GM - 1) / GM;
  const int64_t gy = a.Hkv * groups;
  const int64_t max_chunks = chunks_of(a.S);
  if (max_chunks > 0x7fffffff || gy > 65535 || a.B > 65535)
    throw std::invalid_argument("higgs_rt decode_attention: grid too large (B, heads or positions)");
  const int cblocks = CL ? cluster_blocks() : chunk_blocks(a.B * gy, max_chunks, grid_per_sm, device);
  const bool chunk_major = chunk_major_grid(a.B) && cblocks <= 65535;
  const dim3 grid = chunk_major ? dim3(unsigned(gy), unsigned(a.B), unsigned(cblocks))
                                : dim3(unsigned(cblocks), unsigned(gy), unsigned(a.B));
  const dim3 cluster = !CL          ? dim3(1, 1, 1)
                       : chunk_major ? dim3(1, 1, unsigned(cblocks))
                                     : dim3(unsigned(cblocks), 1, 1);
  const float scale_log2 = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);  // D^-0.5 * log2(e)
  constexpr size_t kRing = size_t(NST) * 2 * UK * kThreads * sizeof(uint4);
  auto* kernel = decode_attention_kernel<T, D, GM, UK, LT, MINB, NST, CL>;
  if constexpr (kRing > 0 || CL) {
    static const bool sized = cuda::allow_smem(kernel, kRing + (CL ? kClusterPartBytes : 0));  // once per kernel
    (void)sized;
  }
  if constexpr (CL) {
    static const bool wide = cuda::allow_wide_clusters(kernel);  // 16 blocks: beyond the portable 8
    (void)wide;
  }
  const size_t smem = kRing + (CL ? cluster_part_bytes(max_chunks, cblocks, GM, D) : 0);
  cuda::launch_clustered(kernel, grid, dim3(kThreads), cluster, smem, stream, device, cuda::kPdlAttention,
                         "decode_attention_kernel", static_cast<const T*>(a.q), static_cast<const T*>(a.k),
                         static_cast<const T*>(a.v), a.lengths, static_cast<T*>(a.out), a.workspace, a.counters,
                         int(a.Hq), int(a.Hkv), a.S, int(max_chunks), int(groups), scale_log2, /*opaque_zero=*/0u,
                         (chunk_major ? kChunkMajor : 0) | (early_exit() ? kEarlyExit : 0));
}

// 128-wide heads, up to 3 query heads a block (the Talker's): the one-slot whole-chunk loads, the ring at 2-8
// slots, else loads to registers at 4 blocks an SM; CL: clustered (the ring of 2 tiles, a measuring variant, is
// not).
template <typename T, int D, int GM, bool CL>
void launch_narrow(const DecodeAttentionArgs& a, cudaStream_t stream, int device) {
  if (chunk_loads(a.B)) return launch_tiles<T, D, GM, 4, 2, 3, 0, CL>(a, stream, device, a.B == 1 ? 3 : 4);
  switch (ring_stages(a.B)) {
    case 2:
      if constexpr (!CL) return launch_tiles<T, D, GM, 4, 1, 4, 2>(a, stream, device);
      break;
    case 3: return launch_tiles<T, D, GM, 4, 1, 3, 3, CL>(a, stream, device);
    default: break;
  }
  return launch_tiles<T, D, GM, 4, 1, 4, 0, CL>(a, stream, device);
}

// Key rows per thread per tile: 4 (2 with 8 query heads a block: q and acc are GM x VEC floats per thread).
template <typename T, int D, int GM>
void launch(const DecodeAttentionArgs& a, cudaStream_t stream, int device) {
  if constexpr (GM <= 3 && D == 128) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      if (cluster_blocks() > 0 && cuda::sm90(device) &&
          cluster_part_bytes(chunks_of(a.S), cluster_blocks(), GM, D) <= kClusterPartBytes)
        return launch_narrow<T, D, GM, true>(a, stream, device);
    }
    return launch_narrow<T, D, GM, false>(a, stream, device);
  }
  return launch_tiles<T, D, GM, (GM >= 8 ? 2 : 4), 1, (GM <= 3 ? 4 : 1)>(a, stream, device);
}

// Query heads per block: exactly G for G <= 4 (Llama-3.2-3B / Higgs: G = 3), else 8 (padded; groups larger
// than 8 take several blocks per KV head, each re-reading K/V).
template <typename T, int D>
void launch_heads(const DecodeAttentionArgs& a, cudaStream_t stream, int device) {
  switch (a.Hq / a.Hkv) {
    case 1: return launch<T, D, 1>(a, stream, device);
    case 2: return launch<T, D, 2>(a, stream, device);
    case 3: return launch<T, D, 3>(a, stream, device);
    case 4: return launch<T, D, 4>(a, stream, device);
    default: return launch<T, D, 8>(a, stream, device);
  }
}

template <typename T>
void launch_dim(const DecodeAttentionArgs& a, cudaStream_t stream, int device) {
  switch (a.D) {
    case 64: return launch_heads<T, 64>(a, stream, device);
    case 128: return launch_heads<T, 128>(a, stream, device);
    default: throw std::invalid_argument("higgs_rt decode_attention: head dim must be 64 or 128");
  }
}

}  // namespace

void decode_attention_cuda(const DecodeAttentionArgs& a, int device, void* stream) {
  if (a.B == 0 || a.Hq == 0) return;
  if (a.Hkv < 1 || a.Hq % a.Hkv != 0 || a.S < 0) throw std::invalid_argument("higgs_rt decode_attention: bad sizes");
  if (a.workspace == nullptr || a.counters == nullptr)
    throw std::invalid_argument("higgs_rt decode_attention: needs a workspace and counters");
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a.q) | reinterpret_cast<uintptr_t>(a.k) |
                         reinterpret_cast<uintptr_t>(a.v) | reinterpret_cast<uintptr_t>(a.workspace);
  if (bits % 16 != 0) throw std::invalid_argument("higgs_rt decode_attention: q, caches, workspace must be 16-byte aligned");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  cuda::dispatch(a.dtype, [&](auto t) { launch_dim<typename decltype(t)::type>(a, s, device); });
}

}  // namespace higgs_rt
