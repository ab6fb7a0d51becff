// CPU delay-pattern revert: out[b, t, k] = clamp(in[b, offset + t + k, k], 0, K - 1).
#include <algorithm>

#include "../ops.h"

namespace higgs_rt {

void delay_revert_cpu(const DelayRevertArgs& a) {
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t = 0; t < a.L; ++t)
      for (int64_t k = 0; k < a.Q; ++k) {
        const int64_t code = a.in[(b * a.S + a.offset + t + k) * a.Q + k];
        a.out[(b * a.L + t) * a.Q + k] = std::clamp<int64_t>(code, 0, a.K - 1);
      }
}

}  // namespace higgs_rt
