// higgs-rt's kernels as torch operators (namespace higgs_rt), registered through torch's stable C ABI: the
// schemas, the checks every caller gets, and the dispatch of each op to its CPU or CUDA kernel (csrc/ops.h).
// Compiled graphs and AOTInductor packages call these natively, with no Python in between; Python adds only
// the fake (meta) functions and the pure-torch references (the package higgs_rt/ops/).
//
// The one CUDA entry point of torch we need, the current stream, lives in libtorch_cuda, which a CPU build of
// torch does not have: it is looked up when first needed (dlopen RTLD_NOLOAD + dlsym), so this library links
// against libtorch_cpu alone and loads beside any build of torch.
#include <dlfcn.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
using namespace higgs_rt;

namespace {

// ---- plumbing -------------------------------------------------------------------------------------------

template <typename... Args>
std::string message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

// An argument check. std::invalid_argument reaches Python as ValueError, as the wrappers raise (STD_TORCH_CHECK's
// std::runtime_error would be a RuntimeError); the message is built only on failure.
#define HIGGS_CHECK(cond, ...)                                                      \
  do {                                                                              \
    if (!(cond)) throw std::invalid_argument(message("higgs_rt::", __VA_ARGS__));   \
  } while (0)

std::string shape(const Tensor& t, bool strides = false) {  // or its strides
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(strides ? t.stride(i) : t.size(i));
  return s + "]";
}

TableDType float_dtype(const Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return TableDType::kFloat32;
    case ScalarType::BFloat16: return TableDType::kBFloat16;
    case ScalarType::Half: return TableDType::kFloat16;
    default:
      HIGGS_CHECK(false, op, ": ", name, " must be float32, bfloat16 or float16, got ", t.scalar_type(), " ",
                  shape(t));
  }
  return TableDType::kFloat32;
}

void require(const Tensor& t, const char* op, const char* name, int64_t dim, ScalarType dtype) {
  HIGGS_CHECK(t.dim() == dim, op, ": ", name, " must have ", dim, " dims, got ", shape(t));
  HIGGS_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type(), " ", shape(t));
  HIGGS_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got ", shape(t), " with strides ",
              shape(t, true));
}

void same_device(const Tensor& a, const Tensor& b, const char* op, const char* name) {
  HIGGS_CHECK(a.is_cuda() == b.is_cuda() && a.get_device() == b.get_device(), op, ": ", name,
              " must be on the same device as the first argument");
}

using GetStream = int32_t (*)(int32_t, void**);

