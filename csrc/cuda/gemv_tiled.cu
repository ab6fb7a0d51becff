// The decode GEMV family above 16 slots as a tiled GEMM: y = epilogue(x[B, K] @ w[N, K]^T), 17 <= B <= 64,
// K % 1024 == 0, bit for bit what gemv.cu's k-split kernel computes for each row (so batch 1 and batch 64 give
// a slot the same bits), at a fraction of its L2 traffic.
//
// Why: above 16 slots gemv.cu's blocks hold 32 weight rows and each reads all of x from L2, so x's traffic is
// twice the weights' and its 8-warp k-split leaves one block an SM (H200, 0e16ab1, graphs of chained calls at
// batch 64: 3072 -> 16384 at 2.09 TB/s, 8192 -> 3072 at 1.75, 3072 -> 5120 at 1.40, where cuBLAS's tiled GEMMs run
// 3.67, 2.60, 2.83: about 44 us a layer, 1.2 ms of the 5.2 ms batch-64 step).
//   block   = 128 weight rows (8 row tiles of 16) x BN batch columns (32 or 64), 8 warps as 4 (rows) x 2 (batch),
//             a warp's tile 2 row tiles x BN / 16 batch tiles. x is read from L2 once per 128 rows (half the
//             weights' bytes at BN = 64).
//   sums    = gemv.cu's k-split: warp v there multiplies the 128-column slices v, v + 8, v + 16, ... ("class" v),
//             32 columns a step, lane (g, t) the 8 columns at 8 t of rows g and g + 8, in two m16n8k16 MMAs
//             (elements 0-3, then 4-7); the 8 class sums are then added to 0 in class order. Here a block walks its
//             classes one after another, feeding each accumulator the same MMAs with the same registers in the
//             same order, and adds (or hands over) each class's sum the same way: the same bits for every row.
//   split   = a row block's classes spread over G blocks (G = 1, 2, 4, 8, the smallest that gives the GPU about a
//             block an SM: down has 24 row blocks), each class's sum written to `partials`; a second kernel adds
//             them in class order and runs the epilogue; only where those bytes stay under a third of the
//             weights' (plan_for). G never changes a sum, only where it is added. (Branch wip/tiled-cluster: the
//             G blocks as a cluster adding the sums from their peers' shared memory: lost, NOTES.md.)
//   loads   = a 4-stage cp.async pipeline of 64-column stages (24 KB: 128 + BN rows of 128 bytes), one barrier a
//             stage, two blocks an SM (unsplit, one); rows stored with their 16-byte chunks' order flipped on odd
//             rows, so each 8-lane phase of a warp's 16-byte fragment loads (rows g, g + 1, chunks 4 j + t) hits
//             the 32 banks once.
//   PDL     = the first stages' weights stream before the wait for the previous kernel, x's after it.
//   epilogue= gemv_common.cuh's `store`, fed as gemv.cu feeds it (the pre-pass's norm scale, the residual, RoPE and
//             the cache writes, SwiGLU, the logits' rounding).
// Every load address is in bounds (rows past N or B clamped, never stored). No host sync, no allocation.
#include "gemv_common.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = kWarps * 32;
constexpr int kStages = 4;
constexpr int kStageK = 64;               // columns a stage: half a class slice
constexpr int kChunks = kStageK / kVec;   // 16-byte chunks of a row a stage
constexpr int kClasses = kWarps;          // gemv.cu's k-split: warp v's slices
constexpr int kRowTiles = 8;              // row tiles (16 rows) a block
constexpr int kBlockRows = 16 * kRowTiles;

struct Plan {
  bool use = false;
  int bn = 0, groups = 1;
  int64_t tiles = 0, row_blocks = 0;
  int64_t partial_bytes() const {
    return groups > 1 ? int64_t(kClasses) * row_blocks * kBlockRows * bn * int64_t(sizeof(float)) : 0;
  }
};

// G: the smallest power of two that gives the GPU about a block an SM (at most the 8 classes). A split's class sums
// go through global memory, so the kernel runs only where their bytes (8 classes x 4 bytes, written and read, an
// output) stay under a third of the weights' (K x 2 bytes / BN an output): of the step's GEMVs gate/up runs
// unsplit, down (K = 8192) split over 8 blocks, q/k/v, o-proj and the head stay with gemv.cu's kernel (H100,
// 7a51d6a, every GEMV tiled: q/k/v + RoPE 27.9 against 27.0 us, o-proj 14.8 against 13.0, the head 46.4 against
// 30.4; gate/up + SwiGLU 48.0 against 55.4, down 27.9 against 31.5). At 17-32 rows too (BN = 32; H100, 4b0af59,
// 32 rows: gate/up + SwiGLU 43.9 against 48.5, down + residual 23.5 against 25.2; 17-31 rows not timed, where
// gemv.cu's narrower batch tiles cost it less). Measuring: $HIGGS_RT_GEMV_TILED=0 turns it off;
// $HIGGS_RT_GEMV_TILED_G = 1, 2, 4 or 8 forces G and the kernel wherever its shapes allow (17-64 rows).
// Lost (H100, 2d55665): every GEMV at 17-64 rows as 64-row unsplit blocks, 6 stages, two blocks an SM: b64 8.832
// against 5.304 ms.

