// Kernel entry points: raw pointers and sizes only (no torch headers), so the CUDA files build without torch.
// CPU implementations live in csrc/cpu/, CUDA ones in csrc/cuda/; library.cpp registers them as torch ops.
// Codes are int64, time-major [B, T, Q]; out-of-range codes are clamped to [0, K - 1].
#pragma once

#include <cstdint>

namespace higgs_rt {

// out[b, t, k] = clamp(in[b, offset + t + k, k], 0, K - 1); in [B, S, Q], out [B, L, Q].
struct DelayRevertArgs {
  const int64_t* in;
  int64_t* out;
  int64_t B, S, Q, L, offset, K;
};

enum class TableDType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// out[r] = sum_q table[q, clamp(codes[r, q], 0, K - 1)] in fp32, q ascending; codes [rows, Q], table [Q, K, D].
struct RvqLookupArgs {
  const int64_t* codes;
  const void* table;
  void* out;
  int64_t rows, Q, K, D;
  TableDType dtype;
};

// The codec's Snake, masked: out[b, t, c] = (x + 1 / (alpha[c] + 1e-9) * sin(alpha[c] * x)^2) * mask[b, t], each
// step rounded as torch's ops round it (no fused multiply-add), x = x[b, t, c]; mask may be null (1). fp32, x
// [B, T, C] with its channels contiguous (strides x_sb, x_st for b and t), mask [B, T] (stride mask_sb for b),
// out [B, T, C] contiguous.
struct SnakeArgs {
  const float* x;
  const float* alpha;
  const float* mask;
  float* out;
  int64_t B, T, C, x_sb, x_st, mask_sb;
};

// The streaming codec's layer input (CUDA only; higgs_rt/ops/codec.py is the reference). Lane b's call input
// v = x[b] (+ addend[b]: the residual unit before it), Snake with alpha where given, times the padding mask
// (pos = first[b] * rate - lag + t; 1 where 0 <= pos < length[b] * rate, else 0), appended to the lane's kept
// samples: full[b] = [state[b]; v], [keep + W, C]; snaked = Snake(full, alpha_full) where alpha_full is given.
// Rounded as torch's ops round (add, Snake, then the mask's multiply). x, addend [B, W, C] with contiguous
// channels (strides x_sb/x_st, a_sb/a_st), state [>= B, keep, C], full and snaked [B, keep + W, C] contiguous.
struct CodecWindowArgs {
  const float* x;
  const float* addend;      // or null
  const float* state;
  const int64_t* first;
  const int64_t* length;
  const float* alpha;       // [C] or null: no Snake on v
  const float* alpha_full;  // [C] or null: snaked not written
  float* full;
  float* snaked;
  int64_t B, W, C, keep, x_sb, x_st, a_sb, a_st, rate, lag;
};

// The K products of a one-lane convolution's taps summed, k ascending, plus bias, then Snake where alpha is given:
// out[i] = Snake(((p[0, i] + p[1, i]) + ...) + bias[i % C]); p [K, N] (N = W * C), out [N], fp32 contiguous.
struct TapSumArgs {
  const float* p;
  const float* bias;   // [C] or null
  const float* alpha;  // [C] or null
  float* out;
  int64_t K, N, C;
};

// A streaming codec convolution on tensor cores at fp32 accuracy (CUDA only; csrc/cuda/codec_conv.cu, the
// reference is higgs_rt/ops/codec_stream.py): out[b, t, n] = Snake(sum_{j, c} x[b, t + j * dilation, c] *
// w[j * C + c, n] + bias[n]) with alpha where given. x [B, L, C], w [taps * C, N], out [B, W, N] contiguous fp32,
// W = L - (taps - 1) * dilation; C % 32 == 0, N % 32 == 0, x and w 16-byte aligned.
// Split sums: blocks of split_steps k steps of kCodecConvStep each write partial [splits, B * W, N] (no bias, no
// Snake) for tap_sum_cuda to add in order; partial is null where one split covers K. The caller splits sums longer
// than kCodecConvMaxSteps steps, by K alone.
constexpr int64_t kCodecConvStep = 32, kCodecConvMaxSteps = 32;
struct CodecConvArgs {
  const float* x;
  const float* w;
  const float* bias;   // [N] or null
  const float* alpha;  // [N] or null
  float* out;
  float* partial;      // [splits, B * W, N] or null
  int64_t B, L, C, N, W, taps, dilation, split_steps;
};

// perm = text rows then audio rows (stable), routed[i] = hidden[perm[i]], *n_audio = #audio rows.
struct DualFFNRouteArgs {
  const void* hidden;
  const uint8_t* mask;  // torch.bool: one byte per row
  void* routed;
  int64_t* perm;
  int64_t* n_audio;
  int64_t N, row_bytes;
};

// out[perm[i]] = y[i]; entries of perm outside [0, N) are skipped.
struct DualFFNUnrouteArgs {
  const void* y;
  const int64_t* perm;
  void* out;
  int64_t N, row_bytes;
};

// The prompt forward's row-wise steps (CUDA only; rounding as torch's ops round, so the torch layer is the
// reference, higgs_rt/ops/rowwise.py):
// RMSNorm, with the residual add before it where `residual` is given (the Llama layer's x = x + delta; h = norm(x)):
//   s = x + residual rounded to the dtype (written to `sum`), else s = x;
//   out = w * round(s * rsqrt(mean(s^2) + eps)), w = audio_weight on the rows where audio_rows (bool) is set, else
//   weight; the statistics in fp32. x, residual, sum, out [R, H] contiguous; weights [H].
struct RmsNormArgs {
  const void* x;
  const void* residual;  // null: no add, sum not written
  void* sum;
  void* out;
  const void* weight;
  const void* audio_weight;   // null with audio_rows
  const uint8_t* audio_rows;  // [R] torch.bool, or null: weight on every row
  int64_t R, H;
  float eps;
  TableDType dtype;
};

// A fused q/k/v projection split into heads with rotate-half RoPE on q and k: qkv [B, T, (Hq + 2 Hkv) * D] ->
// q [B, Hq, T, D], k and v [B, Hkv, T, D]; out = round(round(x * cos) + round(rotate_half(x) * sin)) with cos and
// sin [Bc, T, D] (Bc = 1: shared by every row; else B, cos_sb = T * D).
struct RopeQkvArgs {
  const void* qkv;
  const void* cos;
  const void* sin;
  void* q;
  void* k;
  void* v;
  int64_t B, T, Hq, Hkv, D, cos_sb;
  TableDType dtype;
};

// SwiGLU of a fused gate/up projection: out[r, i] = round(round(silu(gu[r, i])) * gu[r, I + i]), gu [R, 2I] -> out
// [R, I]; silu(g) = g / (1 + exp(-g)) in fp32.
struct SiluMulArgs {
  const void* gu;
  void* out;
  int64_t R, I;
  TableDType dtype;
};

// The decode GEMV family: acc[b, n] = sum_k x'[b, k] * w[n, k] in fp32 (bf16/fp16 tensor cores), x [B, K],
// w [N, K], 1 <= B <= 64, K % 8 == 0, x and w 16-byte aligned. Norm epilogues fold an RMSNorm into the
// prologue: x' = x * norm_weight and acc *= rsqrt(mean_k(x^2) + eps). The epilogue decides what is stored:
//   kPlain      y [B, N] = acc
//   kResidual   y [B, N] = residual + acc
//   kNormSilu   w is [gate; up] (N = 2 * hidden): y [B, hidden] = silu(acc[gate]) * acc[up]
//   kNormRope   w is the fused q/k/v projection (N = (Hq + 2 Hkv) * D): RoPE (rotate-half, position
//               clamp(lengths[b], 0, S - 1), angles pos * inv_freq) on q and k; y = q [B, Hq, D]; k and v are
//               written into k_cache / v_cache [B, Hkv, S, D] (one layer) at that position
//   kNormLogits y [B, N] float32 = acc rounded to the weights' dtype
// Each output's sum is split over k the same way whatever B is (batch-invariant). CUDA only.
enum class GemvEpilogue : int { kPlain = 0, kResidual = 1, kNormSilu = 2, kNormRope = 3, kNormLogits = 4 };

struct GemvArgs {
  const void* x;
  const void* w;
  void* y;
  int64_t B, N, K;
  TableDType dtype;
  GemvEpilogue epilogue = GemvEpilogue::kPlain;
  const void* norm_weight = nullptr;   // [K], norm epilogues
  float eps = 0.f;
  const void* residual = nullptr;      // [B, N], kResidual
  const float* inv_freq = nullptr;     // [D / 2], kNormRope
  const int64_t* lengths = nullptr;    // [B], kNormRope
  void* k_cache = nullptr;             // [B, Hkv, S, D], kNormRope
  void* v_cache = nullptr;
  int64_t Hq = 0, Hkv = 0, S = 0, D = 0;
  void* prenorm = nullptr;             // norm epilogues, B >= kGemvPrenormMinRows: gemv_prenorm_bytes of workspace
  float* partials = nullptr;           // gemv_partials_bytes of workspace (the tiled kernel's k-split partials)
  // A hint, no effect on y: the k-split GEMV kernel (gemv.cu; not the tiled one) of the residual and logits
  // epilogues asks L2 for these bytes, which a later kernel will stream: `ahead_parts` runs of `ahead_part_bytes`
  // (a multiple of 16), `ahead_stride` bytes apart, 16-byte aligned (gemv_ahead, gemv_common.cuh).
  // When a block asks (ahead_at, $HIGGS_RT_L2_AHEAD_AT, measuring): 0 first thing, 1 after its PDL wait and its
  // reads of the previous kernel's output (the logits epilogue: first thing), 2 once its outputs are stored.
  const void* ahead = nullptr;
  int64_t ahead_parts = 0, ahead_part_bytes = 0, ahead_stride = 0;
  int ahead_at = 0;
  int ahead_bulk = 0;  // sm_90: bulk prefetches by one thread a block ($HIGGS_RT_L2_AHEAD_BULK, measuring)
};

// From this many rows on, a norm GEMV normalises x in a pre-pass kernel (x * norm_weight and each row's scale,
// summed in the fused kernel's order: the same bits) into `prenorm` instead of in every block of the GEMV, so the
// B x K norm arithmetic runs once instead of once per block.
constexpr int64_t kGemvPrenormMinRows = 17;
inline int64_t gemv_prenorm_bytes(int64_t B, int64_t K, int64_t elem_size) { return B * K * elem_size + B * 4; }

// Above 16 rows, where K % 1024 == 0 and it is faster (gate/up and down), a GEMV runs as a tiled GEMM
// (csrc/cuda/gemv_tiled.cu) with the same sums in the same order; where its k-split spreads one row block over
// several blocks, their partial sums need this many bytes of workspace (`partials`; 0: none). Without it the same
// kernel runs unsplit: the same bits, slower.
int64_t gemv_partials_bytes(const GemvArgs& a, int device);

// out[b, h] = softmax(q[b, h] . k[b, h / (Hq / Hkv), :len] * D^-0.5) @ v[b, h / (Hq / Hkv), :len], fp32 softmax,
// len = clamp(lengths[b], 0, S) read on the device (zeros when 0). q/out [B, Hq, D], k/v [B, Hkv, S, D], all of
// `dtype`, D in {64, 128}. Keys are cut into chunks of kAttentionChunk; each chunk's partial softmax goes to
// `workspace` (B * Hq * ceil(S / chunk) * (D + 2) floats) and the last block of each (slot, KV head) merges them
// in chunk order, counted in `counters` (B * Hkv int32, zero before the call and zero again after it). The
// result of a slot depends on its own length only, not on B or the grid. CUDA only.
constexpr int64_t kAttentionChunk = 64;

struct DecodeAttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* lengths;
  void* out;
  float* workspace;
  int32_t* counters;
  int64_t B, Hq, Hkv, S, D;
  TableDType dtype;
};