// torch's current CUDA stream of `device` (aoti_torch_get_current_cuda_stream, from libtorch_cuda).
void* cuda_stream(int device) {
  static GetStream get = [] {
    void* lib = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
    void* fn = dlsym(lib != nullptr ? lib : RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    return reinterpret_cast<GetStream>(fn);
  }();
  STD_TORCH_CHECK(get != nullptr, "higgs_rt: torch's CUDA library (libtorch_cuda) is not loaded");
  void* stream = nullptr;
  STD_TORCH_CHECK(get(device, &stream) == 0, "higgs_rt: could not get the current CUDA stream");
  return stream;
}

template <typename Args>
void run(void (*cpu)(const Args&), void (*gpu)(const Args&, int, void*), const Args& a, const Tensor& like) {
  if (like.is_cuda()) {
    gpu(a, like.get_device(), cuda_stream(like.get_device()));
  } else {
    HIGGS_CHECK(cpu != nullptr, "this op has a CUDA kernel only: on the CPU use its torch reference (higgs_rt.ops)");
    cpu(a);
  }
}

template <typename Args>
void run_cuda(void (*gpu)(const Args&, int, void*), const Args& a, const Tensor& like) {
  run<Args>(nullptr, gpu, a, like);
}

Tensor empty(const Tensor& like, std::vector<int64_t> sizes, std::optional<ScalarType> dtype = std::nullopt) {
  return torch::stable::new_empty(like, torch::headeronly::IntHeaderOnlyArrayRef(sizes.data(), sizes.size()), dtype);
}

// ---- codec ----------------------------------------------------------------------------------------------

Tensor snake(Tensor x, Tensor alpha, std::optional<Tensor> mask) {
  HIGGS_CHECK(x.dim() == 3 && x.scalar_type() == ScalarType::Float && x.stride(2) == 1,
              "snake: x must be float32 [B, T, C] with contiguous channels, got ", shape(x));
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
  require(alpha, "snake", "alpha", 1, ScalarType::Float);
  HIGGS_CHECK(alpha.size(0) == C, "snake: alpha must be [", C, "], got ", shape(alpha));
  same_device(x, alpha, "snake", "alpha");
  int64_t mask_sb = 0;
  if (mask.has_value()) {
    const Tensor& m = *mask;
    HIGGS_CHECK(m.dim() == 2 && m.size(0) == B && m.size(1) == T && m.scalar_type() == ScalarType::Float &&
                    (T <= 1 || m.stride(1) == 1),
                "snake: mask must be float32 [", B, ", ", T, "] with contiguous rows, got ", shape(m));
    same_device(x, m, "snake", "mask");
    mask_sb = m.stride(0);
  }
  Tensor out = empty(x, {B, T, C});
  run(snake_cpu, snake_cuda,
      SnakeArgs{static_cast<const float*>(x.data_ptr()), static_cast<const float*>(alpha.data_ptr()),
                mask.has_value() ? static_cast<const float*>(mask->data_ptr()) : nullptr,
                static_cast<float*>(out.data_ptr()), B, T, C, x.stride(0), x.stride(1), mask_sb},
      x);
  return out;
}

const float* optional_f32(const std::optional<Tensor>& t, const Tensor& like, const char* op, const char* name,
                          int64_t size) {
  if (!t.has_value()) return nullptr;
  require(*t, op, name, 1, ScalarType::Float);
  same_device(like, *t, op, name);
  HIGGS_CHECK(t->size(0) == size, op, ": ", name, " must be [", size, "], got ", shape(*t));
  return static_cast<const float*>(t->data_ptr());
}

std::tuple<Tensor, Tensor> codec_window(Tensor x, std::optional<Tensor> addend, Tensor state, Tensor first,
                                        Tensor length, int64_t rate, int64_t lag, std::optional<Tensor> alpha,
                                        std::optional<Tensor> alpha_full) {
  const char* op = "codec_window";
  HIGGS_CHECK(x.dim() == 3 && x.scalar_type() == ScalarType::Float && x.stride(2) == 1,
              op, ": x must be float32 [B, W, C] with contiguous channels, got ", shape(x));
  const int64_t B = x.size(0), W = x.size(1), C = x.size(2);
  require(state, op, "state", 3, ScalarType::Float);
  HIGGS_CHECK(state.size(0) >= B && state.size(2) == C, op, ": state must be [>= ", B, ", keep, ", C, "], got ",
              shape(state));
  require(first, op, "first", 1, ScalarType::Long);
  require(length, op, "length", 1, ScalarType::Long);
  HIGGS_CHECK(first.size(0) == B && length.size(0) == B, op, ": first and length must be [", B, "]");
  HIGGS_CHECK(rate >= 1 && lag >= 0, op, ": rate must be >= 1 and lag >= 0, got ", rate, " and ", lag);
  for (const Tensor* t : {&state, &first, &length}) same_device(x, *t, op, "every tensor");
  int64_t a_sb = 0, a_st = 0;
  if (addend.has_value()) {
    HIGGS_CHECK(addend->scalar_type() == ScalarType::Float && shape(*addend) == shape(x) && addend->stride(2) == 1,
                op, ": addend must be float32 shaped as x ", shape(x), " with contiguous channels, got ",
                shape(*addend));
    same_device(x, *addend, op, "addend");
    a_sb = addend->stride(0), a_st = addend->stride(1);
  }
  const int64_t keep = state.size(1);
  Tensor full = empty(x, {B, keep + W, C});
  Tensor snaked = empty(x, alpha_full.has_value() ? std::vector<int64_t>{B, keep + W, C} : std::vector<int64_t>{0});
  run_cuda(codec_window_cuda,
           CodecWindowArgs{static_cast<const float*>(x.data_ptr()),
                           addend.has_value() ? static_cast<const float*>(addend->data_ptr()) : nullptr,
                           static_cast<const float*>(state.data_ptr()), static_cast<const int64_t*>(first.data_ptr()),
                           static_cast<const int64_t*>(length.data_ptr()), optional_f32(alpha, x, op, "alpha", C),
                           optional_f32(alpha_full, x, op, "alpha_full", C), static_cast<float*>(full.data_ptr()),
                           alpha_full.has_value() ? static_cast<float*>(snaked.data_ptr()) : nullptr, B, W, C, keep,
                           x.stride(0), x.stride(1), a_sb, a_st, rate, lag},
           x);
  return {full, snaked};
}

Tensor tap_sum(Tensor products, std::optional<Tensor> bias, std::optional<Tensor> alpha) {
  require(products, "tap_sum", "products", 3, ScalarType::Float);
  const int64_t K = products.size(0), W = products.size(1), C = products.size(2);
  HIGGS_CHECK(K >= 1, "tap_sum: products must hold at least one tap, got ", shape(products));
  Tensor out = empty(products, {1, W, C});
  run_cuda(tap_sum_cuda,
           TapSumArgs{static_cast<const float*>(products.data_ptr()),
                      optional_f32(bias, products, "tap_sum", "bias", C),
                      optional_f32(alpha, products, "tap_sum", "alpha", C), static_cast<float*>(out.data_ptr()), K,
                      W * C, C},
           products);
  return out;
}

Tensor codec_conv(Tensor x, Tensor weight, std::optional<Tensor> bias, std::optional<Tensor> alpha, int64_t taps,
                  int64_t dilation) {
  const char* op = "codec_conv";
  require(x, op, "x", 3, ScalarType::Float);
  require(weight, op, "weight", 2, ScalarType::Float);
  same_device(x, weight, op, "weight");
  const int64_t B = x.size(0), L = x.size(1), C = x.size(2), N = weight.size(1);
  HIGGS_CHECK(taps >= 1 && dilation >= 1, op, ": taps and dilation must be >= 1, got ", taps, " and ", dilation);
  HIGGS_CHECK(C % 32 == 0 && N % 32 == 0, op, ": channels in and out must be multiples of 32, got x ", shape(x),
              " and weight ", shape(weight));
  HIGGS_CHECK(weight.size(0) == taps * C, op, ": weight must be [taps * C, N] = [", taps * C, ", N], got ",
              shape(weight));
  HIGGS_CHECK(L > (taps - 1) * dilation, op, ": x ", shape(x), " is shorter than the kernel's reach ",
              (taps - 1) * dilation + 1);
  HIGGS_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
              op, ": x and weight must be 16-byte aligned");
  const int64_t W = L - (taps - 1) * dilation;
  // long sums split into blocks' partial sums, added by tap_sum: chosen from K alone
  const int64_t steps = taps * C / kCodecConvStep, splits = (steps + kCodecConvMaxSteps - 1) / kCodecConvMaxSteps;
  const int64_t split_steps = (steps + splits - 1) / splits;
  Tensor out = empty(x, {B, W, N});
  Tensor partial = empty(x, {splits > 1 ? splits : 0, B * W, N});
  const float* bias_p = optional_f32(bias, x, op, "bias", N);
  const float* alpha_p = optional_f32(alpha, x, op, "alpha", N);
  run_cuda(codec_conv_cuda,
           CodecConvArgs{static_cast<const float*>(x.data_ptr()), static_cast<const float*>(weight.data_ptr()),
                         bias_p, alpha_p, static_cast<float*>(out.data_ptr()),
                         splits > 1 ? static_cast<float*>(partial.data_ptr()) : nullptr, B, L, C, N, W, taps,
                         dilation, split_steps},
           x);
  if (splits > 1) {
    run_cuda(tap_sum_cuda,
             TapSumArgs{static_cast<const float*>(partial.data_ptr()), bias_p, alpha_p,
                        static_cast<float*>(out.data_ptr()), splits, B * W * N, N},
             x);
  }
  return out;
}

