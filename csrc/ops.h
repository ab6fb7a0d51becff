// Kernel entry points of higgs_rt._C: raw pointers and sizes only (no torch headers).
// CPU implementations live in csrc/cpu/, CUDA ones in csrc/cuda/; bindings.cpp validates and dispatches.
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

// y[b, n] = sum_k x[b, k] * w[n, k] in fp32, stored in x's dtype; x [B, K], w [N, K], y [B, N], 1 <= B <= 8,
// K % 8 == 0, x and w 16-byte aligned, dtype bf16 or fp16. CUDA only (the CPU path is the torch reference).
struct GemvArgs {
  const void* x;
  const void* w;
  void* y;
  int64_t B, N, K;
  TableDType dtype;
};

// out[b, h] = softmax(q[b, h] . k[b, h / (Hq / Hkv), :len] * D^-0.5) @ v[b, h / (Hq / Hkv), :len], fp32 softmax,
// len = clamp(lengths[b], 0, S) read on the device (zeros when 0). q/out [B, Hq, D], k/v [B, Hkv, S, D], all of
// `dtype`, D in {64, 128}. nsplit > 1 splits the keys (flash-decoding) and needs `workspace`: B * Hq * nsplit *
// (D + 2) floats. CUDA only (the CPU path is the torch reference).
struct DecodeAttentionArgs {
  const void* q;
  const void* k;
  const void* v;
  const int64_t* lengths;
  void* out;
  void* workspace;
  int64_t B, Hq, Hkv, S, D, nsplit;
  TableDType dtype;
};

void delay_revert_cpu(const DelayRevertArgs& a);
void rvq_lookup_cpu(const RvqLookupArgs& a);
void dualffn_route_cpu(const DualFFNRouteArgs& a);
void dualffn_unroute_cpu(const DualFFNUnrouteArgs& a);

// CUDA: launch on `stream` (a cudaStream_t) of `device`; never synchronize. Throw std::runtime_error
// on launch errors. Without a CUDA build they throw (csrc/cuda/unavailable.cpp).
void delay_revert_cuda(const DelayRevertArgs& a, int device, void* stream);
void rvq_lookup_cuda(const RvqLookupArgs& a, int device, void* stream);
void dualffn_route_cuda(const DualFFNRouteArgs& a, int device, void* stream);
void dualffn_unroute_cuda(const DualFFNUnrouteArgs& a, int device, void* stream);
void gemv_cuda(const GemvArgs& a, int device, void* stream);
void decode_attention_cuda(const DecodeAttentionArgs& a, int device, void* stream);

}  // namespace higgs_rt
