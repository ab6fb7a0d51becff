// 16-byte vectors of the kernels' element types: N = 16 / sizeof(T) elements per uint4, unpacked to fp32 and
// packed back with the dtype's round-to-nearest.
#pragma once

#include <cstdint>

#include "dtypes.cuh"

namespace higgs_rt::cuda {

template <typename T>
constexpr int kVecElems = 16 / sizeof(T);

template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < kVecElems<T>; ++i) f[i] = to_f32(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < kVecElems<T>; ++i) e[i] = from_f32<T>(f[i]);
  return v;
}

// f rounded to T and back: the value torch keeps after an op in T.
template <typename T>
__device__ __forceinline__ float rounded(float f) {
  return to_f32(from_f32<T>(f));
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace higgs_rt::cuda