// ---- codes and routing ----------------------------------------------------------------------------------

Tensor delay_revert(Tensor codes, int64_t num_codes, int64_t offset, int64_t length) {
  require(codes, "delay_revert", "codes", 3, ScalarType::Long);
  const int64_t B = codes.size(0), S = codes.size(1), Q = codes.size(2);
  HIGGS_CHECK(num_codes >= 1 && Q >= 1 && offset >= 0 && length >= 0, "delay_revert: bad sizes");
  HIGGS_CHECK(length == 0 || offset + length + Q - 1 <= S, "delay_revert: window exceeds the input frames");
  Tensor out = empty(codes, {B, length, Q});
  run(delay_revert_cpu, delay_revert_cuda,
      DelayRevertArgs{static_cast<const int64_t*>(codes.data_ptr()), static_cast<int64_t*>(out.data_ptr()), B, S, Q,
                      length, offset, num_codes},
      codes);
  return out;
}

Tensor rvq_lookup(Tensor codes, Tensor table) {
  require(codes, "rvq_lookup", "codes", 3, ScalarType::Long);
  HIGGS_CHECK(table.dim() == 3 && table.is_contiguous(), "rvq_lookup: table must be a contiguous [Q, K, D]");
  same_device(codes, table, "rvq_lookup", "table");
  const int64_t Q = codes.size(2), K = table.size(1), D = table.size(2);
  HIGGS_CHECK(table.size(0) == Q && K >= 1, "rvq_lookup: table must be [Q, K >= 1, D], got ", shape(table));
  Tensor out = empty(table, {codes.size(0), codes.size(1), D});
  run(rvq_lookup_cpu, rvq_lookup_cuda,
      RvqLookupArgs{static_cast<const int64_t*>(codes.data_ptr()), table.data_ptr(), out.data_ptr(),
                    codes.size(0) * codes.size(1), Q, K, D, float_dtype(table, "rvq_lookup", "table")},
      codes);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> dualffn_route(Tensor hidden, Tensor audio_mask) {
  HIGGS_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "dualffn_route: hidden must be a contiguous [N, H]");
  require(audio_mask, "dualffn_route", "audio_mask", 1, ScalarType::Bool);
  same_device(hidden, audio_mask, "dualffn_route", "audio_mask");
  const int64_t N = hidden.size(0);
  HIGGS_CHECK(audio_mask.size(0) == N, "dualffn_route: audio_mask must have ", N, " rows");
  Tensor routed = torch::stable::empty_like(hidden);
  Tensor perm = empty(hidden, {N}, ScalarType::Long);
  Tensor n_audio = empty(hidden, {}, ScalarType::Long);
  run(dualffn_route_cpu, dualffn_route_cuda,
      DualFFNRouteArgs{hidden.data_ptr(), static_cast<const uint8_t*>(audio_mask.data_ptr()), routed.data_ptr(),
                       static_cast<int64_t*>(perm.data_ptr()), static_cast<int64_t*>(n_audio.data_ptr()), N,
                       hidden.size(1) * int64_t(hidden.element_size())},
      hidden);
  return {routed, perm, n_audio};
}