// One frame of the generation state machine for every slot (higgs_rt/sampling.py is the reference):
// logits [B, Q, V] fp32 (V = codes + 2, BOS = V - 2, EOS = V - 1); per slot seeds, frame, eos_start, done,
// history [B, W, Q] (W >= 1; RAS window, 0 = off), temperature, top_k, top_p, greedy, ras_on, ras_max.
// Writes frames [B, Q] int64 and advances the state (history, eos_start, done, frame) and the KV lengths of
// the slots that were not done. Two launches: one block per (slot, codebook) picks, one per slot updates.
struct SampleFrameArgs {
  const float* logits;
  int64_t* frames;
  int64_t* seeds;
  int64_t* frame;
  int64_t* eos_start;
  bool* done;
  int64_t* history;
  const float* temperature;
  const int64_t* top_k;
  const float* top_p;
  const bool* greedy;
  const bool* ras_on;
  const int64_t* ras_max;
  int64_t* lengths;  // KV cache lengths [B], += 1 where not done
  int64_t B, Q, V, W;
  int64_t window;    // RAS window (0 = off); history has max(window, 1) rows
};

void delay_revert_cpu(const DelayRevertArgs& a);
void rvq_lookup_cpu(const RvqLookupArgs& a);
void snake_cpu(const SnakeArgs& a);
void dualffn_route_cpu(const DualFFNRouteArgs& a);
void dualffn_unroute_cpu(const DualFFNUnrouteArgs& a);

