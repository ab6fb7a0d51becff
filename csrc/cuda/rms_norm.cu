// RMSNorm of the prompt forward's rows, with the residual add before it: one kernel for what torch runs as nine
// (add; float; pow; mean; add eps; rsqrt; mul; cast; mul by the weight) and, in a mixed text/audio prompt, for both
// norms and the where that picks one per row. The prefill of a 46-token prompt spent 1.3 of its 4.4 ms of GPU time
// in these small kernels (bench_frame_latency's prefill_profile, 2289d6e).
// One block per row: each thread adds and squares its columns (the sum written back rounded, as torch's add
// rounds it), a block reduction gives the fp32 sum of squares, and a second pass over the same columns (the
// thread's own writes, from L1) scales and applies the row's weight, each product rounded to the dtype as torch
// rounds it. Only the order of the sum of squares differs from torch's reduction.
#include "../ops.h"
#include "common.cuh"
#include "dtypes.cuh"

namespace higgs_rt {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(RmsNormArgs a) {
  using cuda::from_f32;
  using cuda::to_f32;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row * a.H;
  const T* res = a.residual != nullptr ? static_cast<const T*>(a.residual) + row * a.H : nullptr;
  T* sum = res != nullptr ? static_cast<T*>(a.sum) + row * a.H : nullptr;
  T* out = static_cast<T*>(a.out) + row * a.H;
  const bool audio = a.audio_rows != nullptr && a.audio_rows[row];
  const T* w = static_cast<const T*>(audio ? a.audio_weight : a.weight);

  float squares = 0.f;
  for (int64_t i = threadIdx.x; i < a.H; i += kThreads) {
    float v = to_f32(x[i]);
    if (res != nullptr) {
      const T s = from_f32<T>(__fadd_rn(v, to_f32(res[i])));
      sum[i] = s;
      v = to_f32(s);
    }
    squares = __fadd_rn(squares, __fmul_rn(v, v));
  }
  __shared__ float partial[kThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < kThreads / 32; ++j) total += partial[j];
  const float scale = rsqrtf(__fadd_rn(__fdiv_rn(total, float(a.H)), a.eps));

  const T* src = res != nullptr ? sum : x;
  for (int64_t i = threadIdx.x; i < a.H; i += kThreads) {
    const T normed = from_f32<T>(__fmul_rn(to_f32(src[i]), scale));
    out[i] = from_f32<T>(__fmul_rn(to_f32(w[i]), to_f32(normed)));
  }
}

}  // namespace

void rms_norm_cuda(const RmsNormArgs& a, int device, void* stream) {
  if (a.R == 0 || a.H == 0) return;
  cuda::DeviceGuard guard(device);
  cuda::dispatch(a.dtype, [&](auto type) {
    using T = typename decltype(type)::type;
    rms_norm_kernel<T><<<unsigned(a.R), kThreads, 0, cuda::as_stream(stream)>>>(a);
  });
  cuda::check_launch("rms_norm_kernel");
}

}  // namespace higgs_rt