Tensor dualffn_unroute(Tensor y, Tensor perm) {
  HIGGS_CHECK(y.dim() == 2 && y.is_contiguous(), "dualffn_unroute: y must be a contiguous [N, H]");
  require(perm, "dualffn_unroute", "perm", 1, ScalarType::Long);
  same_device(y, perm, "dualffn_unroute", "perm");
  HIGGS_CHECK(perm.size(0) == y.size(0), "dualffn_unroute: perm must have ", y.size(0), " rows");
  Tensor out = torch::stable::empty_like(y);
  run(dualffn_unroute_cpu, dualffn_unroute_cuda,
      DualFFNUnrouteArgs{y.data_ptr(), static_cast<const int64_t*>(perm.data_ptr()), out.data_ptr(), y.size(0),
                         y.size(1) * int64_t(y.element_size())},
      y);
  return out;
}

// ---- the prompt forward's row-wise steps (CUDA) ---------------------------------------------------------

TableDType half_or_float(const Tensor& x, const char* op) {
  HIGGS_CHECK(x.is_cuda(), op, ": CUDA only (on the CPU use its torch reference, higgs_rt.ops)");
  return float_dtype(x, op, "x");
}

RmsNormArgs rms_norm_args(const char* op, const Tensor& x, const Tensor& weight, const std::optional<Tensor>& audio_weight,
                          const std::optional<Tensor>& audio_rows, double eps) {
  const TableDType dtype = half_or_float(x, op);
  require(x, op, "x", 2, x.scalar_type());
  const int64_t R = x.size(0), H = x.size(1);
  require(weight, op, "weight", 1, x.scalar_type());
  same_device(x, weight, op, "weight");
  HIGGS_CHECK(weight.size(0) == H, op, ": weight must have ", H, " entries, got ", shape(weight));
  HIGGS_CHECK(audio_weight.has_value() == audio_rows.has_value(), op, ": audio_weight and audio_rows come together");
  RmsNormArgs a{x.data_ptr(), nullptr, nullptr, nullptr, weight.data_ptr(), nullptr, nullptr, R, H, float(eps), dtype};
  if (audio_rows.has_value()) {
    require(*audio_weight, op, "audio_weight", 1, x.scalar_type());
    same_device(x, *audio_weight, op, "audio_weight");
    HIGGS_CHECK(audio_weight->size(0) == H, op, ": audio_weight must have ", H, " entries");
    require(*audio_rows, op, "audio_rows", 1, ScalarType::Bool);
    same_device(x, *audio_rows, op, "audio_rows");
    HIGGS_CHECK(audio_rows->size(0) == R, op, ": audio_rows must have ", R, " entries, got ", shape(*audio_rows));
    a.audio_weight = audio_weight->data_ptr();
    a.audio_rows = static_cast<const uint8_t*>(audio_rows->data_ptr());
  }
  return a;
}

Tensor rms_norm(Tensor x, Tensor weight, std::optional<Tensor> audio_weight, std::optional<Tensor> audio_rows,
                double eps) {
  RmsNormArgs a = rms_norm_args("rms_norm", x, weight, audio_weight, audio_rows, eps);
  Tensor out = torch::stable::empty_like(x);
  a.out = out.data_ptr();
  run_cuda(rms_norm_cuda, a, x);
  return out;
}

std::tuple<Tensor, Tensor> add_rms_norm(Tensor x, Tensor residual, Tensor weight, std::optional<Tensor> audio_weight,
                                        std::optional<Tensor> audio_rows, double eps) {
  RmsNormArgs a = rms_norm_args("add_rms_norm", x, weight, audio_weight, audio_rows, eps);
  require(residual, "add_rms_norm", "residual", 2, x.scalar_type());
  same_device(x, residual, "add_rms_norm", "residual");
  HIGGS_CHECK(residual.size(0) == a.R && residual.size(1) == a.H, "add_rms_norm: residual must be ", shape(x),
              ", got ", shape(residual));
  Tensor sum = torch::stable::empty_like(x), out = torch::stable::empty_like(x);
  a.residual = residual.data_ptr();
  a.sum = sum.data_ptr();
  a.out = out.data_ptr();
  run_cuda(rms_norm_cuda, a, x);
  return {sum, out};
}

