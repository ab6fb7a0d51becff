// The streaming codec's convolutions on tensor cores at fp32 accuracy: out = Snake(conv(x) + bias), channels last,
// x [B, L, C] fp32, weight [taps * C, N] tap-major (higgs_rt/codec/gemm.py's layout), out [B, W, N], W = L - (taps
// - 1) * dilation. One implicit GEMM: output row r = (lane b, sample t) reads its im2col row straight from x (tap j
// at x[b, t + j * dilation, :]), so the im2col copy that fed cuBLAS (7x the activations, written then read: 26% of
// a 64-lane push's GPU time on the H200, bench_codec_stream's profile) is gone.
//
// Why: cuBLAS's SGEMM runs on the CUDA cores; the codec's ~0.5 GFLOP a frame then slows the decode steps beside
// it (the server's batch-8 level, issue 19), and plain TF32 (one rounding of each operand to 10 mantissa bits)
// moved its audio by up to 195 LSB. Here each operand is split as v = big + small, big = tf32(v), small =
// tf32(v - big), and a product is small_a * big_b + big_a * small_b + big_a * big_b ("3xTF32": the dropped
// small * small term is ~2^-22 of it), accumulated in fp32 by mma.sync m16n8k8.
//
//   block = 8 warps over a BM x BN output tile (warps 4 along M, 2 along N), k in steps of 32 (one tap's 32
//           channels: C % 32 == 0, so a step never straddles taps), a 4-stage cp.async ring of the A rows and B
//           columns in shared memory (rows padded by 4 / 8 floats: conflict-free fragment loads).
//   tiles = 128 x 32 where those tiles fill the GPU at least once, else 64 x 32: every output's sum is the same
//           sequence of MMAs and adds whatever the tile or the batch, so a lane's samples are the same bits at any
//           lane count. Rows past B * W read row B * W - 1 and are not stored. 128 x 64 tiles (166 registers with
//           the step sums below, one block an SM; spills at 128) lost on an H100: an 8-lane push 2.11 -> 2.29 ms,
//           the server's 8 streams 90.7% -> 88.7% of the batch-8 step, though a 64-lane push 11.2 -> 10.7 ms.
//   sums  = each k step's 32 products (12 MMAs) summed in a fresh accumulator, then added to the output's running
//           sum with one IEEE add: the tensor cores' own accumulation rounds coarser than fp32 (one long chain of
//           MMAs measured 2-7e-6 of the output against SGEMM's 2-5e-7 on an H100, and moved the server's audio by
//           9 LSB loaded vs alone).
//   split = long sums (K past 1024: the first conv and the 256- and 512-channel layers, whose few rows at a few lanes
//           made few tiles, each a long latency-bound loop) run in blocks of at most 32 k steps along the grid's z,
//           each writing its partial sums; tap_sum.cu adds them in order, then the bias and Snake. The split is
//           chosen from K alone (library.cpp), so it too is the same at every lane count.
//   epilogue = bias (IEEE add) then Snake (snake.cuh, torch's rounding), float2 stores; partial sums as they are.
// Measured on an H100 (benchmarks/results/codec_layers_gpu_h100_*.json, server_gpu_h100_6ed04a7*.json): an 8-frame
// push of 8 lanes 2.26 -> 2.11 ms, of 64 lanes 11.8 -> 11.2 ms against SGEMM; the server's 8 streams 86.8% -> 89.4%
// of the batch-8 step in one call; each convolution's error against fp64 0.4-2.4x SGEMM's. This kernel is now 1.6
// of the 8-lane push's 1.9 ms of kernels, far below the tensor cores' rate (NOTES.md: the conversions, next).
#include <stdexcept>

#include "../ops.h"
#include "common.cuh"
#include "snake.cuh"

