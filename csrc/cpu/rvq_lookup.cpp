// CPU RVQ lookup: out[r] = sum_q table[q, clamp(codes[r, q], 0, K - 1)], fp32 accumulation in q order.
#include <algorithm>
#include <vector>

#include "../ops.h"
#include "float_bits.h"

namespace higgs_rt {
namespace {

struct F32 {
  using T = float;
  static float load(T x) { return x; }
  static T store(float x) { return x; }
};
struct BF16 {
  using T = uint16_t;
  static float load(T x) { return bf16_to_f32(x); }
  static T store(float x) { return f32_to_bf16(x); }
};
struct F16 {
  using T = uint16_t;
  static float load(T x) { return f16_to_f32(x); }
  static T store(float x) { return f32_to_f16(x); }
};

template <typename Fmt>
void lookup(const RvqLookupArgs& a) {
  using T = typename Fmt::T;
  const T* table = static_cast<const T*>(a.table);
  T* out = static_cast<T*>(a.out);
  std::vector<float> acc(a.D);
  for (int64_t r = 0; r < a.rows; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t q = 0; q < a.Q; ++q) {
      const int64_t k = std::clamp<int64_t>(a.codes[r * a.Q + q], 0, a.K - 1);
      const T* row = table + (q * a.K + k) * a.D;
      for (int64_t d = 0; d < a.D; ++d) acc[d] += Fmt::load(row[d]);
    }
    for (int64_t d = 0; d < a.D; ++d) out[r * a.D + d] = Fmt::store(acc[d]);
  }
}

}  // namespace

void rvq_lookup_cpu(const RvqLookupArgs& a) {
  switch (a.dtype) {
    case TableDType::kFloat32: return lookup<F32>(a);
    case TableDType::kBFloat16: return lookup<BF16>(a);
    case TableDType::kFloat16: return lookup<F16>(a);
  }
}

}  // namespace higgs_rt
