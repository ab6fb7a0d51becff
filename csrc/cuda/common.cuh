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

// Kernel families for HIGGS_RT_PDL, a bit mask of the ones launched with PDL (default all; 0 = none).
enum PdlFamily : int { kPdlGemv = 1, kPdlAttention = 2, kPdlSampler = 4 };

// Compute capability's major number, cached per device (0 for a device index out of range).
inline int cc_major(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (cached[device] == 0) check(cudaDeviceGetAttribute(&cached[device], cudaDevAttrComputeCapabilityMajor, device),
                                 "cudaDeviceGetAttribute");
  return cached[device];
}

// Launch with PDL: compute capability >= 9.0 and the family enabled by HIGGS_RT_PDL.
inline bool has_pdl(int device, int family) {
  static const int enabled = [] {
    const char* v = std::getenv("HIGGS_RT_PDL");
    return v == nullptr ? 7 : std::atoi(v);
  }();
  return (enabled & family) && cc_major(device) >= 9;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where the GPU has it
// (the attribute is kept when the launch is captured into a CUDA graph), in clusters of `cluster` blocks along x
// when it is above 1 (compute capability >= 9.0: the caller checks).
template <typename... Params, typename... Args>
void launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
                      int family, unsigned cluster, const char* name, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned n = 0;
  if (has_pdl(device, family)) {
    attribute[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attribute[n].id = cudaLaunchAttributeClusterDimension;
    attribute[n].val.clusterDim.x = cluster;
    attribute[n].val.clusterDim.y = 1;
    attribute[n++].val.clusterDim.z = 1;
  }
  config.attrs = attribute;
  config.numAttrs = n;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name);
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
            int family, const char* name, Args&&... args) {
  launch_clustered(kernel, grid, block, smem, stream, device, family, 1, name, std::forward<Args>(args)...);
}

// ---- thread block clusters (sm_90): a block reads another's shared memory ----------------------------------

__device__ __forceinline__ unsigned cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}

// Every thread of every block in the cluster: what each wrote to shared memory before is seen by all after.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// 16 bytes at the same shared-memory offset as `p`, in the cluster's block `rank`.
__device__ __forceinline__ uint4 ld_shared_cluster(const void* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const auto local = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(remote) : "memory");
  return v;
#else
  (void)rank;
  return *static_cast<const uint4*>(p);
#endif
}

}  // namespace higgs_rt::cuda
