// L2 prefetch of weights a later kernel of the decode step will stream, issued while the step waits on a
// latency-bound kernel (attention, the sampler) and the memory bus would otherwise idle.
//
// Evidence (csrc/cuda/NOTES.md, thirteenth session, H100): from QKV's end to attention's end a batch-1 layer
// spends 12-15 us with almost no bytes moving, and the GEMVs after it stream from HBM: gate/up takes 42.5 us
// against 33.6 at copy speed. Bytes put in L2 during that wait are bytes the next GEMVs read at L2 speed.
// (A blanket prefetch before every GEMV lost: 2.30 -> 2.64 ms; there the bus was already busy.)
//
//   ranges  up to three byte ranges (a weight, or row slices of one), 16-byte aligned and sized; a thread
//           issues one prefetch of kBytes (the last of a range: what is left).
//   how     sm_90: `cp.async.bulk.prefetch.L2.global` (the copy engine fetches, no register or shared-memory
//           cost, no completion to wait for); before sm_90, `prefetch.global.L2` per 128-byte line.
//   PDL     lets the next kernel launch at once and waits for the previous grid only before it exits: its own
//           end then implies the previous kernel's, so the next kernel's PDL wait still covers what the
//           previous kernel wrote. Reads nothing any kernel writes; writes nothing.
// A hint only: results never depend on it ($HIGGS_RT_L2_PREFETCH_MB in higgs_rt/talker.py turns it on).
#include <stdexcept>

#include "../ops.h"
#include "common.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kBytes = 16384;  // per thread and prefetch

__device__ __forceinline__ void prefetch_l2(const char* p, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(static_cast<uint32_t>(bytes)) : "memory");
#else
  for (int64_t o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
#endif
}

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const L2PrefetchArgs a) {
  cuda::allow_next_grid();
  int64_t piece = int64_t(blockIdx.x) * kThreads + threadIdx.x;
#pragma unroll
  for (int r = 0; r < kL2PrefetchRanges; ++r) {
    const int64_t pieces = (a.bytes[r] + kBytes - 1) / kBytes;
    if (piece < pieces) {
      const int64_t offset = piece * kBytes, left = a.bytes[r] - offset;
      prefetch_l2(static_cast<const char*>(a.ptr[r]) + offset, left < kBytes ? left : kBytes);
      break;
    }
    piece -= pieces;
  }
  cuda::wait_for_previous_grid();
}

}  // namespace

void l2_prefetch_cuda(const L2PrefetchArgs& a, int device, void* stream) {
  int64_t pieces = 0;
  for (int r = 0; r < kL2PrefetchRanges; ++r) {
    if (a.bytes[r] < 0 || a.bytes[r] % 16 != 0 || (a.bytes[r] > 0 && reinterpret_cast<uintptr_t>(a.ptr[r]) % 16 != 0))
      throw std::invalid_argument("higgs_rt l2_prefetch: each range must be 16-byte aligned and a multiple of 16 bytes");
    pieces += (a.bytes[r] + kBytes - 1) / kBytes;
  }
  if (pieces == 0) return;
  cuda::DeviceGuard guard(device);
  cuda::launch(l2_prefetch_kernel, dim3(unsigned((pieces + kThreads - 1) / kThreads)), dim3(kThreads), 0,
               cuda::as_stream(stream), device, cuda::kPdlGemv, "l2_prefetch_kernel", a);
}

}  // namespace higgs_rt