// CUDA: launch on `stream` (a cudaStream_t) of `device`; never synchronize. Throw std::runtime_error
// on launch errors. Without a CUDA build they throw (csrc/cuda/unavailable.cpp).
void delay_revert_cuda(const DelayRevertArgs& a, int device, void* stream);
void rvq_lookup_cuda(const RvqLookupArgs& a, int device, void* stream);
void snake_cuda(const SnakeArgs& a, int device, void* stream);
void codec_window_cuda(const CodecWindowArgs& a, int device, void* stream);
void tap_sum_cuda(const TapSumArgs& a, int device, void* stream);
void codec_conv_cuda(const CodecConvArgs& a, int device, void* stream);
void dualffn_route_cuda(const DualFFNRouteArgs& a, int device, void* stream);
void dualffn_unroute_cuda(const DualFFNUnrouteArgs& a, int device, void* stream);
void rms_norm_cuda(const RmsNormArgs& a, int device, void* stream);
void rope_qkv_cuda(const RopeQkvArgs& a, int device, void* stream);
void silu_mul_cuda(const SiluMulArgs& a, int device, void* stream);
void gemv_cuda(const GemvArgs& a, int device, void* stream);
void decode_attention_cuda(const DecodeAttentionArgs& a, int device, void* stream);
void sample_frame_cuda(const SampleFrameArgs& a, int device, void* stream);

}  // namespace higgs_rt
