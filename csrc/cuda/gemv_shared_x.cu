// CUDA decode GEMV above 32 slots with x shared through shared memory: y = epilogue(x[B, K] @ w[N, K]^T), the
// arithmetic of gemv.cu's ring kernel bit for bit, with a block's x read from L2 once for 8 row tiles.
//
//   why     = at 64 slots gemv.cu's blocks each read all of x (64 x K) from L2 for their 32 rows: twice the weight
//             bytes, so the batch-64 GEMVs move ~3x the weights through L2 and run at its pace (gate/up 67 us
//             for 100 MB of weights a layer on an H100, csrc/cuda/NOTES.md). Wider blocks in registers spilled
//             (4 row tiles: 255 registers) and clusters sharing x through distributed shared memory lost.
//   block   = 8 warps, warp w on row tile w: 128 rows a block share one copy of x in shared memory, so x's L2
//             traffic is half the weights'.
//   order   = gemv.cu's warp v sums its k-slices v, v + 8, v + 16, ... (rounds of 4 vectors of 32 columns) into
//             one partial, and its block adds the 8 partials to 0 in warp order. Here a warp walks 8 passes:
//             pass v takes exactly warp v's k-slices in warp v's order into a fresh partial, added to a running
//             sum (started at 0) when the pass ends. The same MMAs feed each accumulator in the same order and the
//             same fp32 additions follow, so a slot's row has gemv.cu's bits at any batch: tests/test_gemv.py's
//             batch-invariance tests compare batch 64 (this kernel) with batch 1 (gemv.cu's). The norm's sums of
//             squares are kept per pass the same way.
//   loads   = weights through a per-thread cp.async ring, R steps ahead, as in gemv.cu (a thread reads back only
//             its own copies); a pass's x (and norm weight) into one of two buffers, copied by all threads one
//             pass ahead (K = 3072, 64 slots: 48 KB a pass). One block barrier a pass (8 a call) says a pass's x
//             has landed everywhere and the buffer of the pass before is free.
//   where   = above 32 slots, 2048 <= K <= 3072 (each pass at least R steps long, which the barrier's wait
//             counts on, and its x within the buffer), epilogues without per-slot inputs (plain, SiLU(gate) *
//             up, logits). Not yet timed on a GPU, so off by default: HIGGS_RT_GEMV_SHARED_X=1 uses it where a
//             block per 128 rows nearly fills the GPU (gate/up), =2 wherever it applies (the tests' setting).
#include <cstdlib>

#include "gemv_parts.cuh"

