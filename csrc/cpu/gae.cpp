// Masked GAE on CPU: rows in parallel, each row one backward sweep (the recurrence is sequential in t).
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_kernels.h"

namespace megatron_rl::cpu {
namespace {

void sweep_row(const GaeArgs& a, int64_t row, float gamma, float gamma_lam) {
  const int64_t base = row * a.steps;
  float next_value = 0.f;
  float last_gae = 0.f;
  for (int64_t t = a.steps - 1; t >= 0; --t) {
    const int64_t i = base + t;
    const float m = a.mask[i];
    const float v = a.values[i];
    // Affine form of the reference update, bit-identical for 0/1 masks:
    //   (delta + gamma_lam * last_gae) * m + (1 - m) * last_gae == (m * gamma_lam + 1 - m) * last_gae + m * delta
    // It leaves one multiply and one add on the loop-carried chain instead of four operations.
    const float delta = a.rewards[i] + gamma * next_value - v;
    const float keep = 1.f - m;
    last_gae = (m * gamma_lam + keep) * last_gae + m * delta;
    next_value = keep * next_value + m * v;  // masked tokens carry both states through
    a.advantages[i] = last_gae;
    a.returns[i] = last_gae + v;
  }
}

}  // namespace

void masked_gae(const GaeArgs& a) {
  // gamma and gamma*lam are single scalars cast to fp32, as in the reference's tensor-scalar products.
  const float gamma = static_cast<float>(a.gamma);
  const float gamma_lam = static_cast<float>(a.gamma * a.lam);
  // Rows are swept one at a time: interleaving rows T floats apart measured 3x slower (4 KiB aliasing).
  const int64_t grain = std::max<int64_t>(1, kLightGrainSize / std::max<int64_t>(1, a.steps));
  at::parallel_for(0, a.batch, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) sweep_row(a, b, gamma, gamma_lam);
  });
}

}  // namespace megatron_rl::cpu
