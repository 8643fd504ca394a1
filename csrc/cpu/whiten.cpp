// Masked whitening on CPU (verl's masked_whiten): two reductions, then one elementwise pass.
// Reductions run over fixed-size blocks in float lanes (vectorisable, independent add chains) and
// combine the blocks in double.
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu_kernels.h"

namespace megatron_rl::cpu {
namespace {

constexpr double kWhitenEps = 1e-8;
constexpr int64_t kLanes = 8;

struct Sums {
  double a = 0.0;
  double b = 0.0;
};

// Sums (f(i).first, f(i).second) over [0, size) in parallel; f is an inline lambda returning two floats.
template <typename F>
Sums parallel_sums(int64_t size, const F& f) {
  return at::parallel_reduce(
      0, size, kGrainSize, Sums{},
      [&](int64_t begin, int64_t end, Sums acc) {
        float a[kLanes] = {}, b[kLanes] = {};
        int64_t i = begin;
        for (; i + kLanes <= end; i += kLanes) {
          for (int64_t k = 0; k < kLanes; ++k) {
            const auto [x, y] = f(i + k);
            a[k] += x;
            b[k] += y;
          }
        }
        for (; i < end; ++i) {
          const auto [x, y] = f(i);
          a[0] += x;
          b[0] += y;
        }
        for (int64_t k = 0; k < kLanes; ++k) {
          acc.a += a[k];
          acc.b += b[k];
        }
        return acc;
      },
      [](Sums x, Sums y) { return Sums{x.a + y.a, x.b + y.b}; });
}

struct Pair {
  float first;
  float second;
};

}  // namespace

double masked_whiten_stats(const WhitenArgs& w) {
  // A zero mask weight drops the element entirely, so NaNs outside the mask do not leak in.
  const Sums first = parallel_sums(w.size, [&](int64_t i) {
    const float m = w.mask[i];
    return Pair{m, m != 0.f ? m * w.x[i] : 0.f};
  });
  const float mean = static_cast<float>(first.b / (first.a + kWhitenEps));
  const Sums second = parallel_sums(w.size, [&](int64_t i) {
    const float m = w.mask[i];
    const float d = w.x[i] - mean;
    return Pair{m != 0.f ? m * d * d : 0.f, 0.f};
  });
  w.stats[0] = first.a;
  w.stats[1] = first.b;
  w.stats[2] = second.a;
  return first.a;
}

void masked_whiten_apply(const WhitenArgs& w) {
  const double count = w.stats[0];
  const double mean = w.stats[1] / (count + kWhitenEps);
  const double var = w.stats[2] / (count + kWhitenEps) * (count / (count - 1.0));  // unbiased
  const float rstd = static_cast<float>(1.0 / std::sqrt(var + kWhitenEps));
  const float fmean = static_cast<float>(mean);
  const float shift = w.shift_mean ? 0.f : fmean;
  at::parallel_for(0, w.size, kGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) w.out[i] = (w.x[i] - fmean) * rstd + shift;
  });
}

}  // namespace megatron_rl::cpu