namespace higgs_rt::gemv_detail {
namespace {

constexpr int kU = 4;                     // vectors per lane per round, as gemv.cu
constexpr int kWarpK = 4 * kVec;          // columns of a step: 4 lanes x 8
constexpr int kIterK = kWarpK * kU;       // a warp's columns per round
constexpr int kRoundK = kWarps * kIterK;  // a round of all 8 passes' slices: 1024
constexpr int kThreads = kWarps * 32;
constexpr int kMinK = 2048, kMaxK = 3072;
constexpr int kMaxSteps = kMaxK / kRoundK * kU;  // steps of a pass at most: 12
constexpr int kNT = 8, kR = 8;                   // 64 slots in batch tiles of 8; weight steps in flight

template <bool kNorm>  // a step's x vectors: 8 kNT rows x 4 lanes (and the norm weight's 4)
__host__ __device__ constexpr int x_vectors() { return kNT * 8 * 4 + (kNorm ? 4 : 0); }

template <bool kNorm>
constexpr size_t smem_bytes() {
  return sizeof(uint4) * (size_t(kR) * 2 * kThreads + 2 * size_t(kMaxSteps) * x_vectors<kNorm>()) +
         sizeof(float) * kWarps * kNT * 8;
}

// Steps of pass v: gemv.cu's `steps` for warp v.
__device__ __forceinline__ int pass_steps(int64_t K, int v) {
  const int64_t kv = int64_t(v) * kIterK;
  return K > kv ? int((K - kv + kRoundK - 1) / kRoundK) * kU : 0;
}

template <typename T, Epi E>
__global__ void __launch_bounds__(kThreads, 1) shared_x_kernel(const GemvArgs p, int64_t tiles) {
  static_assert(E == Epi::kPlain || E == Epi::kNormSilu || E == Epi::kNormLogits, "no per-slot epilogue inputs");
  constexpr bool kNorm = has_norm(E);
  constexpr int kX = x_vectors<kNorm>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int64_t N = p.N, K = p.K;
  const int64_t tile = int64_t(blockIdx.x) * kWarps + warp;
  int64_t ra, rb;
  tile_rows<E>(p, tile < tiles ? tile : tiles - 1, g, ra, rb);  // a tile past the end: loaded, not stored
  const T* w = static_cast<const T*>(p.w);
  const T* wa = w + (ra < N ? ra : N - 1) * K;
  const T* wb = w + (rb < N ? rb : N - 1) * K;
  const T* x = static_cast<const T*>(p.x);
  const T* gamma = static_cast<const T*>(p.norm_weight);
  const int64_t k_lane_end = K - kVec * t;  // as gemv.cu: a lane's vector at k is in range iff k < k_lane_end
  auto k_of = [&](int v, int s) { return int64_t(v) * kIterK + int64_t(s / kU) * kRoundK + kWarpK * (s % kU); };

  extern __shared__ uint4 smem[];
  uint4* ring = smem;                                                // [kR][2][kThreads]: rows g, g + 8
  uint4* xbuf = ring + kR * 2 * kThreads;                            // [2][kMaxSteps][kX]
  float* sq = reinterpret_cast<float*>(xbuf + 2 * kMaxSteps * kX);  // [pass][kNT][8]

  int iv = 0, is = 0, issued = 0;  // the next weight step to copy: pass iv, step is
  auto issue_w = [&]() {           // into slot issued % kR; one commit group, empty after the last pass
    if (iv < kWarps) {
      const int64_t k = k_of(iv, is);
      const int64_t off = k < k_lane_end ? k + kVec * t : 0;  // past K: the row start, multiplied by x = 0
      uint4* slot = ring + (issued % kR) * 2 * kThreads + threadIdx.x;
      cp_async16(slot, wa + off);
      cp_async16(slot + kThreads, wb + off);
      if (++is == pass_steps(K, iv)) {
        ++iv;
        is = 0;
      }
    }
    ++issued;
    cp_async_commit();
  };
  auto issue_x = [&](int v) {  // pass v's x rows (slots past B: row 0, never stored) and norm weight, one group
    uint4* dst = xbuf + (v % 2) * kMaxSteps * kX;
    const int n = pass_steps(K, v) * kX;
    for (int e = threadIdx.x; e < n; e += kThreads) {
      const int s = e / kX, j = e % kX;
      const int tt = j < kNT * 32 ? j % 4 : j - kNT * 32;  // the lane t that reads it
      const int64_t k = k_of(v, s) + kVec * tt;
      const int64_t off = k < K ? k : 0;  // past K: the row start, zeroed by the reader
      const int row = j / 4;
      cp_async16(dst + e, j < kNT * 32 ? x + int64_t(row < p.B ? row : 0) * K + off : gamma + off);
    }
    cp_async_commit();
  };

  // Weights are constant: the first steps stream while the previous kernel drains; x after it (gemv.cu's PDL).
#pragma unroll 1
  for (int i = 0; i < kR; ++i) issue_w();
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  issue_x(0);
  cp_async_wait<0>();
  __syncthreads();

  float acc[kNT][4] = {};
  int consumed = 0;
#pragma unroll 1
  for (int v = 0; v < kWarps; ++v) {
    if (v > 0) {
      // pass v's x was committed a pass ago with at least kR weight steps since: waiting for all but the last
      // kR - 1 groups covers it; the barrier makes every thread's copies visible and frees pass v - 1's buffer
      cp_async_wait<kR - 1>();
      __syncthreads();
    }
    if (v + 1 < kWarps) issue_x(v + 1);
    const uint4* xs = xbuf + (v % 2) * kMaxSteps * kX;
    float part[kNT][4] = {};
    float sumsq[kNT] = {};
    const int steps = pass_steps(K, v);
#pragma unroll 1
    for (int s = 0; s < steps; ++s) {
      cp_async_wait<kR - 1>();  // this thread's copy of step `consumed` has landed (kR - 1 groups or more since)
      const uint4* slot = ring + (consumed % kR) * 2 * kThreads + threadIdx.x;
      const uint4 va = slot[0], vb = slot[kThreads];
      const uint4* xv = xs + s * kX;
      const bool in_k = k_of(v, s) < k_lane_end;
      float gm[kNorm ? kVec : 1];
      if constexpr (kNorm) unpack<T>(xv[kNT * 32 + t], gm);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        uint4 vx = in_k ? xv[nt * 32 + lane] : make_uint4(0, 0, 0, 0);  // x row nt * 8 + g, lane t's 8 columns
        if constexpr (kNorm) {
          float xf[kVec];
          unpack<T>(vx, xf);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            sumsq[nt] = fmaf(xf[i], xf[i], sumsq[nt]);
            xf[i] *= gm[i];
          }
          vx = pack<T>(xf);
        }
        mma<T>(part[nt], va.x, vb.x, va.y, vb.y, vx.x, vx.y);
        mma<T>(part[nt], va.z, vb.z, va.w, vb.w, vx.z, vx.w);
      }
      ++consumed;
      issue_w();  // into the slot just read (its values are in registers, consumed above)
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] += part[nt][i];
      if constexpr (kNorm) {  // every warp has the same sums: warp 0 keeps pass v's, as gemv.cu's warp v did
        float s = sumsq[nt];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (warp == 0 && t == 0) sq[(v * kNT + nt) * 8 + g] = s;
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the passes' sums of squares
  if (tile >= tiles) return;

  // acc[nt]: [0] = C[g][2t], [1] = C[g][2t+1], [2] = C[g+8][2t], [3] = C[g+8][2t+1] (C[row][batch - 8 nt]).
  const Pending<T, 1, E> none;  // these epilogues read nothing an earlier kernel wrote
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // batch columns 2t, 2t + 1 of this batch tile
      const float scale = kNorm ? norm_scale<kNT>(sq, nt, 2 * t + h, K, p.eps) : 1.f;
      store<T, 1, E>(p, none, 0, ra, rb, nt * 8 + 2 * t + h, h, acc[nt][h] * scale, acc[nt][2 + h] * scale);
    }
  }
}