namespace higgs_rt {
namespace {

constexpr int kBK = int(kCodecConvStep);  // k per stage: one tap's 32 channels
constexpr int kStages = 4;
constexpr int kThreads = 256;  // 8 warps: 4 along M x 2 along N
constexpr int kPadA = 4, kPadB = 8;

__device__ __forceinline__ uint32_t tf32(float v) {  // round to nearest, ties away: 10 mantissa bits
  uint32_t r = __float_as_uint(v);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
#endif
  return r;
}

// How an operand v becomes big + small ($HIGGS_RT_CODEC_CONV_SPLIT, measuring; the product's three MMAs as above):
//   kCvt   (0, the default) big = cvt.rna(v), small = cvt.rna(v - big): two quarter-rate conversions a value, 24 a
//          warp's k8 for its 12 MMAs (NOTES.md: far below the tensor cores' rate).
//   kTrunc (1) big by a bit mask (one logic op), so small = v - big keeps up to 2^-10 of v and its rounding leaves
//          2^-21 of it, against 2^-22: other bits.
//   kInt   (2) cvt.rna's rounding done by integer ops, (bits + 0x1000) & 0xffffe000: adding half of tf32's last
//          place to the magnitude and dropping the 13 low bits rounds to nearest with ties away from zero, and a
//          carry into the exponent is the round up into the next binade; so for every finite v both parts are the
//          default's bits (v - big is exact either way), from full-rate IADD and LOP instead of cvt.
enum Split { kCvt = 0, kTrunc = 1, kInt = 2 };

__device__ __forceinline__ uint32_t tf32_int(float v) { return (__float_as_uint(v) + 0x1000u) & 0xffffe000u; }

template <int kSplit>
__device__ __forceinline__ void split(float v, uint32_t& big, uint32_t& small) {
  big = kSplit == kCvt ? tf32(v) : kSplit == kTrunc ? __float_as_uint(v) & 0xffffe000u : tf32_int(v);
  const float rest = v - __uint_as_float(big);
  small = kSplit == kInt ? tf32_int(rest) : tf32(rest);
}

// c (16x8 f32) += a (16x8 tf32, row-major) * b (8x8 tf32, col-major)
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <int BM, int BN>
struct Tile {
  static constexpr int kWarpM = BM / 4, kWarpN = BN / 2;  // a warp's outputs
  static constexpr int kMI = kWarpM / 16, kNI = kWarpN / 8;  // its MMA tiles
  static constexpr int kStrideA = kBK + kPadA, kStrideB = BN + kPadB;
  static constexpr int kFloatsA = BM * kStrideA, kFloatsB = kBK * kStrideB;
  static constexpr size_t kSmem = size_t(kStages) * (kFloatsA + kFloatsB) * sizeof(float);
  static_assert(kMI >= 1 && kNI >= 1 && (BM * kBK / 4) % kThreads == 0, "codec_conv: tile shapes");
};

template <int BM, int BN, int kSplit>
__global__ void __launch_bounds__(kThreads, 2) codec_conv_kernel(CodecConvArgs a) {
  using T = Tile<BM, BN>;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
  const int wm = warp % 4, wn = warp / 4;
  const int64_t rows = a.B * a.W, row0 = int64_t(blockIdx.x) * BM, n0 = int64_t(blockIdx.y) * BN;
  const int64_t all_steps = a.taps * a.C / kBK, first = int64_t(blockIdx.z) * a.split_steps;
  const int64_t steps = (all_steps - first < a.split_steps ? all_steps - first : a.split_steps);

  // this thread's A copies: rows (tid + i * 256) / 8, 16-byte column (tid % 8); base pointers per row
  constexpr int kCopiesA = BM * kBK / 4 / kThreads;
  const float* a_src[kCopiesA];
#pragma unroll
  for (int i = 0; i < kCopiesA; ++i) {
    int64_t r = row0 + (tid + i * kThreads) / 8;
    r = r < rows ? r : rows - 1;
    const int64_t b = r / a.W, t = r % a.W;
    a_src[i] = a.x + (b * a.L + t) * a.C + (tid % 8) * 4;
  }

  auto load_stage = [&](int64_t s, int slot) {
    float* as = smem + slot * (T::kFloatsA + T::kFloatsB);
    float* bs = as + T::kFloatsA;
    const int64_t k0 = (first + s) * kBK, tap = k0 / a.C, c0 = k0 % a.C;
    const int64_t shift = tap * a.dilation * a.C + c0;
#pragma unroll
    for (int i = 0; i < kCopiesA; ++i) {
      const int idx = tid + i * kThreads;
      cuda::cp_async16(as + (idx / 8) * T::kStrideA + (idx % 8) * 4, a_src[i] + shift);
    }
    constexpr int kVecB = kBK * BN / 4;
#pragma unroll
    for (int idx = tid; idx < kVecB; idx += kThreads) {
      const int kr = idx / (BN / 4), col = (idx % (BN / 4)) * 4;
      cuda::cp_async16(bs + kr * T::kStrideB + col, a.w + (k0 + kr) * a.N + n0 + col);
    }
  };

  float acc[T::kMI][T::kNI][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_stage(s, s);
    cuda::cp_async_commit();
  }
  for (int64_t s = 0; s < steps; ++s) {
    cuda::cp_async_wait<kStages - 2>();
    __syncthreads();  // stage s landed for every thread; stage s - 1's slot is free
    if (s + kStages - 1 < steps) load_stage(s + kStages - 1, int((s + kStages - 1) % kStages));
    cuda::cp_async_commit();
    const float* as = smem + (s % kStages) * (T::kFloatsA + T::kFloatsB);
    const float* bs = as + T::kFloatsA;
    float part[T::kMI][T::kNI][4] = {};  // this step's 32 products a sum: the MMAs' own adds stay short
#pragma unroll
    for (int k8 = 0; k8 < kBK; k8 += 8) {
      uint32_t ab[T::kMI][4], asm_[T::kMI][4];
#pragma unroll
      for (int mi = 0; mi < T::kMI; ++mi) {
        const float* p = as + (wm * T::kWarpM + mi * 16 + g) * T::kStrideA + k8 + q;
        split<kSplit>(p[0], ab[mi][0], asm_[mi][0]);
        split<kSplit>(p[8 * T::kStrideA], ab[mi][1], asm_[mi][1]);
        split<kSplit>(p[4], ab[mi][2], asm_[mi][2]);
        split<kSplit>(p[8 * T::kStrideA + 4], ab[mi][3], asm_[mi][3]);
      }
#pragma unroll
      for (int ni = 0; ni < T::kNI; ++ni) {  // one B fragment at a time: fewer live registers
        const float* p = bs + (k8 + q) * T::kStrideB + wn * T::kWarpN + ni * 8 + g;
        uint32_t bb[2], bsm[2];
        split<kSplit>(p[0], bb[0], bsm[0]);
        split<kSplit>(p[4 * T::kStrideB], bb[1], bsm[1]);
#pragma unroll
        for (int mi = 0; mi < T::kMI; ++mi) {
          mma_tf32(part[mi][ni], asm_[mi], bb);
          mma_tf32(part[mi][ni], ab[mi], bsm);
          mma_tf32(part[mi][ni], ab[mi], bb);
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < T::kMI; ++mi) {
#pragma unroll
      for (int ni = 0; ni < T::kNI; ++ni) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][ni][e] = __fadd_rn(acc[mi][ni][e], part[mi][ni][e]);
      }
    }
  }
  cuda::cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < T::kMI; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t r = row0 + wm * T::kWarpM + mi * 16 + g + half * 8;
      if (r >= rows) continue;
      float* out = a.partial != nullptr ? a.partial + (blockIdx.z * rows + r) * a.N : a.out + r * a.N;
#pragma unroll
      for (int ni = 0; ni < T::kNI; ++ni) {
        const int64_t n = n0 + wn * T::kWarpN + ni * 8 + 2 * q;
        float v[2] = {acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]};
#pragma unroll
        for (int e = 0; e < 2 && a.partial == nullptr; ++e) {
          if (a.bias != nullptr) v[e] = __fadd_rn(v[e], a.bias[n + e]);
          if (a.alpha != nullptr) v[e] = cuda::snake1(v[e], a.alpha[n + e], cuda::snake_inv(a.alpha[n + e]));
        }
        *reinterpret_cast<float2*>(out + n) = make_float2(v[0], v[1]);
      }
    }
  }
}

