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
//             block an SM: o-proj and down have 24 row blocks), each class's sum written to `partials` and added
//             in class order by a second kernel, which runs the epilogue; only where those bytes stay under a
//             third of the weights' (see plan_for). Measuring: the G blocks as a cluster (sm_90) that adds the
//             sums from its peers' shared memory instead. G never changes a sum, only where it is added.
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
constexpr int kStageK = 64;               // columns a stage: half a class slice
constexpr int kChunks = kStageK / kVec;   // 16-byte chunks of a row a stage
constexpr int kClasses = kWarps;          // gemv.cu's k-split: warp v's slices
constexpr int kRowTiles = 8;              // row tiles (16 rows) a block
constexpr int kBlockRows = 16 * kRowTiles;

// Where a row block's class sums are added (`Sum`): in the block (G = 1), by gemv_tiled_sum_kernel from global
// `partials`, or (measuring) by the G blocks of a thread-block cluster (G = 4 or 8, sm_90), each adding a share of
// the row tiles from its peers' shared memory: the same adds in the same order, without the partials' trip
// through L2.
enum class Sum : int { kBlock = 0, kGlobal = 1, kCluster4 = 4, kCluster8 = 8 };

__host__ __device__ constexpr int cluster_size(Sum m) {
  return m == Sum::kCluster4 ? 4 : (m == Sum::kCluster8 ? 8 : 1);
}

struct Plan {
  bool use = false;
  int bn = 0, groups = 1;
  Sum sum = Sum::kBlock;
  int64_t tiles = 0, row_blocks = 0;
  int64_t partial_bytes() const {
    return sum == Sum::kGlobal ? int64_t(kClasses) * row_blocks * kBlockRows * bn * int64_t(sizeof(float)) : 0;
  }
};

inline bool has_clusters(int device) {
  static int major[64] = {};
  if (device < 0 || device >= 64) return false;
  if (major[device] == 0)
    cuda::check(cudaDeviceGetAttribute(&major[device], cudaDevAttrComputeCapabilityMajor, device),
                "cudaDeviceGetAttribute");
  return major[device] >= 9;
}

