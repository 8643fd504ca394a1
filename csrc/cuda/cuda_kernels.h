// Raw-pointer CUDA launchers (no torch types): every pointer is device memory, every launch goes to
// `stream`, and each returns the launch status so the caller can raise with the message.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../kernel_args.h"

namespace megatron_rl::cuda {

// One block per row: per-row statistics ([rows, 4], float; double for fp64 logits).
cudaError_t log_prob_stats(const LogProbRows& rows, void* stats, cudaStream_t stream);
cudaError_t log_prob_merge(const LogProbMerge& args, cudaStream_t stream);
cudaError_t log_prob_backward(const LogProbGrad& args, cudaStream_t stream);

// Floats of device workspace masked_gae needs for this shape (0 when one segment per row suffices).
int64_t masked_gae_workspace_floats(int64_t batch, int64_t steps);
cudaError_t masked_gae(const GaeArgs& args, float* workspace, cudaStream_t stream);

// Fills args.stats (device, zeroed by the caller) and copies sum(mask) to *host_count (synchronises
// `stream`: the caller must refuse fewer than two valid elements before applying).
cudaError_t masked_whiten_stats(const WhitenArgs& args, double* host_count, cudaStream_t stream);
cudaError_t masked_whiten_apply(const WhitenArgs& args, cudaStream_t stream);

cudaError_t group_normalize(const GroupNormArgs& args, cudaStream_t stream);

}  // namespace megatron_rl::cuda
