// CPU kernels behind the raw-pointer argument blocks of kernel_args.h (ATen parallel_for inside).
#pragma once

#include <cstddef>

#include "../kernel_args.h"

namespace megatron_rl::cpu {

// Elements per parallel task for exp-heavy work (the log-prob rows); ATen uses the same.
constexpr int64_t kGrainSize = 32768;
// Elements per parallel task for light streaming work (GAE, whitening, group outputs, the merge): about
// a millisecond on one core. Smaller tasks woke OpenMP threads for too little work: with the cores
// shared by other processes, 2 threads ran 512k-element GAE and whitening 4-10x slower than 1 thread.
constexpr int64_t kLightGrainSize = int64_t(1) << 20;

// Per-row statistics of logits (kRowStats values per row, float or double for fp64 logits).
void log_prob_stats(const LogProbRows& rows, void* stats);
// Merges the per-rank statistics into log-probs, entropy and the saved lse / E[x].
void log_prob_merge(const LogProbMerge& args);
void log_prob_backward(const LogProbGrad& args);
// Name of the instruction set the log-prob kernels run with on this machine ("avx2" or "default").
const char* log_prob_isa();

void masked_gae(const GaeArgs& args);
// Fills args.stats; returns sum(mask) so the caller can refuse fewer than two valid elements.
double masked_whiten_stats(const WhitenArgs& args);
void masked_whiten_apply(const WhitenArgs& args);
void group_normalize(const GroupNormArgs& args);

// Large outputs reuse freed blocks instead of faulting in fresh pages (block_cache.cpp). Smaller ones
// come from torch's allocator: malloc keeps those in its heap already.
constexpr size_t kMinCachedBytes = size_t(4) << 20;
struct CachedBlock {
  void* ptr;     // 64-byte aligned
  size_t bytes;  // >= the bytes asked for
};
CachedBlock take_cached_block(size_t bytes);
// Called when the block's tensor dies; the cache keeps the last two freed blocks.
void give_cached_block(CachedBlock block);
// Frees the kept blocks; returns their bytes.
size_t release_cached_blocks();
// out[r, t] = values[r] * mask[r, t]: a per-response scalar broadcast over the response (GRPO's advantages).
void masked_broadcast(const MaskedBroadcastArgs& args);
// out[r] = sum_t x[r, t] over a contiguous [rows, cols] fp32 block (the responses' outcome scores).
void row_sums(const float* x, int64_t rows, int64_t cols, float* out);

// Implemented in log_probs_avx2.cpp (stubs where the compiler cannot target AVX2).
bool avx2_kernels_compiled();
void log_prob_stats_avx2(const LogProbRows& rows, void* stats);
void log_prob_backward_avx2(const LogProbGrad& args);

}  // namespace megatron_rl::cpu