Plan plan_for(const GemvArgs& a, int device) {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_TILED", 1) != 0;
  static const int forced_groups = cuda::env_int("HIGGS_RT_GEMV_TILED_G", 0);
  Plan p;
  const Epi e = a.epilogue;
  if (!on || a.B <= 16 || a.B > 64 || a.K % 1024 != 0 || a.N < 1 || (has_norm(e) && a.prenorm == nullptr)) return p;
  p.bn = a.B > 32 ? 64 : 32;
  p.tiles = (e == Epi::kNormSilu || e == Epi::kNormRope) ? a.N / 16 : (a.N + 15) / 16;
  p.row_blocks = (p.tiles + kRowTiles - 1) / kRowTiles;
  const bool forced = forced_groups == 1 || forced_groups == 2 || forced_groups == 4 || forced_groups == 8;
  if (forced) {
    p.groups = forced_groups;
  } else {
    const int64_t want = int64_t(cuda::sm_count(device)) * 9 / 10;
    while (p.groups < kClasses && p.row_blocks * p.groups < want) p.groups *= 2;
    if (p.groups > 1 && 3 * 2 * kClasses * 4 * p.bn >= a.K * 2) return p;  // the partials would cost too much
  }
  p.use = true;
  return p;
}

__device__ __forceinline__ int swizzle(int row, int chunk) { return row * kChunks + (chunk ^ ((row & 1) << 2)); }

// Where class `cls`'s sum of batch tile nt of row tile `tile` lies in `partials`: 128 floats, [element][lane].
__device__ __forceinline__ int64_t partial_at(int cls, int64_t tiles_pad, int64_t tile, int nt, int NT) {
  return ((int64_t(cls) * tiles_pad + tile) * NT + nt) * 128;
}

// One tile's outputs (rows g / g + 8 of row tile `tile`, batch columns b0, b0 + 1) through gemv.cu's epilogue.
template <typename T, Epi E, bool PRE>
__device__ __forceinline__ void finish(const GemvArgs& p, int64_t tile, int g, int b0, const float (&c)[4]) {
  int64_t ra[1], rb[1];
  tile_rows<E>(p, tile, g, ra[0], rb[0]);
  Pending<T, 1, E, PRE> pending;
  pending.fetch(p, ra, rb, b0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float scale = PRE ? pending.scale[h] : 1.f;
    store<T, 1, E, PRE>(p, pending, 0, ra[0], rb[0], b0 + h, h, c[h] * scale, c[2 + h] * scale);
  }
}

