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

inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

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

// Launch with PDL: compute capability >= 9.0, unless HIGGS_RT_PDL=0; cached per device.
inline bool has_pdl(int device) {
  static int cached[64] = {};  // 0 unknown, 1 no, 2 yes
  static const bool enabled = [] {
    const char* v = std::getenv("HIGGS_RT_PDL");
    return v == nullptr || std::string(v) != "0";
  }();
  if (!enabled || device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    cached[device] = major >= 9 ? 2 : 1;
  }
  return cached[device] == 2;
}

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where the GPU has it
// (the attribute is kept when the launch is captured into a CUDA graph).
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
            const char* name, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = has_pdl(device) ? 1 : 0;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name);
}

}  // namespace higgs_rt::cuda
