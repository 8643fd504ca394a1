// Group-normalised advantages on CUDA: two scatter passes of double atomics into per-group
// (count, sum, sum of squared deviations), then one elementwise pass. No sort, no loop over groups.
#include "../group_norm_math.h"
#include "cuda_kernels.h"

namespace megatron_rl::cuda {
namespace {

constexpr int kThreads = 256;

template <int kPass>
__global__ void group_sums_kernel(GroupNormArgs a) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i >= a.size) return;
  double* g = a.workspace + a.group_index[i] * 3;
  if constexpr (kPass == 0) {
    atomicAdd(g + 0, 1.0);
    atomicAdd(g + 1, static_cast<double>(a.scores[i]));
  } else {
    const double d = a.scores[i] - g[1] / g[0];
    atomicAdd(g + 2, d * d);
  }
}

__global__ void group_output_kernel(GroupNormArgs a) {
  const int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (i >= a.size) return;
  a.out[i] = group_advantage(a.scores[i], a.workspace + a.group_index[i] * 3, a.mode, a.epsilon);
}

}  // namespace

cudaError_t group_normalize(const GroupNormArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.size + kThreads - 1) / kThreads);
  group_sums_kernel<0><<<blocks, kThreads, 0, stream>>>(a);
  group_sums_kernel<1><<<blocks, kThreads, 0, stream>>>(a);
  group_output_kernel<<<blocks, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace megatron_rl::cuda
