// Online-softmax row statistics: the merge rule and the final outputs, shared by the CPU kernels
// and the CUDA kernels (host/device inline, no torch types).
//
// A partial state over some columns of a row is (max, sum, wsum) with
//   sum  = sum_j exp(x_j - max)
//   wsum = sum_j exp(x_j - max) * (x_j - max)
// Keeping wsum relative to the running max (instead of sum exp * x) avoids the cancellation
// lse - E[x] would suffer for large logits (|x| ~ 1e4 in fp32).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MRL_HD __host__ __device__ __forceinline__
#else
#define MRL_HD inline
#endif

namespace megatron_rl {

// Lower clamp for x - max: exp() of it is exactly 0 in float and double, and 0 * clamp stays finite
// where x = -inf (0 * -inf would be NaN).
constexpr double kMinLogitGap = -1.0e4;

MRL_HD float exp_acc(float x) { return expf(x); }
MRL_HD double exp_acc(double x) { return exp(x); }
MRL_HD float log_acc(float x) { return logf(x); }
MRL_HD double log_acc(double x) { return log(x); }

template <typename acc_t>
struct RowState {
  acc_t max;
  acc_t sum;
  acc_t wsum;
};

// NaN handling: a NaN logit (or a +inf one, whose x - max is inf - inf) makes the row's log-prob, entropy
// and every gradient NaN, as torch's log_softmax (ops/reference.py) does. fmax / std::max / a clamp with
// fmax DROP a NaN operand, so the kernels use these instead. (Plain comparisons: no -ffast-math here.)
template <typename acc_t>
MRL_HD bool is_nan(acc_t x) {
  return x != x;
}

// max(a, b) that returns NaN when either is NaN.
template <typename acc_t>
MRL_HD acc_t nan_max(acc_t a, acc_t b) {
  return (a > b || is_nan(a)) ? a : b;
}

// max(gap, kMinLogitGap) that lets a NaN gap through (fmax(NaN, floor) would give the floor, exp -> 0).
template <typename acc_t>
MRL_HD acc_t clamp_gap(acc_t gap) {
  return gap < static_cast<acc_t>(kMinLogitGap) ? static_cast<acc_t>(kMinLogitGap) : gap;
}

template <typename acc_t>
MRL_HD RowState<acc_t> nan_row_state() {
  return {static_cast<acc_t>(NAN), static_cast<acc_t>(NAN), static_cast<acc_t>(NAN)};
}

template <typename acc_t>
MRL_HD bool has_nan(const RowState<acc_t>& s) {
  return is_nan(s.max) || is_nan(s.sum) || is_nan(s.wsum);
}

template <typename acc_t>
MRL_HD RowState<acc_t> empty_row_state() {
  return {-static_cast<acc_t>(INFINITY), acc_t(0), acc_t(0)};
}

// Adds partial state `part` to `into`, whose max must already be >= part.max.
template <typename acc_t>
MRL_HD void add_rescaled(RowState<acc_t>& into, const RowState<acc_t>& part) {
  if (!(part.sum > acc_t(0))) return;  // empty partial (all columns -inf or none): nothing to add
  const acc_t gap = part.max - into.max;
  const acc_t scale = exp_acc(gap);
  into.sum += scale * part.sum;
  into.wsum += scale * (part.wsum + gap * part.sum);
}

// Associative merge of two partial states; a NaN in either poisons the result (add_rescaled's
// `sum > 0` test would otherwise skip a NaN partial, and the max would pick the other side's).
template <typename acc_t>
MRL_HD RowState<acc_t> merge_row_states(const RowState<acc_t>& a, const RowState<acc_t>& b) {
  if (has_nan(a) || has_nan(b)) return nan_row_state<acc_t>();
  RowState<acc_t> out{a.max > b.max ? a.max : b.max, acc_t(0), acc_t(0)};
  add_rescaled(out, a);
  add_rescaled(out, b);
  return out;
}

// The log-sum-exp is kept as max + log_sum, never added up: at |x| ~ 1e4 the sum would round to
// fp32's 1e-3 spacing there, while x - max is exact for the values that matter.
template <typename acc_t>
struct RowOutputs {
  acc_t log_prob;
  acc_t entropy;
  acc_t max;
  acc_t log_sum;
};

// log p(target) = (x_t - max) - log_sum; entropy = lse - E[x] = log_sum - wsum / sum.
template <typename acc_t>
MRL_HD RowOutputs<acc_t> finish_row(const RowState<acc_t>& s, acc_t target) {
  const acc_t log_sum = log_acc(s.sum);
  return {(target - s.max) - log_sum, log_sum - s.wsum / s.sum, s.max, log_sum};
}

}  // namespace megatron_rl
