// Masked whitening on CUDA: two grid-wide reductions (double atomics), then one elementwise pass.
#include <cub/block/block_reduce.cuh>

#include "cuda_kernels.h"

namespace megatron_rl::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // grid-stride beyond this: enough to fill any current GPU
constexpr double kWhitenEps = 1e-8;

__device__ __forceinline__ double masked_mean(const double* stats) { return stats[1] / (stats[0] + kWhitenEps); }

// kPass 0: stats[0] += sum m, stats[1] += sum m*x.  kPass 1: stats[2] += sum m*(x - mean)^2.
// A zero mask weight drops the element entirely, so NaNs outside the mask do not leak in.
template <int kPass>
__global__ void __launch_bounds__(kThreads) whiten_sums_kernel(WhitenArgs w) {
  const float mean = kPass == 1 ? static_cast<float>(masked_mean(w.stats)) : 0.f;
  double a = 0.0, b = 0.0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < w.size; i += int64_t(gridDim.x) * kThreads) {
    const float m = w.mask[i];
    if (m == 0.f) continue;
    if constexpr (kPass == 0) {
      a += m;
      b += m * w.x[i];
    } else {
      const float d = w.x[i] - mean;
      a += m * d * d;
    }
  }
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const double block_a = Reduce(temp).Sum(a);
  if constexpr (kPass == 0) {
    __syncthreads();  // temp storage is reused
    const double block_b = Reduce(temp).Sum(b);
    if (threadIdx.x == 0) {
      atomicAdd(w.stats + 0, block_a);
      atomicAdd(w.stats + 1, block_b);
    }
  } else if (threadIdx.x == 0) {
    atomicAdd(w.stats + 2, block_a);
  }
}

__global__ void whiten_apply_kernel(WhitenArgs w) {
  const double count = w.stats[0];
  const double var = w.stats[2] / (count + kWhitenEps) * (count / (count - 1.0));  // unbiased
  const float mean = static_cast<float>(masked_mean(w.stats));
  const float rstd = static_cast<float>(rsqrt(var + kWhitenEps));
  const float shift = w.shift_mean ? 0.f : mean;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < w.size; i += int64_t(gridDim.x) * blockDim.x) {
    w.out[i] = (w.x[i] - mean) * rstd + shift;
  }
}

unsigned blocks_for(int64_t size) {
  const int64_t blocks = (size + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace

cudaError_t masked_whiten_stats(const WhitenArgs& w, double* host_count, cudaStream_t stream) {
  whiten_sums_kernel<0><<<blocks_for(w.size), kThreads, 0, stream>>>(w);
  whiten_sums_kernel<1><<<blocks_for(w.size), kThreads, 0, stream>>>(w);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cudaMemcpyAsync(host_count, w.stats, sizeof(double), cudaMemcpyDeviceToHost, stream);
  if (err != cudaSuccess) return err;
  return cudaStreamSynchronize(stream);
}

cudaError_t masked_whiten_apply(const WhitenArgs& w, cudaStream_t stream) {
  whiten_apply_kernel<<<blocks_for(w.size), kThreads, 0, stream>>>(w);
  return cudaGetLastError();
}

}  // namespace megatron_rl::cuda