// $HIGGS_RT_GEMV_SHARED_X: 0 (default) off, 1 where a block per 128 rows nearly fills the GPU, 2 wherever it applies.
int wanted() {
  static const int mode = [] {
    const char* v = std::getenv("HIGGS_RT_GEMV_SHARED_X");
    const int m = v ? std::atoi(v) : 0;
    return m == 1 || m == 2 ? m : 0;
  }();
  return mode;
}

}  // namespace

template <typename T, Epi E>
bool launch_shared_x(const GemvArgs& a, int64_t tiles, cudaStream_t stream, int device) {
  if constexpr (E != Epi::kPlain && E != Epi::kNormSilu && E != Epi::kNormLogits) {
    return false;
  } else {
    const int mode = wanted();
    if (mode == 0 || a.B <= 32 || a.K < kMinK || a.K > kMaxK) return false;
    const int64_t blocks = (tiles + kWarps - 1) / kWarps;
    if (mode == 1 && (E != Epi::kNormSilu || 10 * blocks < 7 * cuda::sm_count(device))) return false;
    constexpr size_t kSmem = smem_bytes<has_norm(E)>();
    if (!fits_smem(device, kSmem)) return false;
    auto* kernel = shared_x_kernel<T, E>;
    static const bool sized = allow_smem(kernel, kSmem);
    (void)sized;
    cuda::launch(kernel, dim3(unsigned(blocks)), dim3(kThreads), kSmem, stream, device, cuda::kPdlGemv,
                 "gemv_shared_x_kernel", a, tiles);
    return true;
  }
}

#define HIGGS_RT_SHARED_X(T)                                                                                 \
  template bool launch_shared_x<T, Epi::kPlain>(const GemvArgs&, int64_t, cudaStream_t, int);              \
  template bool launch_shared_x<T, Epi::kResidual>(const GemvArgs&, int64_t, cudaStream_t, int);           \
  template bool launch_shared_x<T, Epi::kNormSilu>(const GemvArgs&, int64_t, cudaStream_t, int);           \
  template bool launch_shared_x<T, Epi::kNormRope>(const GemvArgs&, int64_t, cudaStream_t, int);           \
  template bool launch_shared_x<T, Epi::kNormLogits>(const GemvArgs&, int64_t, cudaStream_t, int);
HIGGS_RT_SHARED_X(__nv_bfloat16)
HIGGS_RT_SHARED_X(__half)
#undef HIGGS_RT_SHARED_X

}  // namespace higgs_rt::gemv_detail