std::tuple<Tensor, Tensor, Tensor> rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int64_t num_heads, int64_t num_kv_heads) {
  const TableDType dtype = half_or_float(qkv, "rope_qkv");
  require(qkv, "rope_qkv", "qkv", 3, qkv.scalar_type());
  require(cos, "rope_qkv", "cos", 3, qkv.scalar_type());
  require(sin, "rope_qkv", "sin", 3, qkv.scalar_type());
  same_device(qkv, cos, "rope_qkv", "cos");
  same_device(qkv, sin, "rope_qkv", "sin");
  const int64_t B = qkv.size(0), T = qkv.size(1), D = cos.size(2);
  HIGGS_CHECK(num_heads >= 1 && num_kv_heads >= 1 && D >= 2 && D % 2 == 0 &&
                  qkv.size(2) == (num_heads + 2 * num_kv_heads) * D,
              "rope_qkv: qkv ", shape(qkv), " is not ", num_heads, " + 2 x ", num_kv_heads, " heads of cos's ", D);
  HIGGS_CHECK((cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == T, "rope_qkv: cos must be [1 or ", B, ", ", T,
              ", ", D, "], got ", shape(cos));
  for (int64_t i = 0; i < 3; ++i)
    HIGGS_CHECK(sin.size(i) == cos.size(i), "rope_qkv: sin must be shaped as cos ", shape(cos), ", got ", shape(sin));
  Tensor q = empty(qkv, {B, num_heads, T, D}), k = empty(qkv, {B, num_kv_heads, T, D}),
         v = empty(qkv, {B, num_kv_heads, T, D});
  run_cuda(rope_qkv_cuda,
           RopeQkvArgs{qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), B, T,
                       num_heads, num_kv_heads, D, cos.size(0) == 1 ? 0 : T * D, dtype},
           qkv);
  return {q, k, v};
}

Tensor silu_mul(Tensor gate_up) {
  const TableDType dtype = half_or_float(gate_up, "silu_mul");
  require(gate_up, "silu_mul", "gate_up", 2, gate_up.scalar_type());
  HIGGS_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must stack gate and up (an even width), got ",
              shape(gate_up));
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  Tensor out = empty(gate_up, {R, I});
  run_cuda(silu_mul_cuda, SiluMulArgs{gate_up.data_ptr(), out.data_ptr(), R, I, dtype}, gate_up);
  return out;
}

// ---- the decode GEMV family (CUDA) ----------------------------------------------------------------------

GemvArgs gemv_args(const char* op, const Tensor& x, const Tensor& w, GemvEpilogue epilogue) {
  HIGGS_CHECK(x.is_cuda(), op, ": CUDA only (on the CPU use its torch reference, higgs_rt.ops)");
  HIGGS_CHECK(x.scalar_type() == ScalarType::BFloat16 || x.scalar_type() == ScalarType::Half, op,
              ": x must be bfloat16 or float16");
  require(x, op, "x", 2, x.scalar_type());
  require(w, op, "w", 2, x.scalar_type());
  same_device(x, w, op, "w");
  const int64_t B = x.size(0), K = x.size(1);
  HIGGS_CHECK(B >= 1 && B <= 64, op, ": x must have 1 to 64 rows, got ", shape(x));
  HIGGS_CHECK(w.size(1) == K && K % 8 == 0, op, ": need w [N, K] with K = x's columns and K % 8 == 0, got x ",
              shape(x), " and w ", shape(w));
  GemvArgs a{x.data_ptr(), w.data_ptr(), nullptr, B, w.size(0), K, float_dtype(x, op, "x")};
  a.epilogue = epilogue;
  return a;
}

// The norm epilogues' arguments; returns the pre-pass's workspace (held by the caller until the launch; the
// caching allocator orders its reuse on the stream), empty below kGemvPrenormMinRows rows.
Tensor add_norm(GemvArgs& a, const char* op, const Tensor& x, const Tensor& norm_weight, double eps) {
  require(norm_weight, op, "norm_weight", 1, x.scalar_type());
  same_device(x, norm_weight, op, "norm_weight");
  HIGGS_CHECK(norm_weight.size(0) == a.K, op, ": norm_weight must have ", a.K, " entries");
  a.norm_weight = norm_weight.data_ptr();
  a.eps = float(eps);
  if (a.B < kGemvPrenormMinRows) return empty(x, {0}, ScalarType::Byte);
  Tensor workspace = empty(x, {gemv_prenorm_bytes(a.B, a.K, int64_t(x.element_size()))}, ScalarType::Byte);
  a.prenorm = workspace.data_ptr();
  return workspace;
}

// The `ahead` hint (GemvArgs::ahead): rows [R, K] or runs of rows [P, R, K] of a later kernel's weights, each run
// contiguous (a slice of a weight or of its stacked halves), on x's device.
void add_ahead(GemvArgs& a, const char* op, const Tensor& x, const std::optional<Tensor>& ahead) {
  if (!ahead.has_value()) return;
  const Tensor& t = *ahead;
  same_device(x, t, op, "ahead");
  const int64_t d = t.dim();
  HIGGS_CHECK(d == 2 || d == 3, op, ": ahead must be rows [R, K] or runs of rows [P, R, K], got ", shape(t));
  HIGGS_CHECK(t.stride(d - 1) == 1 && (t.size(d - 2) <= 1 || t.stride(d - 2) == t.size(d - 1)), op,
              ": each run of ahead's rows must be contiguous, got ", shape(t), " with strides ", shape(t, true));
  const int64_t elem = int64_t(t.element_size());
  a.ahead = t.data_ptr();
  a.ahead_parts = d == 3 ? t.size(0) : 1;
  a.ahead_part_bytes = t.size(d - 2) * t.size(d - 1) * elem;
  a.ahead_stride = d == 3 ? t.stride(0) * elem : 0;
  HIGGS_CHECK(a.ahead_parts * a.ahead_part_bytes < (int64_t(1) << 36) && a.ahead_part_bytes < (int64_t(1) << 31), op,
              ": ahead must be under 64 GiB in runs under 2 GiB, got ", shape(t));
  HIGGS_CHECK(reinterpret_cast<uintptr_t>(a.ahead) % 16 == 0 && a.ahead_part_bytes % 16 == 0 &&
                  a.ahead_stride % 16 == 0, op, ": ahead's runs must be 16-byte aligned and a multiple of 16 bytes, "
              "got ", shape(t), " with strides ", shape(t, true));
  if (a.ahead_parts == 0 || a.ahead_part_bytes == 0) a.ahead = nullptr;
}

