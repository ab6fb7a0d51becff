// CPU DualFFN routing: stable text-then-audio permutation of rows, and its inverse scatter.
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../ops.h"

namespace higgs_rt {
namespace {

// scatter ? dst[perm[i]] = src[i] : dst[i] = src[perm[i]]; perm is a permutation of 0 .. N - 1.
void permute_rows(const void* src, void* dst, const int64_t* perm, int64_t N, int64_t row_bytes, bool scatter) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t from = scatter ? i : perm[i], to = scatter ? perm[i] : i;
    std::memcpy(d + to * row_bytes, s + from * row_bytes, size_t(row_bytes));
  }
}

}  // namespace

void dualffn_route_cpu(const DualFFNRouteArgs& a) {
  int64_t n_audio = 0;
  for (int64_t i = 0; i < a.N; ++i) n_audio += a.mask[i] != 0;
  int64_t next_text = 0, next_audio = a.N - n_audio;
  for (int64_t i = 0; i < a.N; ++i) a.perm[a.mask[i] ? next_audio++ : next_text++] = i;
  *a.n_audio = n_audio;
  permute_rows(a.hidden, a.routed, a.perm, a.N, a.row_bytes, /*scatter=*/false);
}

void dualffn_unroute_cpu(const DualFFNUnrouteArgs& a) {
  std::vector<bool> seen(size_t(a.N), false);
  for (int64_t i = 0; i < a.N; ++i) {
    const int64_t p = a.perm[i];
    if (p < 0 || p >= a.N || seen[size_t(p)])
      throw std::invalid_argument("higgs_rt::dualffn_unroute: perm must be a permutation of 0 .. N - 1 (N = " +
                                  std::to_string(a.N) + "), got perm[" + std::to_string(i) + "] = " +
                                  std::to_string(p) + (p >= 0 && p < a.N ? " twice" : ""));
    seen[size_t(p)] = true;
  }
  permute_rows(a.y, a.out, a.perm, a.N, a.row_bytes, /*scatter=*/true);
}

}  // namespace higgs_rt
