// Masked whitening on CPU (verl's masked_whiten): two reductions, then one elementwise pass.
// Each reduction sums fixed-size blocks in float lanes (vectorisable, independent add chains) and adds
// the blocks up in double.
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace megatron_rl::cpu {
namespace {

constexpr double kWhitenEps = 1e-8;
constexpr int64_t kLanes = 8;
constexpr int64_t kBlock = 2048;  // float lanes sum 256 values each before the block joins the double total

struct Sums {
  double a = 0.0;
  double b = 0.0;
};

enum class Pass { kMean, kVariance };

// kMean: (sum m, sum m*x); kVariance: (sum m*(x - mean)^2, 0). A zero mask weight drops the element
// entirely, so NaNs outside the mask do not leak in.
// v where keep, else +0.0 (also for a NaN v), by masking bits: a float select or a conditional load
// compiles to a branch here, and a random mask made it mispredict (3.4 ms -> 0.7 ms for 512k elements).
inline float value_or_zero(bool keep, float v) {
  return std::bit_cast<float>(std::bit_cast<uint32_t>(v) & (0u - static_cast<uint32_t>(keep)));
}

template <Pass kPass>
inline void add_element(const WhitenArgs& w, float mean, int64_t i, float& a, float& b) {
  const float m = w.mask[i];
  if constexpr (kPass == Pass::kMean) {
    a += m;
    b += m * value_or_zero(m != 0.f, w.x[i]);
  } else {
    const float d = value_or_zero(m != 0.f, w.x[i] - mean);
    a += m * d * d;
  }
}

template <Pass kPass>
Sums block_sums(const WhitenArgs& w, float mean, int64_t begin, int64_t end) {
  float a[kLanes] = {}, b[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) add_element<kPass>(w, mean, i + k, a[k], b[k]);
  }
  for (; i < end; ++i) add_element<kPass>(w, mean, i, a[0], b[0]);
  Sums out;
  for (int64_t k = 0; k < kLanes; ++k) {
    out.a += a[k];
    out.b += b[k];
  }
  return out;
}

template <Pass kPass>
Sums parallel_sums(const WhitenArgs& w, float mean) {
  return at::parallel_reduce(
      0, w.size, kLightGrainSize, Sums{},
      [&](int64_t begin, int64_t end, Sums acc) {
        for (int64_t block = begin; block < end; block += kBlock) {
          const Sums s = block_sums<kPass>(w, mean, block, std::min(end, block + kBlock));
          acc.a += s.a;
          acc.b += s.b;
        }
        return acc;
      },
      [](Sums x, Sums y) { return Sums{x.a + y.a, x.b + y.b}; });
}

}  // namespace

double masked_whiten_stats(const WhitenArgs& w) {
  const Sums first = parallel_sums<Pass::kMean>(w, 0.f);
  const float mean = static_cast<float>(first.b / (first.a + kWhitenEps));
  const Sums second = parallel_sums<Pass::kVariance>(w, mean);
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
  at::parallel_for(0, w.size, kLightGrainSize, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) w.out[i] = (w.x[i] - fmean) * rstd + shift;
  });
}

}  // namespace megatron_rl::cpu
