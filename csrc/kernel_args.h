// Plain-C++ argument blocks shared by the CPU kernels, the CUDA launchers and bindings.cpp.
// No torch or CUDA types here, so nvcc and the host compiler both accept this header anywhere.
#pragma once

#include <cstdint>

namespace megatron_rl {

enum class ElemType : int { kFloat32, kFloat16, kBFloat16, kFloat64 };

// A [rows, width] block of (possibly vocab-parallel) logits whose last dim is contiguous.
// Statistics and gradients are accumulated in double for kFloat64 logits, in float otherwise.
struct LogProbRows {
  const void* logits;
  ElemType dtype;
  int64_t rows;
  int64_t width;        // columns held by this rank (V_local)
  int64_t row_stride;   // elements between consecutive rows
  const int64_t* labels;  // [rows] global token ids
  int64_t vocab_start;  // global id of local column 0 (tp_rank * V_local)
  int64_t valid_width;  // columns [valid_width, width) are vocabulary padding: outside the softmax
  double inv_temperature;
  int64_t ignore_index;
};

// Per-row statistics of one vocabulary shard, packed as 4 accumulator values per row:
// max of x, sum exp(x - max), sum exp(x - max) * (x - max), target x (-inf when the target
// column is not in this shard), where x = logit * inv_temperature.
constexpr int kRowStats = 4;

// Merged statistics -> outputs. `stats` is [world, rows, 4]; outputs are [rows] in the accumulator type.
struct LogProbMerge {
  const void* stats;
  bool is_double;
  int64_t world;
  int64_t rows;
  const int64_t* labels;
  int64_t ignore_index;
  void* log_probs;
  void* entropy;
  void* row_max;  // with log_sum, the log-sum-exp saved for backward
  void* log_sum;
};

// Backward: grad_logits [rows, width] contiguous, same dtype as the logits.
struct LogProbGrad {
  LogProbRows in;
  const void* row_max;  // from the forward merge
  const void* log_sum;
  const void* entropy;
  const void* grad_log_probs;  // may be null (no gradient)
  const void* grad_entropy;    // may be null
  void* grad_logits;
};

struct GaeArgs {  // all [batch, steps] fp32 contiguous
  const float* rewards;
  const float* values;
  const float* mask;
  int64_t batch;
  int64_t steps;
  double gamma;
  double lam;
  float* advantages;
  float* returns;
};

// Masked whitening over all elements; `stats` holds (sum m, sum x*m, sum m*(x-mean)^2) in double.
struct WhitenArgs {
  const float* x;
  const float* mask;
  int64_t size;
  bool shift_mean;
  double* stats;
  float* out;
};

enum class GroupMode : int { kGrpo = 0, kGrpoMean = 1, kRloo = 2 };

// `workspace` is [num_groups, 3] double, zero-filled: (count, sum, sum of squared deviations).
struct GroupNormArgs {
  const float* scores;
  const int64_t* group_index;
  int64_t size;
  int64_t num_groups;
  GroupMode mode;
  double epsilon;
  double* workspace;
  float* out;
};

// [rows] fp32 values times a [rows, cols] fp32 or bool mask, into [rows, cols] fp32; all contiguous.
struct MaskedBroadcastArgs {
  const float* values;
  const void* mask;
  bool mask_is_bool;
  int64_t rows;
  int64_t cols;
  float* out;
};

}  // namespace megatron_rl
