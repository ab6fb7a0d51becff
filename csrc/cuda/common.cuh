// Shared CUDA launch plumbing: device scope guard, launch-error check, grid sizing, and programmatic dependent
// launch (PDL, Hopper): a kernel launched with `launch()` may start while the previous kernel on the stream
// drains; it must call `wait_for_previous_grid()` before reading anything an earlier kernel wrote (weights may
// be fetched before), and calls `allow_next_grid()` so the next kernel can start early in its turn.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace higgs_rt::cuda {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("higgs_rt ") + what + ": " + cudaGetErrorString(err));
}

// Kernels launch on the current device: make `device` current for the scope, restore after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// Blocks for `work` items at `per_block` each, capped; kernels grid-stride over the rest.
inline unsigned grid_for(int64_t work, int64_t per_block, int64_t cap = 65535) {
  return unsigned(std::clamp<int64_t>((work + per_block - 1) / per_block, 1, cap));
}

// Streaming multiprocessors of `device` (cached; 132, an H100/H200's, for a device index out of range).
inline int sm_count(int device) {
  static int sms[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (sms[device] == 0) check(cudaDeviceGetAttribute(&sms[device], cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  return sms[device];
}

inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

// An element-wise kernel over `work` grid-stride items: 256 threads a block, at most 16 blocks per SM; checked.
template <typename Args>
void launch_grid_stride(void (*kernel)(Args), int64_t work, const Args& a, int device, void* stream, const char* name) {
  constexpr int kThreads = 256;
  kernel<<<grid_for(work, kThreads, int64_t(sm_count(device)) * 16), kThreads, 0, as_stream(stream)>>>(a);
  check_launch(name);
}

// Loads of data an earlier kernel wrote: at L2 (.cg), never from a line an SM's L1 kept from before.
__device__ __forceinline__ uint4 load_cg(const void* p) {
  uint4 r;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// ---- shared memory beyond 48 KB a block -----------------------------------------------------------------

inline int max_smem_optin(int device) {
  int v = 0;
  check(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "cudaDeviceGetAttribute");
  return v;
}

// Whether a block of `bytes` dynamic shared memory may run on `device` (its opt-in limit, cached per device).
inline bool fits_smem(int device, size_t bytes) {
  static int limit[64] = {};
  if (device < 0 || device >= 64) return false;
  if (limit[device] == 0) limit[device] = max_smem_optin(device);
  return size_t(limit[device]) >= bytes;
}

// Whether two blocks of `bytes` dynamic shared memory fit one SM of `device` (each block also takes 1 KB of the
// SM's shared memory for the runtime), cached per device.
inline bool fits_smem_twice(int device, size_t bytes) {
  static int per_sm[64] = {};
  if (!fits_smem(device, bytes)) return false;
  if (per_sm[device] == 0)
    check(cudaDeviceGetAttribute(&per_sm[device], cudaDevAttrMaxSharedMemoryPerMultiprocessor, device),
          "cudaDeviceGetAttribute");
  return size_t(per_sm[device]) >= 2 * (bytes + 1024);
}

// Above 48 KB of dynamic shared memory a kernel must ask: on every device that has `bytes` (a kernel too large for
// a device is never launched there). Returns true, for a function-static "once per kernel".
template <typename Kernel>
bool allow_smem(Kernel* kernel, size_t bytes) {
  int n = 0;
  check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  for (int d = 0; d < n; ++d) {
    DeviceGuard guard(d);
    if (!fits_smem(d, bytes)) continue;
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
          "cudaFuncSetAttribute");
  }
  return true;
}

// ---- asynchronous copies to shared memory ---------------------------------------------------------------

// 16 bytes global -> shared with cp.async (cached at L2 only): the bytes in flight are not bounded by registers.
// Before sm_80 a plain copy stands in (the kernels are built for sm_80 and up).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
#else
  *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
#endif
}

// Asks L2 for the 128-byte line holding `p`: a hint with no result, nothing waits for it (sm_80 and up).
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}

// sm_90: the copy engine (TMA) fetches `bytes` at `p` into L2 (16-byte aligned, a multiple of 16) while the thread
// goes on; a no-op before sm_90.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>  // wait until at most N of this thread's commit groups are in flight
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// ---- thread-block clusters (sm_90) ------------------------------------------------------------------------

// Every thread of every block of the cluster arrives, then waits: the shared-memory writes before it are seen by
// the peers' reads after it. Called by all threads of a block, uniformly (a no-op before sm_90).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The generic address of `p` (this block's shared memory) in the cluster's block `rank` (distributed shared
// memory, sm_90; `p` itself before).
template <typename T>
__device__ __forceinline__ const T* peer_shared(const T* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t peer;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"(p), "r"(rank));
  return reinterpret_cast<const T*>(peer);
#else
  (void)rank;
  return p;
#endif
}

// ---- programmatic dependent launch ----------------------------------------------------------------------

__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// An integer from the environment (std::atoi of it), or `fallback` where it is unset: the kernels' measurement
// switches, each read once into a function-static.
inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::atoi(v);
}

// Kernel families for HIGGS_RT_PDL, a bit mask of the ones launched with PDL (default all; 0 = none).
enum PdlFamily : int { kPdlGemv = 1, kPdlAttention = 2, kPdlSampler = 4 };

// Compute capability >= 9.0 (PDL, thread-block clusters); cached per device, false for an index out of range.
inline bool sm90(int device) {
  static int cached[64] = {};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    cached[device] = major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
}

// Launch with PDL: sm90 and the family enabled by HIGGS_RT_PDL.
inline bool has_pdl(int device, int family) {
  static const int enabled = env_int("HIGGS_RT_PDL", 7);
  return (enabled & family) && sm90(device);
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where the GPU has it
// (the attribute is kept when the launch is captured into a CUDA graph); `cluster` (blocks, dividing the grid;
// the caller checks sm90) groups the blocks into thread-block clusters where it is not 1 x 1 x 1.
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, size_t smem,
                      cudaStream_t stream, int device, int family, const char* name, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  int n = 0;
  if (has_pdl(device, family)) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = cluster.x;
    attribute[n].val.clusterDim.y = cluster.y;
    attribute[n++].val.clusterDim.z = cluster.z;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name);
}

// Clusters of more than 8 blocks (sm_90's non-portable sizes, up to 16 on an H100 / H200) for `kernel`, on every
// device that has clusters. Returns true, for a function-static "once per kernel".
template <typename Kernel>
bool allow_wide_clusters(Kernel* kernel) {
  int n = 0;
  check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  for (int d = 0; d < n; ++d) {
    if (!sm90(d)) continue;
    DeviceGuard guard(d);
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "cudaFuncSetAttribute");
  }
  return true;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
            int family, const char* name, Args&&... args) {
  launch_clustered(kernel, grid, block, dim3(1, 1, 1), smem, stream, device, family, name,
                   std::forward<Args>(args)...);
}

}  // namespace higgs_rt::cuda
