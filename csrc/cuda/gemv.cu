// CUDA skinny GEMM for decode: y[B, N] = x[B, K] @ w[N, K]^T, 1 <= B <= 8, bf16/fp16, fp32 accumulation.
//
// Memory-bound: the goal is to stream w once at HBM speed. Tensor cores (mma.sync m16n8k16) do the math so
// the 8 FMAs per weight at B = 8 cost nothing; the batch is the MMA's n = 8 (rows >= B are zeros).
//   block   = W warps on one tile of 16 output rows; warp w takes k-slices w, w + W, ... (in-block split-K),
//             then the W partial 16x8 tiles are summed through shared memory. Grid = ceil(N / 16) blocks.
//   loads   = every lane issues 2 * U 16-byte loads of w (rows g and g + 8, lane group g = lane / 4) plus U of x
//             per iteration, all before any math: U KB of w in flight per warp. w bypasses L1
//             (ld.global.nc.L1::no_allocate) so x, re-read by every block, stays L1-resident. ptxas would
//             otherwise interleave loads and MMAs (one load in flight per lane, checked in the SASS); an
//             opaque zero (a kernel argument) mixes every loaded word into the first MMA of each chain, so all
//             loads of an iteration must be issued before the math starts.
//   mapping = the MMA sums over k, so any k-permutation shared by A and B is exact: lane (g, t) feeds its
//             16-byte vector (8 consecutive k) of w row g / g + 8 and of x row g as logical k {2t, 2t+1,
//             2t+8, 2t+9} of two MMAs. Element pairs keep memory order in both operands.
// Every load address is in bounds: rows >= N and batch rows >= B read a clamped row (never stored) and the
// k-tail reads the row start with x zeroed. K % 8 == 0 and 16-byte aligned x and w are required (the Python
// wrapper falls back to torch otherwise). No host sync, no allocation; one launch on the caller's stream.
#include <type_traits>

#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

constexpr int kTileRows = 16;  // MMA m
constexpr int kBatchMax = 8;   // MMA n

__device__ __forceinline__ uint4 ld_stream(const void* p) {  // read-once weights: skip L1
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

__device__ __forceinline__ uint4 ld_cached(const void* p) {  // x: shared by all blocks, keep in L1
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
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

// U: 16-byte vectors per lane per row per iteration; W: warps per block (split-K).
template <typename T, int U, int W>
__global__ void __launch_bounds__(W * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y, int B, int64_t N, int64_t K,
                uint32_t opaque_zero) {
  constexpr int kVec = 8;                 // elements per 16-byte vector
  constexpr int kWarpK = 4 * kVec;        // k covered by the 4 lanes of a group per vector: 32
  constexpr int kIterK = kWarpK * U;      // k per warp per iteration
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int64_t row_a = int64_t(blockIdx.x) * kTileRows + g, row_b = row_a + 8;
  // Absent rows (>= N, >= B) read a valid clamped row instead (their results are never stored), and the k-tail
  // reads the lane's row start with x zeroed: every load is unconditional and in bounds, so the compiler can
  // issue all of them before the first MMA (predicated loads get interleaved with the math).
  const T* wa = w + (row_a < N ? row_a : N - 1) * K;
  const T* wb = w + (row_b < N ? row_b : N - 1) * K;
  const T* xg = x + int64_t(g < B ? g : 0) * K;
  const int64_t k_lane_end = K - kVec * t;  // vector j at k0 + 32 j is in range iff k0 + 32 j < k_lane_end

  float acc[2][4] = {};  // even / odd j: two MMA dependency chains
  for (int64_t k0 = int64_t(warp) * kIterK; k0 < K; k0 += int64_t(W) * kIterK) {
    uint4 va[U], vb[U], vx[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t k = k0 + kWarpK * j;
      const int64_t off = k < k_lane_end ? k + kVec * t : 0;
      va[j] = ld_stream(wa + off);
      vb[j] = ld_stream(wb + off);
      vx[j] = ld_cached(xg + off);
    }
    uint32_t all = 0;  // depends on every load; `& opaque_zero` makes it 0 without the compiler knowing
#pragma unroll
    for (int j = 0; j < U; ++j) all ^= va[j].x ^ vb[j].x ^ vx[j].x;
    vx[0].y ^= all & opaque_zero;  // the first MMA of each accumulator chain waits for every load
    vx[1 % U].y ^= all & opaque_zero;
#pragma unroll
    for (int j = 0; j < U; ++j) {
      if (k0 + kWarpK * j >= k_lane_end) vx[j] = make_uint4(0, 0, 0, 0);  // past K: contributes 0
      // A regs: (row g, k 2t..), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); B regs: (k 2t..), (k 2t+8..)
      mma<T>(acc[j & 1], va[j].x, vb[j].x, va[j].y, vb[j].y, vx[j].x, vx[j].y);
      mma<T>(acc[j & 1], va[j].z, vb[j].z, va[j].w, vb[j].w, vx[j].z, vx[j].w);
    }
  }

  // acc: [0] = C[g][2t], [1] = C[g][2t+1], [2] = C[g+8][2t], [3] = C[g+8][2t+1] (C[row][batch]).
  __shared__ float partial[W][4][32];
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[0][i] + acc[1][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
#pragma unroll
    for (int v = 0; v < W; ++v) s += partial[v][i][lane];
    const int batch = 2 * t + (i & 1);
    const int64_t row = i < 2 ? row_a : row_b;
    if (batch < B && row < N) y[int64_t(batch) * N + row] = cuda::from_f32<T>(s);
  }
}

template <typename T, int U, int W>
void launch(const GemvArgs& a, cudaStream_t stream) {
  const int64_t tiles = (a.N + kTileRows - 1) / kTileRows;
  if (tiles > 0x7fffffff) throw std::invalid_argument("higgs_rt gemv: N too large");
  gemv_kernel<T, U, W><<<unsigned(tiles), W * 32, 0, stream>>>(
      static_cast<const T*>(a.x), static_cast<const T*>(a.w), static_cast<T*>(a.y), int(a.B), a.N, a.K, /*opaque_zero=*/0u);
  cuda::check_launch("gemv_kernel");
}

// 8 warps per block; U = 4 vectors (32 KB of w in flight per block) for K < 4096, U = 8 (64 KB) for the long rows
// of the MLP down projection (K = 8192), whose N = 3072 gives only 192 blocks. With K = 3072 (8192) every warp
// runs 3 (4) iterations: no in-block tail.
template <typename T>
void launch_for(const GemvArgs& a, cudaStream_t stream) {
  if (a.K >= 4096)
    launch<T, 8, 8>(a, stream);
  else
    launch<T, 4, 8>(a, stream);
}

}  // namespace

void gemv_cuda(const GemvArgs& a, int device, void* stream) {
  if (a.N == 0) return;
  if (a.B < 1 || a.B > kBatchMax || a.K % 8 != 0) throw std::invalid_argument("higgs_rt gemv: need 1 <= B <= 8, K % 8 == 0");
  if ((reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.w)) % 16 != 0)
    throw std::invalid_argument("higgs_rt gemv: x and w must be 16-byte aligned");
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  if (a.dtype == TableDType::kFloat32) throw std::invalid_argument("higgs_rt gemv: dtype must be bfloat16 or float16");
  cuda::dispatch(a.dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    if constexpr (!std::is_same_v<T, float>) launch_for<T>(a, s);  // tensor-core MMAs take 16-bit inputs only
  });
}

}  // namespace higgs_rt