// gemv_cuda with the tiled kernel's partial-sum workspace where it needs one (gemv_partials_bytes), held until
// the launch as add_norm's is.
void run_gemv(GemvArgs& a, const Tensor& x) {
  const int64_t bytes = gemv_partials_bytes(a, x.get_device());
  std::optional<Tensor> partials;
  if (bytes > 0) {
    partials = empty(x, {bytes}, ScalarType::Byte);
    a.partials = static_cast<float*>(partials->data_ptr());
  }
  run_cuda(gemv_cuda, a, x);
}

Tensor gemv(Tensor x, Tensor w) {
  GemvArgs a = gemv_args("gemv", x, w, GemvEpilogue::kPlain);
  Tensor y = empty(x, {a.B, a.N});
  a.y = y.data_ptr();
  run_gemv(a, x);
  return y;
}

Tensor gemv_residual(Tensor x, Tensor w, Tensor residual, std::optional<Tensor> ahead) {
  GemvArgs a = gemv_args("gemv_residual", x, w, GemvEpilogue::kResidual);
  add_ahead(a, "gemv_residual", x, ahead);
  require(residual, "gemv_residual", "residual", 2, x.scalar_type());
  same_device(x, residual, "gemv_residual", "residual");
  HIGGS_CHECK(residual.size(0) == a.B && residual.size(1) == a.N, "gemv_residual: residual must be [B, N]");
  Tensor y = empty(x, {a.B, a.N});
  a.y = y.data_ptr();
  a.residual = residual.data_ptr();
  run_gemv(a, x);
  return y;
}

Tensor norm_gemv_silu(Tensor x, Tensor norm_weight, double eps, Tensor w) {
  GemvArgs a = gemv_args("norm_gemv_silu", x, w, GemvEpilogue::kNormSilu);
  const Tensor workspace = add_norm(a, "norm_gemv_silu", x, norm_weight, eps);
  HIGGS_CHECK(a.N % 16 == 0, "norm_gemv_silu: w must stack gate and up, N % 16 == 0, got ", shape(w));
  Tensor y = empty(x, {a.B, a.N / 2});
  a.y = y.data_ptr();
  run_gemv(a, x);
  return y;
}

Tensor norm_gemv_logits(Tensor x, Tensor norm_weight, double eps, Tensor w, std::optional<Tensor> ahead) {
  GemvArgs a = gemv_args("norm_gemv_logits", x, w, GemvEpilogue::kNormLogits);
  add_ahead(a, "norm_gemv_logits", x, ahead);
  const Tensor workspace = add_norm(a, "norm_gemv_logits", x, norm_weight, eps);
  Tensor y = empty(x, {a.B, a.N}, ScalarType::Float);
  a.y = y.data_ptr();
  run_gemv(a, x);
  return y;
}

Tensor norm_qkv_rope(Tensor x, Tensor norm_weight, double eps, Tensor w, Tensor inv_freq, Tensor lengths,
                     Tensor k_cache, Tensor v_cache, int64_t layer) {
  const char* op = "norm_qkv_rope";
  GemvArgs a = gemv_args(op, x, w, GemvEpilogue::kNormRope);
  const Tensor workspace = add_norm(a, op, x, norm_weight, eps);
  require(k_cache, op, "k_cache", 5, x.scalar_type());
  require(v_cache, op, "v_cache", 5, x.scalar_type());
  require(lengths, op, "lengths", 1, ScalarType::Long);
  require(inv_freq, op, "inv_freq", 1, ScalarType::Float);
  for (const Tensor* t : {&k_cache, &v_cache, &lengths, &inv_freq}) same_device(x, *t, op, "every tensor");
  const int64_t L = k_cache.size(0), Hkv = k_cache.size(2), S = k_cache.size(3), D = k_cache.size(4);
  HIGGS_CHECK(k_cache.size(1) >= a.B && shape(v_cache) == shape(k_cache), op,
              ": caches must be [layers, slots, Hkv, S, D] with slots >= x's rows, got ", shape(k_cache), " and ",
              shape(v_cache));
  HIGGS_CHECK(layer >= 0 && layer < L, op, ": layer ", layer, " out of range for ", L, " layers");
  HIGGS_CHECK(D % 16 == 0 && a.N % D == 0 && a.N / D > 2 * Hkv, op, ": w must be [(Hq + 2 Hkv) * D, K], got ",
              shape(w));
  HIGGS_CHECK(lengths.size(0) == a.B && inv_freq.size(0) == D / 2 && S >= 1, op, ": lengths [B], inv_freq [D/2]");
  a.Hkv = Hkv, a.S = S, a.D = D, a.Hq = a.N / D - 2 * Hkv;
  Tensor q = empty(x, {a.B, a.Hq, D});
  const int64_t layer_elems = k_cache.size(1) * Hkv * S * D * int64_t(x.element_size());  // x's rows: the first slots
  a.y = q.data_ptr();
  a.inv_freq = static_cast<const float*>(inv_freq.data_ptr());
  a.lengths = static_cast<const int64_t*>(lengths.data_ptr());
  a.k_cache = static_cast<char*>(k_cache.data_ptr()) + layer * layer_elems;
  a.v_cache = static_cast<char*>(v_cache.data_ptr()) + layer * layer_elems;
  run_gemv(a, x);
  return q;
}