// Two blocks an SM where the grid is split (o-proj, down, q/k/v, the logits: 160-192 blocks); one block's grid
// (gate/up, 128 row blocks) fills the SMs once, and its class sums take the registers two blocks would need.
template <typename T, Epi E, bool PRE, int BN, bool SPLIT>
__global__ void __launch_bounds__(kThreads, SPLIT ? 2 : 1) gemv_tiled_kernel(const GemvArgs p, int64_t tiles,
                                                                   int classes_per_block) {
  constexpr int NT = BN / 8;                       // batch tiles of 8
  constexpr int WM = kRowTiles / 4, WN = NT / 2;   // a warp's row and batch tiles
  constexpr int kA = kBlockRows * kChunks, kX = BN * kChunks, kStage = kA + kX;  // 16-byte chunks
  constexpr int kACopies = kA / kThreads, kXCopies = kX / kThreads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp % 4, wn = warp / 4;
  const int64_t N = p.N, K = p.K, tile0 = int64_t(blockIdx.x) * kRowTiles;
  const int class0 = int(blockIdx.y) * classes_per_block;
  const int per_class = int(K / 1024) * 2;  // stages a class: K / 1024 slices of two stages
  const int stages = per_class * classes_per_block;

  const T* w = static_cast<const T*>(p.w);
  const T* x = static_cast<const T*>(PRE ? p.prenorm : p.x);
  const T* w_src[kACopies];
  const T* x_src[kXCopies];
  int w_dst[kACopies], x_dst[kXCopies];
#pragma unroll
  for (int i = 0; i < kACopies; ++i) {
    const int q = threadIdx.x + i * kThreads, row = q / kChunks, chunk = q % kChunks;
    const int64_t tile = tile0 + row / 16 < tiles ? tile0 + row / 16 : tiles - 1;  // past the end: loaded, not stored
    int64_t ra, rb;
    tile_rows<E>(p, tile, row % 8, ra, rb);
    const int64_t r = (row % 16) < 8 ? ra : rb;
    w_src[i] = w + (r < N ? r : N - 1) * K + chunk * kVec;
    w_dst[i] = swizzle(row, chunk);
  }
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int q = threadIdx.x + i * kThreads, row = q / kChunks, chunk = q % kChunks;
    x_src[i] = x + int64_t(row < p.B ? row : 0) * K + chunk * kVec;  // rows past B: row 0, never stored
    x_dst[i] = kA + swizzle(row, chunk);
  }
  auto column = [&](int s) {
    const int cls = class0 + s / per_class, i = s % per_class;
    return int64_t(cls + kClasses * (i / 2)) * 128 + (i % 2) * kStageK;
  };
  extern __shared__ uint4 smem[];
  auto issue = [&](int s, const auto& src, const auto& dst) {  // stage s's weights (w_src) or x (x_src)
    if (s >= stages) return;
    uint4* stage = smem + (s % kStages) * kStage;
    const int64_t k = column(s);
#pragma unroll
    for (int i = 0; i < int(sizeof(src) / sizeof(src[0])); ++i) cp_async16(stage + dst[i], src[i] + k);
  };
  auto issue_w = [&](int s) { issue(s, w_src, w_dst); };
  auto issue_x = [&](int s) { issue(s, x_src, x_dst); };
  // Groups: w0 .. w(S-2), then x0 .. x(S-2), then a stage's w and x together: at stage s's turn S - 2 groups
  // follow its last one, as in the plain pipeline.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue_w(s);
    cp_async_commit();
  }
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue_x(s);
    cp_async_commit();
  }

  float acc[WM][WN][4] = {};
  float sum[SPLIT ? 1 : WM][SPLIT ? 1 : WN][4] = {};
  for (int s = 0; s < stages; ++s) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage s is everyone's; stage s - 1's slot is free
    issue_w(s + kStages - 1);
    issue_x(s + kStages - 1);
    cp_async_commit();
    const uint4* a_tile = smem + (s % kStages) * kStage;
    const uint4* x_tile = a_tile + kA;
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // 32-column steps: lane (g, t) multiplies the 8 columns at 32 j + 8 t
      const int chunk = 4 * j + t;
      uint4 va[WM], vb[WM], vx[WN];
#pragma unroll
      for (int i = 0; i < WM; ++i) {
        const int row = (wm * WM + i) * 16 + g;
        va[i] = a_tile[swizzle(row, chunk)];
        vb[i] = a_tile[swizzle(row + 8, chunk)];
      }
#pragma unroll
      for (int n = 0; n < WN; ++n) vx[n] = x_tile[swizzle((wn * WN + n) * 8 + g, chunk)];
      // gemv.cu's two MMAs a step, with the same registers: elements 0-3 of each lane's 8 columns, then 4-7
#pragma unroll
      for (int n = 0; n < WN; ++n) {
#pragma unroll
        for (int i = 0; i < WM; ++i) {
          mma<T>(acc[i][n], va[i].x, vb[i].x, va[i].y, vb[i].y, vx[n].x, vx[n].y);
          mma<T>(acc[i][n], va[i].z, vb[i].z, va[i].w, vb[i].w, vx[n].z, vx[n].w);
        }
      }
    }
    if ((s + 1) % per_class == 0) {  // a class ends: its sum added in class order, or handed over
      const int cls = class0 + s / per_class;
#pragma unroll
      for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int n = 0; n < WN; ++n) {
          const int64_t at = partial_at(cls, int64_t(gridDim.x) * kRowTiles, tile0 + wm * WM + i, wn * WN + n, NT);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (SPLIT) {
              p.partials[at + e * 32 + lane] = acc[i][n][e];
            } else {
              sum[i][n][e] += acc[i][n][e];
            }
            acc[i][n][e] = 0.f;
          }
        }
      }
    }
  }
  if constexpr (!SPLIT) {
    cp_async_wait<0>();  // (only empty groups are left)
#pragma unroll
    for (int i = 0; i < WM; ++i) {
      const int64_t tile = tile0 + wm * WM + i;
      if (tile >= tiles) continue;
#pragma unroll
      for (int n = 0; n < WN; ++n) finish<T, E, PRE>(p, tile, g, (wn * WN + n) * 8 + 2 * t, sum[i][n]);
    }
  }
}

