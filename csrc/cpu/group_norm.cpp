// Group-normalised advantages on CPU: two scatter passes into per-group sums (serial: B is a few
// thousand scores, far below what threads pay off for), then one parallel elementwise pass.
#include <ATen/Parallel.h>

#include <cmath>

#include "../group_norm_math.h"
#include "cpu_kernels.h"

namespace megatron_rl::cpu {

void group_normalize(const GroupNormArgs& a) {
  double* ws = a.workspace;
  for (int64_t i = 0; i < a.size; ++i) {
    double* g = ws + a.group_index[i] * 3;
    g[0] += 1.0;
    g[1] += a.scores[i];
  }
  for (int64_t i = 0; i < a.size; ++i) {
    double* g = ws + a.group_index[i] * 3;
    const double d = a.scores[i] - g[1] / g[0];
    g[2] += d * d;
  }
  at::parallel_for(0, a.size, kLightGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      a.out[i] = group_advantage(a.scores[i], ws + a.group_index[i] * 3, a.mode, a.epsilon);
    }
  });
}

}  // namespace megatron_rl::cpu