template <int BM, int BN, int kSplit>
void launch(const CodecConvArgs& a, int device, void* stream) {
  using T = Tile<BM, BN>;
  static bool configured[64] = {};
  if (device >= 0 && device < 64 && !configured[device]) {
    cuda::check(cudaFuncSetAttribute(codec_conv_kernel<BM, BN, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(T::kSmem)),
                "cudaFuncSetAttribute(codec_conv_kernel)");
    configured[device] = true;
  }
  const int64_t splits = (a.taps * a.C / kBK + a.split_steps - 1) / a.split_steps;
  const dim3 grid(unsigned((a.B * a.W + BM - 1) / BM), unsigned(a.N / BN), unsigned(splits));
  codec_conv_kernel<BM, BN, kSplit><<<grid, kThreads, T::kSmem, cuda::as_stream(stream)>>>(a);
  cuda::check_launch("codec_conv_kernel");
}

template <int BM, int BN>
void launch(const CodecConvArgs& a, int device, void* stream) {
  static const int mode = cuda::env_int("HIGGS_RT_CODEC_CONV_SPLIT", kCvt);
  switch (mode) {
    case kTrunc: return launch<BM, BN, kTrunc>(a, device, stream);
    case kInt: return launch<BM, BN, kInt>(a, device, stream);
    default: return launch<BM, BN, kCvt>(a, device, stream);
  }
}

}  // namespace

void codec_conv_cuda(const CodecConvArgs& a, int device, void* stream) {
  if (a.B * a.W == 0) return;
  if (a.split_steps < 1 || (a.partial == nullptr && a.split_steps < a.taps * a.C / kBK)) {
    throw std::invalid_argument("codec_conv: a split sum needs its partial buffer");
  }
  cuda::DeviceGuard guard(device);
  if ((a.B * a.W + 127) / 128 * (a.N / 32) >= cuda::sm_count(device)) {
    launch<128, 32>(a, device, stream);
  } else {
    launch<64, 32>(a, device, stream);
  }
}

}  // namespace higgs_rt