// ---- attention and sampling (CUDA) ----------------------------------------------------------------------

Tensor decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, Tensor counters) {
  const char* op = "decode_attention";
  HIGGS_CHECK(q.is_cuda(), op, ": CUDA only (on the CPU use its torch reference, higgs_rt.ops)");
  require(q, op, "q", 3, q.scalar_type());
  require(k_cache, op, "k_cache", 4, q.scalar_type());
  require(v_cache, op, "v_cache", 4, q.scalar_type());
  require(lengths, op, "lengths", 1, ScalarType::Long);
  require(counters, op, "counters", 1, ScalarType::Int);
  for (const Tensor* t : {&k_cache, &v_cache, &lengths, &counters}) same_device(q, *t, op, "every tensor");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(1), S = k_cache.size(2);
  HIGGS_CHECK(k_cache.size(0) >= B && k_cache.size(3) == D && Hkv >= 1 && Hq % Hkv == 0 &&
                  shape(v_cache) == shape(k_cache) && lengths.size(0) == B,
              op, ": need q [B, Hq, D], caches [slots >= B, Hkv, S, D] with Hkv | Hq, lengths [B]; got q ", shape(q),
              ", k_cache ", shape(k_cache));
  HIGGS_CHECK(D == 64 || D == 128, op, ": head dim must be 64 or 128");
  HIGGS_CHECK(counters.size(0) >= B * Hq, op, ": counters must have at least B * Hq entries");
  const int64_t chunks = std::max<int64_t>(1, (S + kAttentionChunk - 1) / kAttentionChunk);
  Tensor out = torch::stable::empty_like(q);
  Tensor workspace = empty(q, {B * Hq * chunks * (D + 2)}, ScalarType::Float);
  run_cuda(decode_attention_cuda,
           DecodeAttentionArgs{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               static_cast<const int64_t*>(lengths.data_ptr()), out.data_ptr(),
                               static_cast<float*>(workspace.data_ptr()), static_cast<int32_t*>(counters.data_ptr()),
                               B, Hq, Hkv, S, D, float_dtype(q, op, "q")},
           q);
  return out;
}

Tensor sample_frame(Tensor logits, Tensor seeds, Tensor frame, Tensor eos_start, Tensor done, Tensor history,
                    Tensor temperature, Tensor top_k, Tensor top_p, Tensor greedy, Tensor ras_on, Tensor ras_max,
                    Tensor lengths, int64_t window) {
  const char* op = "sample_frame";
  HIGGS_CHECK(logits.is_cuda(), op, ": CUDA only (on the CPU use FrameSampler's torch path)");
  require(logits, op, "logits", 3, ScalarType::Float);
  const int64_t B = logits.size(0), Q = logits.size(1), V = logits.size(2);
  for (auto [t, name, dtype] : {std::tuple{&seeds, "seeds", ScalarType::Long}, {&frame, "frame", ScalarType::Long},
                                {&eos_start, "eos_start", ScalarType::Long}, {&done, "done", ScalarType::Bool},
                                {&temperature, "temperature", ScalarType::Float}, {&top_k, "top_k", ScalarType::Long},
                                {&top_p, "top_p", ScalarType::Float}, {&greedy, "greedy", ScalarType::Bool},
                                {&ras_on, "ras_on", ScalarType::Bool}, {&ras_max, "ras_max", ScalarType::Long},
                                {&lengths, "lengths", ScalarType::Long}}) {
    require(*t, op, name, 1, dtype);
    same_device(logits, *t, op, name);
    HIGGS_CHECK(t->size(0) == B, op, ": ", name, " must have ", B, " entries");
  }
  require(history, op, "history", 3, ScalarType::Long);
  same_device(logits, history, op, "history");
  HIGGS_CHECK(history.size(0) == B && history.size(2) == Q && history.size(1) >= 1, op, ": history must be [B, W, Q]");
  HIGGS_CHECK(window >= 0 && window <= history.size(1), op, ": window must be 0 to history's rows");
  Tensor frames = empty(logits, {B, Q}, ScalarType::Long);
  auto i64 = [](Tensor& t) { return static_cast<int64_t*>(t.data_ptr()); };
  run_cuda(sample_frame_cuda,
           SampleFrameArgs{static_cast<const float*>(logits.data_ptr()), i64(frames), i64(seeds), i64(frame),
                           i64(eos_start), static_cast<bool*>(done.data_ptr()), i64(history),
                           static_cast<const float*>(temperature.data_ptr()), i64(top_k),
                           static_cast<const float*>(top_p.data_ptr()), static_cast<const bool*>(greedy.data_ptr()),
                           static_cast<const bool*>(ras_on.data_ptr()), i64(ras_max), i64(lengths), B, Q, V,
                           history.size(1), window},
           logits);
  return frames;
}

}  // namespace

