// Log-prob forward statistics and backward for one CPU instruction set.
//
// Included by log_probs.cpp (baseline ISA) and log_probs_avx2.cpp (AVX2+FMA) after <ATen/cpu/vec/vec.h>
// with CPU_CAPABILITY set, so the at::vec::Vectorized types and these kernels land in a namespace named
// after the instruction set (as ATen does for its own kernels). Not a standalone header.
//
// Each row is read once per direction: the forward streams it in L1-sized chunks, taking each chunk's
// max first and rescaling the running sums at most once per chunk, so one exp per element suffices.

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <type_traits>

#include "../kernel_args.h"
#include "../row_stats.h"

namespace megatron_rl::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

constexpr int64_t kChunk = 2048;  // elements per chunk: 8 KiB of fp32, stays in L1 between the two sweeps

inline int64_t rows_per_task(const LogProbRows& a) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, a.width));
}

// Returns the chunk as accumulator values: the input itself when it already is, else `buf` filled.
template <typename scalar_t, typename acc_t>
const acc_t* chunk_as_acc(const scalar_t* src, int64_t n, acc_t* buf) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

// Lane-wise online softmax state over a row, fed chunk by chunk.
template <typename acc_t>
struct OnlineRow {
  using Vec = Vectorized<acc_t>;
  acc_t max = -std::numeric_limits<acc_t>::infinity();
  Vec sum = Vec(acc_t(0));
  Vec wsum = Vec(acc_t(0));

  void add_chunk(const acc_t* raw, int64_t n, acc_t scale) {
    if (is_nan(max)) return;  // poisoned by an earlier NaN: the row stays NaN
    // at::vec::maximum propagates NaN (unlike std::max), so a NaN logit makes chunk_max NaN.
    const acc_t chunk_max =
        at::vec::reduce_all<acc_t>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, raw, n) * scale;
    if (is_nan(chunk_max)) {
      max = chunk_max;
      sum = Vec(chunk_max);
      wsum = Vec(chunk_max);
      return;
    }
    if (chunk_max == -std::numeric_limits<acc_t>::infinity()) return;
    if (chunk_max > max) {
      if (max != -std::numeric_limits<acc_t>::infinity()) {
        const acc_t gap = max - chunk_max;
        const Vec rescale(exp_acc(gap));
        wsum = rescale * (wsum + Vec(gap) * sum);
        sum = sum * rescale;
      }
      max = chunk_max;
    }
    const Vec vmax(max), vscale(scale), floor(static_cast<acc_t>(kMinLogitGap));
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      const Vec gap = at::vec::maximum(Vec::loadu(raw + i) * vscale - vmax, floor);
      const Vec e = gap.exp_u20();
      sum = sum + e;
      wsum = at::vec::fmadd(e, gap, wsum);
    }
    if (i < n) {
      const int64_t rest = n - i;
      const Vec gap = Vec::set(Vec(acc_t(0)), at::vec::maximum(Vec::loadu(raw + i, rest) * vscale - vmax, floor), rest);
      const Vec e = Vec::set(Vec(acc_t(0)), gap.exp_u20(), rest);
      sum = sum + e;
      wsum = at::vec::fmadd(e, gap, wsum);
    }
  }

  RowState<acc_t> state() const {
    auto add = [](Vec a, Vec b) { return a + b; };
    return {max, at::vec::vec_reduce_all<acc_t>(add, sum), at::vec::vec_reduce_all<acc_t>(add, wsum)};
  }
};

template <typename scalar_t, typename acc_t>
acc_t target_logit(const scalar_t* row, int64_t label, const LogProbRows& a) {
  const int64_t col = label - a.vocab_start;
  if (col < 0 || col >= a.valid_width) return -std::numeric_limits<acc_t>::infinity();
  return static_cast<acc_t>(row[col]) * static_cast<acc_t>(a.inv_temperature);
}

template <typename scalar_t, typename acc_t>
void row_stats(const LogProbRows& a, acc_t* stats) {
  const auto* logits = static_cast<const scalar_t*>(a.logits);
  const acc_t scale = static_cast<acc_t>(a.inv_temperature);
  at::parallel_for(0, a.rows, rows_per_task(a), [&](int64_t begin, int64_t end) {
    acc_t buf[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      acc_t* out = stats + r * kRowStats;
      if (a.labels[r] == a.ignore_index) {  // the merge writes 0 for these rows; skip the read
        std::fill(out, out + kRowStats, acc_t(0));
        continue;
      }
      const scalar_t* row = logits + r * a.row_stride;
      OnlineRow<acc_t> online;
      for (int64_t c = 0; c < a.valid_width; c += kChunk) {
        const int64_t n = std::min(kChunk, a.valid_width - c);
        online.add_chunk(chunk_as_acc(row + c, n, buf), n, scale);
      }
      const RowState<acc_t> s = online.state();
      out[0] = s.max;
      out[1] = s.sum;
      out[2] = s.wsum;
      out[3] = target_logit<scalar_t, acc_t>(row, a.labels[r], a);
    }
  });
}

