// Stand-ins for the CUDA entry points when libhiggs_rt_ops is built without a CUDA compiler.
#include <stdexcept>

#include "../ops.h"

namespace higgs_rt {
namespace {

[[noreturn]] void unavailable() {
  throw std::runtime_error("higgs_rt's kernels were built without CUDA (no nvcc at build time); rebuild with nvcc on PATH");
}

}  // namespace

void delay_revert_cuda(const DelayRevertArgs&, int, void*) { unavailable(); }
void rvq_lookup_cuda(const RvqLookupArgs&, int, void*) { unavailable(); }
void snake_cuda(const SnakeArgs&, int, void*) { unavailable(); }
void codec_window_cuda(const CodecWindowArgs&, int, void*) { unavailable(); }
void tap_sum_cuda(const TapSumArgs&, int, void*) { unavailable(); }
void codec_conv_cuda(const CodecConvArgs&, int, void*) { unavailable(); }
void dualffn_route_cuda(const DualFFNRouteArgs&, int, void*) { unavailable(); }
void dualffn_unroute_cuda(const DualFFNUnrouteArgs&, int, void*) { unavailable(); }
void rms_norm_cuda(const RmsNormArgs&, int, void*) { unavailable(); }
void rope_qkv_cuda(const RopeQkvArgs&, int, void*) { unavailable(); }
void silu_mul_cuda(const SiluMulArgs&, int, void*) { unavailable(); }
void gemv_cuda(const GemvArgs&, int, void*) { unavailable(); }
int64_t gemv_partials_bytes(const GemvArgs&, int) { return 0; }
void decode_attention_cuda(const DecodeAttentionArgs&, int, void*) { unavailable(); }
void sample_frame_cuda(const SampleFrameArgs&, int, void*) { unavailable(); }

}  // namespace higgs_rt