// G: the smallest power of two that gives the GPU about a block an SM (at most the 8 classes). A split's class sums
// go through global memory, and only where their bytes (8 classes x 4 bytes, written and read, an output) stay
// under a third of the weights' (K x 2 bytes / BN an output): of the step's GEMVs gate/up runs unsplit, down
// (K = 8192) split over 8 blocks, q/k/v, o-proj and the head stay with gemv.cu's kernel (H100, 7a51d6a: tiled
// q/k/v + RoPE 27.9 against 27.0 us, o-proj 14.8 against 13.0, the head 46.4 against 30.4; gate/up + SwiGLU 48.0
// against 55.4, down 27.9 against 31.5). Measuring: $HIGGS_RT_GEMV_TILED=0 turns the kernel off,
// $HIGGS_RT_GEMV_TILED_G = 1, 2, 4 or 8 forces G everywhere, $HIGGS_RT_GEMV_TILED_SUM = 1 forces global partials
// wherever G > 1, 2 the cluster's sums (sm_90; G then at least 4).
Plan plan_for(const GemvArgs& a, int device) {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_TILED", 1) != 0;
  static const int forced_groups = cuda::env_int("HIGGS_RT_GEMV_TILED_G", 0);
  static const int forced_sum = cuda::env_int("HIGGS_RT_GEMV_TILED_SUM", 0);
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
  }
  if (p.groups > 1 && forced_sum == 2 && has_clusters(device)) {
    p.groups = p.groups < 4 ? 4 : p.groups;
    p.sum = p.groups == 4 ? Sum::kCluster4 : Sum::kCluster8;
  } else if (p.groups > 1) {
    p.sum = Sum::kGlobal;
    if (!forced && forced_sum != 1 && 3 * 2 * kClasses * 4 * p.bn >= a.K * 2) return p;  // partials too dear
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
template <typename T, Epi E, bool PRE, int BN, Sum MODE, int kStages>
__global__ void __launch_bounds__(kThreads, MODE == Sum::kBlock ? 1 : 2) gemv_tiled_kernel(const GemvArgs p,
                                                                                       int64_t tiles,
                                                                                       int classes_per_block) {
  constexpr bool kCluster = cluster_size(MODE) > 1;
  constexpr int kHeld = MODE == Sum::kCluster4 ? 1 : 0;  // a cluster of 4: each block's first class sum, held
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
  auto issue = [&](int s, const auto& src, const auto& dst) {  // stage s's rows of w (or x) into its slot
    if (s >= stages) return;
    uint4* stage = smem + (s % kStages) * kStage;
    const int64_t k = column(s);
#pragma unroll
    for (int i = 0; i < int(sizeof(dst) / sizeof(dst[0])); ++i) cp_async16(stage + dst[i], src[i] + k);
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
  float sum[MODE == Sum::kBlock ? WM : 1][MODE == Sum::kBlock ? WN : 1][4] = {};
  float held[kHeld ? WM : 1][kHeld ? WN : 1][4];
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
    if ((s + 1) % per_class == 0 && (!kCluster || s + 1 < stages)) {  // a class ends (a cluster's last stays in acc)
      const int cls = class0 + s / per_class;
#pragma unroll
      for (int i = 0; i < WM; ++i) {
#pragma unroll
        for (int n = 0; n < WN; ++n) {
          const int64_t at = partial_at(cls, int64_t(gridDim.x) * kRowTiles, tile0 + wm * WM + i, wn * WN + n, NT);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (MODE == Sum::kGlobal) {
              p.partials[at + e * 32 + lane] = acc[i][n][e];
            } else if constexpr (MODE == Sum::kBlock) {
              sum[i][n][e] += acc[i][n][e];
            } else if constexpr (kHeld) {
              held[i][n][e] = acc[i][n][e];
            }
            acc[i][n][e] = 0.f;
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // (only empty groups are left)
  if constexpr (MODE == Sum::kBlock) {
#pragma unroll
    for (int i = 0; i < WM; ++i) {
      const int64_t tile = tile0 + wm * WM + i;
      if (tile >= tiles) continue;
#pragma unroll
      for (int n = 0; n < WN; ++n) finish<T, E, PRE>(p, tile, g, (wn * WN + n) * 8 + 2 * t, sum[i][n]);
    }
  } else if constexpr (kCluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The pipeline's shared memory now holds this block's class sums, [class in block][row tile][batch tile][128].
    constexpr int G = cluster_size(MODE), kPerBlock = kClasses / G;
    static_assert(kPerBlock == kHeld + 1, "a cluster block holds one or two class sums");
    static_assert(sizeof(float) * kPerBlock * kRowTiles * NT * 128 <= sizeof(uint4) * kStages * kStage,
                  "the class sums fit the pipeline's shared memory");
    float* mine = reinterpret_cast<float*>(smem);
    __syncthreads();  // every warp is done with the pipeline
#pragma unroll
    for (int i = 0; i < WM; ++i) {
#pragma unroll
      for (int n = 0; n < WN; ++n) {
        const int at = ((wm * WM + i) * NT + wn * WN + n) * 128 + lane;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if constexpr (kHeld) mine[at + e * 32] = held[i][n][e];
          mine[(kPerBlock - 1) * kRowTiles * NT * 128 + at + e * 32] = acc[i][n][e];
        }
      }
    }
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
    // Block `rank` adds the row tiles rank, rank + G, ...: each (row tile, batch tile) one warp's.
    for (int item = warp; item < (kRowTiles / G) * NT; item += kWarps) {
      const int local = int(rank) + G * (item / NT), nt = item % NT;
      const int64_t tile = tile0 + local;
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int q = 0; q < G; ++q) {  // peer q holds classes q * kPerBlock ...: class order
        uint32_t peer;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(base), "r"(uint32_t(q)));
#pragma unroll
        for (int j = 0; j < kPerBlock; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v;
            const uint32_t at = peer + 4u * uint32_t(((j * kRowTiles + local) * NT + nt) * 128 + e * 32 + lane);
            asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(at) : "memory");
            c[e] += v;
          }
        }
      }
      if (tile < tiles) finish<T, E, PRE>(p, tile, g, nt * 8 + 2 * t, c);
    }
    // no block leaves while a peer may still read its shared memory
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
    __trap();  // launched only where the device has clusters (sm_90)
#endif
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

template <typename T, Epi E, bool PRE, int BN, Sum MODE, int kStages = 4>
void launch_kernel(const GemvArgs& a, const Plan& plan, cudaStream_t s, int device) {
  constexpr size_t kSmem = sizeof(uint4) * kStages * (kBlockRows + BN) * kChunks;
  auto* kernel = gemv_tiled_kernel<T, E, PRE, BN, MODE, kStages>;
  static const bool sized = allow_smem(kernel, kSmem);  // once per kernel
  (void)sized;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(plan.row_blocks), unsigned(plan.groups));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmem;
  config.stream = s;
  cudaLaunchAttribute attribute[2];
  int n = 0;
  if (cuda::has_pdl(device, cuda::kPdlGemv)) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if constexpr (cluster_size(MODE) > 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n++].val.clusterDim = {1u, unsigned(cluster_size(MODE)), 1u};
  }
  config.attrs = attribute;
  config.numAttrs = n;
  cuda::check(cudaLaunchKernelEx(&config, kernel, a, plan.tiles, kClasses / plan.groups), "gemv_tiled_kernel");
}

inline bool deep_pipeline() {
  static const bool on = cuda::env_int("HIGGS_RT_GEMV_TILED_STAGES", 4) == 8;
  return on;
}

template <typename T, Epi E, bool PRE, int BN>
void launch(const GemvArgs& a, Plan plan, cudaStream_t s, int device) {
  if (plan.sum == Sum::kGlobal && a.partials == nullptr) plan.sum = Sum::kBlock, plan.groups = 1;  // the same sums
  switch (plan.sum) {
    case Sum::kBlock:  // one block an SM: it may take twice the stages ($HIGGS_RT_GEMV_TILED_STAGES=8, measuring)
      if (deep_pipeline()) return launch_kernel<T, E, PRE, BN, Sum::kBlock, 8>(a, plan, s, device);
      return launch_kernel<T, E, PRE, BN, Sum::kBlock>(a, plan, s, device);
    case Sum::kCluster4: return launch_kernel<T, E, PRE, BN, Sum::kCluster4>(a, plan, s, device);
    case Sum::kCluster8: return launch_kernel<T, E, PRE, BN, Sum::kCluster8>(a, plan, s, device);
    case Sum::kGlobal: break;
  }
  launch_kernel<T, E, PRE, BN, Sum::kGlobal>(a, plan, s, device);
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
