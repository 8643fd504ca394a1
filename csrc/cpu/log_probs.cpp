// Log-prob kernels: baseline-ISA build, run-time choice of the AVX2 build, and the cross-rank merge.
#include "cpu_kernels.h"

#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include <ATen/Version.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "log_probs_impl.h"

namespace megatron_rl::cpu {
namespace {

// ATen's own capability probe; it also honours ATEN_CPU_CAPABILITY=default for testing the fallback.
bool use_avx2() {
  static const bool yes = [] {
    const std::string isa = at::get_cpu_capability();
    return avx2_kernels_compiled() && (isa == "AVX2" || isa == "AVX512");
  }();
  return yes;
}

template <typename acc_t>
void merge_rows(const LogProbMerge& m) {
  const auto* stats = static_cast<const acc_t*>(m.stats);
  auto* log_probs = static_cast<acc_t*>(m.log_probs);
  auto* entropy = static_cast<acc_t*>(m.entropy);
  auto* row_max = static_cast<acc_t*>(m.row_max);
  auto* log_sum = static_cast<acc_t*>(m.log_sum);
  at::parallel_for(0, m.rows, kLightGrainSize / 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      RowOutputs<acc_t> o{0, 0, 0, 0};
      if (m.labels[r] != m.ignore_index) {
        RowState<acc_t> merged = empty_row_state<acc_t>();
        acc_t target = -std::numeric_limits<acc_t>::infinity();
        for (int64_t w = 0; w < m.world; ++w) {
          const acc_t* s = stats + (w * m.rows + r) * kRowStats;
          merged = merge_row_states(merged, RowState<acc_t>{s[0], s[1], s[2]});
          target = nan_max(target, s[3]);  // only the owning shard has it finite; NaN is kept
        }
        o = finish_row(merged, target);
      }
      log_probs[r] = o.log_prob;
      entropy[r] = o.entropy;
      row_max[r] = o.max;
      log_sum[r] = o.log_sum;
    }
  });
}

}  // namespace

const char* log_prob_isa() { return use_avx2() ? "avx2" : "default"; }

void log_prob_stats(const LogProbRows& rows, void* stats) {
  if (use_avx2()) return log_prob_stats_avx2(rows, stats);
  DEFAULT::log_prob_stats_impl(rows, stats);
}

void log_prob_backward(const LogProbGrad& args) {
  if (use_avx2()) return log_prob_backward_avx2(args);
  DEFAULT::log_prob_backward_impl(args);
}

void log_prob_merge(const LogProbMerge& args) {
  if (args.is_double) return merge_rows<double>(args);
  merge_rows<float>(args);
}

}  // namespace megatron_rl::cpu
