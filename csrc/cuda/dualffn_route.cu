// CUDA DualFFN routing without host sync: a single-block two-pass scan builds perm (text rows then
// audio rows, stable) and n_audio on the device, then a row-copy kernel gathers (route) or scatters (unroute).
#include "../ops.h"
#include "common.cuh"

namespace higgs_rt {
namespace {

constexpr int kScanThreads = 1024;  // one block, 32 warps; loops over tiles of 1024 rows, so any N works
constexpr int kWarps = kScanThreads / 32;

__global__ void __launch_bounds__(kScanThreads)
    route_perm_kernel(const uint8_t* __restrict__ mask, int64_t N, int64_t* __restrict__ perm,
                      int64_t* __restrict__ n_audio) {
  __shared__ int warp_audio[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  int64_t total_audio = 0;  // pass 1: count audio rows (same value in every thread)
  for (int64_t tile = 0; tile < N; tile += kScanThreads) {
    const int64_t i = tile + threadIdx.x;
    total_audio += __syncthreads_count(i < N && mask[i] != 0);
  }
  const int64_t n_text = N - total_audio;

  int64_t audio_before_tile = 0;  // pass 2: rank each row within its class and place it
  for (int64_t tile = 0; tile < N; tile += kScanThreads) {
    const int64_t i = tile + threadIdx.x;
    const bool audio = i < N && mask[i] != 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, audio);
    if (lane == 0) warp_audio[warp] = __popc(ballot);
    __syncthreads();
    int audio_before_warp = 0, tile_audio = 0;
    for (int w = 0; w < kWarps; ++w) {
      audio_before_warp += w < warp ? warp_audio[w] : 0;
      tile_audio += warp_audio[w];
    }
    if (i < N) {
      const int64_t audio_rank = audio_before_tile + audio_before_warp + __popc(ballot & ((1u << lane) - 1u));
      perm[audio ? n_text + audio_rank : i - audio_rank] = i;
    }
    audio_before_tile += tile_audio;
    __syncthreads();  // warp_audio is rewritten by the next tile
  }
  if (threadIdx.x == 0) *n_audio = total_audio;
}

// scatter ? dst[perm[r]] = src[r] : dst[r] = src[perm[r]], in W-byte words; perm entries outside [0, N) skipped.
template <typename W>
__global__ void permute_rows_kernel(const W* __restrict__ src, W* __restrict__ dst, const int64_t* __restrict__ perm,
                                    int64_t N, int64_t row_words, bool scatter) {
  for (int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const int64_t p = perm[r];
    if (p < 0 || p >= N) continue;
    const W* s = src + (scatter ? r : p) * row_words;
    W* d = dst + (scatter ? p : r) * row_words;
    for (int64_t j = threadIdx.x; j < row_words; j += blockDim.x) d[j] = s[j];
  }
}

template <typename W>
void launch_permute(const void* src, void* dst, const int64_t* perm, int64_t N, int64_t row_bytes, bool scatter,
                    cudaStream_t stream) {
  constexpr int kThreads = 128;
  permute_rows_kernel<W><<<cuda::grid_for(N, 1), kThreads, 0, stream>>>(
      static_cast<const W*>(src), static_cast<W*>(dst), perm, N, row_bytes / int64_t(sizeof(W)), scatter);
  cuda::check_launch("permute_rows_kernel");
}

// Widest word (16 bytes down to 1) that divides the row and both base pointers.
void permute_rows(const void* src, void* dst, const int64_t* perm, int64_t N, int64_t row_bytes, bool scatter,
                  cudaStream_t stream) {
  if (N == 0 || row_bytes == 0) return;
  const uint64_t bits = uint64_t(row_bytes) | reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if (bits % 16 == 0) return launch_permute<uint4>(src, dst, perm, N, row_bytes, scatter, stream);
  if (bits % 8 == 0) return launch_permute<uint2>(src, dst, perm, N, row_bytes, scatter, stream);
  if (bits % 4 == 0) return launch_permute<uint32_t>(src, dst, perm, N, row_bytes, scatter, stream);
  if (bits % 2 == 0) return launch_permute<uint16_t>(src, dst, perm, N, row_bytes, scatter, stream);
  launch_permute<uint8_t>(src, dst, perm, N, row_bytes, scatter, stream);
}

}  // namespace

void dualffn_route_cuda(const DualFFNRouteArgs& a, int device, void* stream) {
  cuda::DeviceGuard guard(device);
  const cudaStream_t s = cuda::as_stream(stream);
  route_perm_kernel<<<1, kScanThreads, 0, s>>>(a.mask, a.N, a.perm, a.n_audio);  // also runs for N = 0: writes n_audio
  cuda::check_launch("route_perm_kernel");
  permute_rows(a.hidden, a.routed, a.perm, a.N, a.row_bytes, /*scatter=*/false, s);
}

void dualffn_unroute_cuda(const DualFFNUnrouteArgs& a, int device, void* stream) {
  if (a.N == 0 || a.row_bytes == 0) return;
  cuda::DeviceGuard guard(device);
  permute_rows(a.y, a.out, a.perm, a.N, a.row_bytes, /*scatter=*/true, cuda::as_stream(stream));
}

}  // namespace higgs_rt