// The split's second half: one warp a (row tile, batch tile) adds its 8 class sums to 0 in class order, then runs
// the epilogue.
template <typename T, Epi E, bool PRE, int NT>
__global__ void __launch_bounds__(kThreads) gemv_tiled_sum_kernel(const GemvArgs p, int64_t tiles, int64_t tiles_pad) {
  const int64_t item = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  cuda::allow_next_grid();
  cuda::wait_for_previous_grid();
  if (item >= tiles * NT) return;
  const int64_t tile = item / NT;
  const int nt = int(item % NT);
  float part[kClasses][4];
#pragma unroll
  for (int cls = 0; cls < kClasses; ++cls) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      part[cls][e] = __ldcg(p.partials + partial_at(cls, tiles_pad, tile, nt, NT) + e * 32 + lane);
    }
  }
  float c[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float s = 0.f;
#pragma unroll
    for (int cls = 0; cls < kClasses; ++cls) s += part[cls][e];
    c[e] = s;
  }
  finish<T, E, PRE>(p, tile, g, nt * 8 + 2 * t, c);
}

// One launch of the tiled kernel, its shared memory (the stages of 128 weight rows and BN x rows) asked for once.
template <typename T, Epi E, bool PRE, int BN, bool SPLIT>
void launch_kernel(const GemvArgs& a, dim3 grid, int64_t tiles, int per_block, cudaStream_t s, int device) {
  constexpr size_t kSmem = sizeof(uint4) * kStages * (kBlockRows + BN) * kChunks;
  auto* kernel = gemv_tiled_kernel<T, E, PRE, BN, SPLIT>;
  static const bool sized = allow_smem(kernel, kSmem);
  (void)sized;
  cuda::launch(kernel, grid, dim3(kThreads), kSmem, s, device, cuda::kPdlGemv, "gemv_tiled_kernel", a, tiles,
               per_block);
}

template <typename T, Epi E, bool PRE, int BN>
void launch(const GemvArgs& a, Plan plan, cudaStream_t s, int device) {
  if (a.partials == nullptr) plan.groups = 1;  // the same sums, added in the block
  const dim3 grid(unsigned(plan.row_blocks), unsigned(plan.groups));
  const int per_block = kClasses / plan.groups;
  if (plan.groups == 1) return launch_kernel<T, E, PRE, BN, false>(a, grid, plan.tiles, per_block, s, device);
  launch_kernel<T, E, PRE, BN, true>(a, grid, plan.tiles, per_block, s, device);
  constexpr int NT = BN / 8;
  cuda::launch(gemv_tiled_sum_kernel<T, E, PRE, NT>, dim3(unsigned((plan.tiles * NT + kWarps - 1) / kWarps)),
               dim3(kThreads), 0, s, device, cuda::kPdlGemv, "gemv_tiled_sum_kernel", a, plan.tiles,
               plan.row_blocks * kRowTiles);
}

template <typename T, Epi E>
void launch_epilogue(const GemvArgs& a, const Plan& plan, cudaStream_t s, int device) {
  constexpr bool kPre = has_norm(E);  // a norm epilogue's x was normed by gemv.cu's pre-pass
  if (plan.bn == 64) return launch<T, E, kPre, 64>(a, plan, s, device);
  return launch<T, E, kPre, 32>(a, plan, s, device);
}

}  // namespace

bool gemv_tiled_applies(const GemvArgs& a, int device) { return plan_for(a, device).use; }

int64_t gemv_partials_bytes(const GemvArgs& a, int device) {
  const Plan plan = plan_for(a, device);
  return plan.use ? plan.partial_bytes() : 0;
}

void gemv_tiled_cuda(const GemvArgs& a, int device, cudaStream_t stream) {
  const Plan plan = plan_for(a, device);
  if (!plan.use) throw std::invalid_argument("higgs_rt gemv: the tiled kernel does not take these shapes");
  cuda::dispatch(a.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!std::is_same_v<T, float>) {
      switch (a.epilogue) {
        case Epi::kPlain: return launch_epilogue<T, Epi::kPlain>(a, plan, stream, device);
        case Epi::kResidual: return launch_epilogue<T, Epi::kResidual>(a, plan, stream, device);
        case Epi::kNormSilu: return launch_epilogue<T, Epi::kNormSilu>(a, plan, stream, device);
        case Epi::kNormRope: return launch_epilogue<T, Epi::kNormRope>(a, plan, stream, device);
        case Epi::kNormLogits: return launch_epilogue<T, Epi::kNormLogits>(a, plan, stream, device);
      }
    }
  });
}

}  // namespace higgs_rt
