// pybind11 module higgs_rt._C: validates sizes once and dispatches each op to its CPU or CUDA kernel.
// Tensors arrive as data pointers (uintptr_t); device -1 means CPU, else a CUDA ordinal whose
// kernels run on `stream` (torch.cuda.current_stream().cuda_stream).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ops.h"

namespace py = pybind11;
using namespace higgs_rt;

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("higgs_rt._C: " + what);  // -> Python ValueError
}

template <typename Args>
void dispatch(void (*cpu)(const Args&), void (*cuda)(const Args&, int, void*), const Args& a, int device,
              uintptr_t stream) {
  if (device < 0)
    cpu(a);
  else
    cuda(a, device, reinterpret_cast<void*>(stream));
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "higgs-rt compiled kernels (C++ always, CUDA when built with nvcc); use higgs_rt.ops.";
#ifdef HIGGS_RT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.attr("cuda_archs") = HIGGS_RT_CUDA_ARCHS;
#else
  m.attr("has_cuda") = false;
  m.attr("cuda_archs") = "";
#endif

  m.def("delay_revert", [](uintptr_t in, uintptr_t out, int64_t B, int64_t S, int64_t Q, int64_t L, int64_t offset,
                           int64_t K, int device, uintptr_t stream) {
    require(B >= 0 && S >= 0 && Q >= 1 && L >= 0 && offset >= 0 && K >= 1, "delay_revert: bad sizes");
    require(offset + L + Q - 1 <= S || L == 0, "delay_revert: window exceeds the input frames");
    dispatch(delay_revert_cpu, delay_revert_cuda, DelayRevertArgs{ptr<const int64_t>(in), ptr<int64_t>(out), B, S, Q, L, offset, K},
             device, stream);
  });

  m.def("rvq_lookup", [](uintptr_t codes, uintptr_t table, uintptr_t out, int64_t rows, int64_t Q, int64_t K, int64_t D,
                         int dtype, int device, uintptr_t stream) {
    require(rows >= 0 && Q >= 0 && K >= 1 && D >= 0, "rvq_lookup: bad sizes");
    require(dtype >= 0 && dtype <= 2, "rvq_lookup: bad table dtype code");
    dispatch(rvq_lookup_cpu, rvq_lookup_cuda,
             RvqLookupArgs{ptr<const int64_t>(codes), ptr<const void>(table), ptr<void>(out), rows, Q, K, D,
                           static_cast<TableDType>(dtype)},
             device, stream);
  });

  m.def("dualffn_route", [](uintptr_t hidden, uintptr_t mask, uintptr_t routed, uintptr_t perm, uintptr_t n_audio,
                            int64_t N, int64_t row_bytes, int device, uintptr_t stream) {
    require(N >= 0 && row_bytes >= 0, "dualffn_route: bad sizes");
    dispatch(dualffn_route_cpu, dualffn_route_cuda,
             DualFFNRouteArgs{ptr<const void>(hidden), ptr<const uint8_t>(mask), ptr<void>(routed), ptr<int64_t>(perm),
                              ptr<int64_t>(n_audio), N, row_bytes},
             device, stream);
  });

  m.def("dualffn_unroute", [](uintptr_t y, uintptr_t perm, uintptr_t out, int64_t N, int64_t row_bytes, int device,
                              uintptr_t stream) {
    require(N >= 0 && row_bytes >= 0, "dualffn_unroute: bad sizes");
    dispatch(dualffn_unroute_cpu, dualffn_unroute_cuda,
             DualFFNUnrouteArgs{ptr<const void>(y), ptr<const int64_t>(perm), ptr<void>(out), N, row_bytes}, device, stream);
  });

  // CUDA only: on CPU these ops are their torch references (higgs_rt.ops).
  m.def("gemv", [](uintptr_t x, uintptr_t w, uintptr_t y, int64_t B, int64_t N, int64_t K, int dtype, int device,
                   uintptr_t stream) {
    require(B >= 1 && B <= 8 && N >= 0 && K >= 0 && K % 8 == 0, "gemv: need 1 <= B <= 8, N >= 0, K >= 0, K % 8 == 0");
    require(dtype == 1 || dtype == 2, "gemv: dtype must be bfloat16 or float16");
    require(device >= 0, "gemv: CUDA only (use higgs_rt.ops.gemv_ref on CPU)");
    gemv_cuda(GemvArgs{ptr<const void>(x), ptr<const void>(w), ptr<void>(y), B, N, K, static_cast<TableDType>(dtype)},
              device, reinterpret_cast<void*>(stream));
  });

  m.def("decode_attention", [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t lengths, uintptr_t out,
                               uintptr_t workspace, int64_t B, int64_t Hq, int64_t Hkv, int64_t S, int64_t D,
                               int64_t nsplit, int dtype, int device, uintptr_t stream) {
    require(B >= 0 && Hkv >= 1 && Hq >= 0 && Hq % Hkv == 0 && S >= 0 && nsplit >= 1,
            "decode_attention: bad sizes (need Hq % Hkv == 0, nsplit >= 1)");
    require(D == 64 || D == 128, "decode_attention: head dim must be 64 or 128");
    require(nsplit == 1 || workspace != 0, "decode_attention: nsplit > 1 needs a workspace");
    require(dtype >= 0 && dtype <= 2, "decode_attention: bad dtype code");
    require(device >= 0, "decode_attention: CUDA only (use higgs_rt.ops.decode_attention_ref on CPU)");
    decode_attention_cuda(DecodeAttentionArgs{ptr<const void>(q), ptr<const void>(k), ptr<const void>(v),
                                              ptr<const int64_t>(lengths), ptr<void>(out), ptr<void>(workspace), B, Hq,
                                              Hkv, S, D, nsplit, static_cast<TableDType>(dtype)},
                          device, reinterpret_cast<void*>(stream));
  });
}
