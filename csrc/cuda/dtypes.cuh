// The element types the CUDA kernels take (float, bf16, fp16): fp32 conversions and the runtime dtype switch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../ops.h"

namespace higgs_rt::cuda {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

template <typename T>
struct Type {
  using type = T;
};

// launch(Type<T>{}) with T the CUDA element type of `dtype`.
template <typename Launch>
void dispatch(TableDType dtype, Launch&& launch) {
  switch (dtype) {
    case TableDType::kFloat32: return launch(Type<float>{});
    case TableDType::kBFloat16: return launch(Type<__nv_bfloat16>{});
    case TableDType::kFloat16: return launch(Type<__half>{});
  }
}

}  // namespace higgs_rt::cuda