STABLE_TORCH_LIBRARY(higgs_rt, m) {
  m.def("delay_revert(Tensor codes, int num_codes, int offset, int length) -> Tensor");
  m.def("rvq_lookup(Tensor codes, Tensor table) -> Tensor");
  m.def("snake(Tensor x, Tensor alpha, Tensor? mask) -> Tensor");
  m.def("codec_window(Tensor x, Tensor? addend, Tensor state, Tensor first, Tensor length, int rate, int lag, "
        "Tensor? alpha, Tensor? alpha_full) -> (Tensor, Tensor)");
  m.def("tap_sum(Tensor products, Tensor? bias, Tensor? alpha) -> Tensor");
  m.def("codec_conv(Tensor x, Tensor weight, Tensor? bias, Tensor? alpha, int taps, int dilation) -> Tensor");
  m.def("dualffn_route(Tensor hidden, Tensor audio_mask) -> (Tensor, Tensor, Tensor)");
  m.def("dualffn_unroute(Tensor y, Tensor perm) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, Tensor? audio_weight, Tensor? audio_rows, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, Tensor? audio_weight, Tensor? audio_rows, float eps) "
        "-> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gemv(Tensor x, Tensor w) -> Tensor");
  m.def("gemv_residual(Tensor x, Tensor w, Tensor residual, Tensor? ahead=None) -> Tensor");
  m.def("norm_gemv_silu(Tensor x, Tensor norm_weight, float eps, Tensor w) -> Tensor");
  m.def("norm_gemv_logits(Tensor x, Tensor norm_weight, float eps, Tensor w, Tensor? ahead=None) -> Tensor");
  m.def("norm_qkv_rope(Tensor x, Tensor norm_weight, float eps, Tensor w, Tensor inv_freq, Tensor lengths, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int layer) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, Tensor(a!) counters) -> Tensor");
  m.def("sample_frame(Tensor logits, Tensor seeds, Tensor(a!) frame, Tensor(b!) eos_start, Tensor(c!) done, "
        "Tensor(d!) history, Tensor temperature, Tensor top_k, Tensor top_p, Tensor greedy, Tensor ras_on, "
        "Tensor ras_max, Tensor(e!) lengths, int window) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(higgs_rt, CPU, m) {
  m.impl("delay_revert", TORCH_BOX(&delay_revert));
  m.impl("rvq_lookup", TORCH_BOX(&rvq_lookup));
  m.impl("snake", TORCH_BOX(&snake));
  m.impl("dualffn_route", TORCH_BOX(&dualffn_route));
  m.impl("dualffn_unroute", TORCH_BOX(&dualffn_unroute));
}

STABLE_TORCH_LIBRARY_IMPL(higgs_rt, CUDA, m) {
  m.impl("delay_revert", TORCH_BOX(&delay_revert));
  m.impl("rvq_lookup", TORCH_BOX(&rvq_lookup));
  m.impl("snake", TORCH_BOX(&snake));
  m.impl("codec_window", TORCH_BOX(&codec_window));
  m.impl("tap_sum", TORCH_BOX(&tap_sum));
  m.impl("codec_conv", TORCH_BOX(&codec_conv));
  m.impl("dualffn_route", TORCH_BOX(&dualffn_route));
  m.impl("dualffn_unroute", TORCH_BOX(&dualffn_unroute));
  m.impl("rms_norm", TORCH_BOX(&rms_norm));
  m.impl("add_rms_norm", TORCH_BOX(&add_rms_norm));
  m.impl("rope_qkv", TORCH_BOX(&rope_qkv));
  m.impl("silu_mul", TORCH_BOX(&silu_mul));
  m.impl("gemv", TORCH_BOX(&gemv));
  m.impl("gemv_residual", TORCH_BOX(&gemv_residual));
  m.impl("norm_gemv_silu", TORCH_BOX(&norm_gemv_silu));
  m.impl("norm_gemv_logits", TORCH_BOX(&norm_gemv_logits));
  m.impl("norm_qkv_rope", TORCH_BOX(&norm_qkv_rope));
  m.impl("decode_attention", TORCH_BOX(&decode_attention));
  m.impl("sample_frame", TORCH_BOX(&sample_frame));
}

// Build facts for Python (ctypes), which cannot ask a torch operator for a string.
extern "C" {
#ifdef HIGGS_RT_WITH_CUDA
__attribute__((visibility("default"))) const char* higgs_rt_cuda_archs() { return HIGGS_RT_CUDA_ARCHS; }
#else
__attribute__((visibility("default"))) const char* higgs_rt_cuda_archs() { return ""; }
#endif
}
