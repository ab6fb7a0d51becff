// Shared CUDA launch plumbing: device scope guard, launch-error check, grid sizing.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
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

}  // namespace higgs_rt::cuda