// d x_j of (g_lp * log p_t + g_h * entropy), x = logit / T:
//   g_lp * ([j == t] - p_j) + g_h * p_j * (E[x] - x_j),  then times 1/T for the logit.
// With gap_j = x_j - lse = log p_j and E[x] - lse = -entropy this is
//   p_j * (base - g_h * gap_j) + g_lp * [j == t],  base = -g_h * entropy - g_lp.
template <typename scalar_t, typename acc_t>
void row_grads(const LogProbGrad& g) {
  using Vec = Vectorized<acc_t>;
  const LogProbRows& a = g.in;
  const auto* logits = static_cast<const scalar_t*>(a.logits);
  auto* grads = static_cast<scalar_t*>(g.grad_logits);
  const auto* row_max = static_cast<const acc_t*>(g.row_max);
  const auto* log_sum = static_cast<const acc_t*>(g.log_sum);
  const auto* entropy = static_cast<const acc_t*>(g.entropy);
  const auto* grad_lp = static_cast<const acc_t*>(g.grad_log_probs);
  const auto* grad_h = static_cast<const acc_t*>(g.grad_entropy);
  const acc_t scale = static_cast<acc_t>(a.inv_temperature);
  at::parallel_for(0, a.rows, rows_per_task(a), [&](int64_t begin, int64_t end) {
    acc_t in_buf[kChunk];
    acc_t out_buf[kChunk];
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* out = grads + r * a.width;
      const acc_t glp = grad_lp ? grad_lp[r] : acc_t(0);
      const acc_t gh = grad_h ? grad_h[r] : acc_t(0);
      if (a.labels[r] == a.ignore_index || (glp == acc_t(0) && gh == acc_t(0))) {
        std::fill(out, out + a.width, scalar_t(0));
        continue;
      }
      const scalar_t* row = logits + r * a.row_stride;
      const int64_t target_col = a.labels[r] - a.vocab_start;
      const Vec vmax(row_max[r]), vlog_sum(log_sum[r]), vscale(scale), vgh(gh), vbase(-gh * entropy[r] - glp),
          floor(static_cast<acc_t>(kMinLogitGap));
      for (int64_t c = 0; c < a.valid_width; c += kChunk) {
        const int64_t n = std::min(kChunk, a.valid_width - c);
        const acc_t* x = chunk_as_acc(row + c, n, in_buf);
        acc_t* dst = out_buf;
        if constexpr (std::is_same_v<scalar_t, acc_t>) dst = out + c;
        for (int64_t i = 0; i < n; i += Vec::size()) {
          const int64_t lanes = std::min<int64_t>(Vec::size(), n - i);
          const Vec gap = at::vec::maximum(Vec::loadu(x + i, lanes) * vscale - vmax - vlog_sum, floor);
          const Vec grad = gap.exp_u20() * (vbase - vgh * gap) * vscale;
          grad.store(dst + i, lanes);
        }
        if (target_col >= c && target_col < c + n) dst[target_col - c] += glp * scale;
        if constexpr (!std::is_same_v<scalar_t, acc_t>) at::vec::convert(out_buf, out + c, n);
      }
      std::fill(out + a.valid_width, out + a.width, scalar_t(0));  // padded vocab: outside the softmax
    }
  });
}

inline void log_prob_stats_impl(const LogProbRows& a, void* stats) {
  switch (a.dtype) {
    case ElemType::kFloat32: return row_stats<float, float>(a, static_cast<float*>(stats));
    case ElemType::kFloat16: return row_stats<c10::Half, float>(a, static_cast<float*>(stats));
    case ElemType::kBFloat16: return row_stats<c10::BFloat16, float>(a, static_cast<float*>(stats));
    case ElemType::kFloat64: return row_stats<double, double>(a, static_cast<double*>(stats));
  }
}

inline void log_prob_backward_impl(const LogProbGrad& g) {
  switch (g.in.dtype) {
    case ElemType::kFloat32: return row_grads<float, float>(g);
    case ElemType::kFloat16: return row_grads<c10::Half, float>(g);
    case ElemType::kBFloat16: return row_grads<c10::BFloat16, float>(g);
    case ElemType::kFloat64: return row_grads<double, double>(g);
  }
}

}  // namespace megatron_rl::cpu::CPU_CAPABILITY
