// CPU Snake (the codec's activation), masked: out = (x + 1 / (alpha + 1e-9) * sin(alpha * x)^2) * mask, each
// step a separate IEEE fp32 operation, as torch's ops compute it.
#include <cmath>

#include "../ops.h"

namespace higgs_rt {

void snake_cpu(const SnakeArgs& a) {
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      const float* x = a.x + b * a.x_sb + t * a.x_st;
      float* out = a.out + (b * a.T + t) * a.C;
      const float m = a.mask != nullptr ? a.mask[b * a.mask_sb + t] : 1.0f;
      for (int64_t c = 0; c < a.C; ++c) {
        const float alpha = a.alpha[c];
        const float inv = 1.0f / (alpha + 1e-9f);
        const float s = std::sin(alpha * x[c]);
        const float y = x[c] + inv * (s * s);
        out[c] = a.mask != nullptr ? y * m : y;
      }
    }
  }
}

}  // namespace higgs_rt
