// The per-response advantage from its group's (count, sum, sum of squared deviations), shared by the
// CPU and CUDA group_normalize kernels.
#pragma once

#include <cmath>

#include "kernel_args.h"
#include "row_stats.h"  // MRL_HD

namespace megatron_rl {

MRL_HD float group_advantage(float score, const double* group, GroupMode mode, double epsilon) {
  const double n = group[0];
  const double s = score;
  if (n < 2.0) {  // singleton: grpo uses mean 0, std 1; the others keep the score
    return static_cast<float>(mode == GroupMode::kGrpo ? s / (1.0 + epsilon) : s);
  }
  const double mean = group[1] / n;
  switch (mode) {
    case GroupMode::kGrpo:
      return static_cast<float>((s - mean) / (sqrt(group[2] / (n - 1.0)) + epsilon));  // unbiased std
    case GroupMode::kGrpoMean:
      return static_cast<float>(s - mean);
    case GroupMode::kRloo:
      return static_cast<float>(s * n / (n - 1.0) - mean * n / (n - 1.0));  // leave-one-out baseline
  }
  return score;
}

}  // namespace megatron_rl
