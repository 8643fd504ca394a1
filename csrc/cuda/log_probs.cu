// Vocab-parallel log-prob / entropy on CUDA: forward statistics, cross-rank merge, backward.
//
// Forward and backward give each row one block, which streams the row once with 16-byte loads.
// The forward keeps an online (max, sum, wsum) state per thread, rescaled at most once per pack,
// and merges the threads with a block reduction; nothing of size rows * vocab is written.
#include <cub/block/block_reduce.cuh>

#include <limits>

#include "../row_stats.h"
#include "cuda_kernels.h"
#include "elem_types.cuh"

namespace megatron_rl::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // packs each thread loads before using them: more bytes in flight per SM

template <typename acc_t>
struct MergeStates {
  __device__ RowState<acc_t> operator()(const RowState<acc_t>& a, const RowState<acc_t>& b) const {
    return merge_row_states(a, b);
  }
};

template <typename acc_t>
struct ThreadState {
  RowState<acc_t> s = empty_row_state<acc_t>();

  // Adds n values (already scaled by 1/T) whose maximum is `local_max`.
  template <int n>
  __device__ __forceinline__ void add(const acc_t (&x)[n], acc_t local_max) {
    if (is_nan(s.max)) return;  // poisoned by an earlier NaN: the row stays NaN
    if (is_nan(local_max)) {    // a NaN logit: the row's outputs and gradients are NaN (reference.py)
      s = nan_row_state<acc_t>();
      return;
    }
    if (local_max == -static_cast<acc_t>(INFINITY)) return;  // all -inf: contributes nothing
    if (local_max > s.max) {
      RowState<acc_t> rescaled{local_max, acc_t(0), acc_t(0)};
      add_rescaled(rescaled, s);
      s = rescaled;
    }
#pragma unroll
    for (int k = 0; k < n; ++k) {
      const acc_t gap = clamp_gap(x[k] - s.max);  // +inf - +inf = NaN passes: a +inf logit gives NaN
      const acc_t e = fast_exp(gap);
      s.sum += e;
      s.wsum += e * gap;
    }
  }

  template <typename scalar_t, int n>
  __device__ __forceinline__ void add_raw(const scalar_t* v, acc_t scale) {
    acc_t x[n];
    acc_t local_max = -static_cast<acc_t>(INFINITY);
#pragma unroll
    for (int k = 0; k < n; ++k) {
      x[k] = to_acc(v[k]) * scale;
      local_max = nan_max(local_max, x[k]);  // fmax would drop a NaN
    }
    add(x, local_max);
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) row_stats_kernel(LogProbRows a, acc_t<scalar_t>* stats) {
  using acc = acc_t<scalar_t>;
  using P = Pack<scalar_t>;
  const int64_t r = blockIdx.x;
  acc* out = stats + r * kRowStats;
  const int64_t label = a.labels[r];
  if (label == a.ignore_index) {  // the merge writes 0 for these rows; skip the read
    if (threadIdx.x < kRowStats) out[threadIdx.x] = acc(0);
    return;
  }
  const scalar_t* row = static_cast<const scalar_t*>(a.logits) + r * a.row_stride;
  const acc scale = static_cast<acc>(a.inv_temperature);
  ThreadState<acc> state;
  int64_t tail_start = 0;
  if (aligned16(row)) {
    const P* packs = reinterpret_cast<const P*>(row);
    const int64_t n_packs = a.valid_width / P::kSize;
    for (int64_t base = threadIdx.x; base < n_packs; base += int64_t(kThreads) * kUnroll) {
      P loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + int64_t(u) * kThreads;
        if (i < n_packs) loaded[u] = packs[i];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + int64_t(u) * kThreads < n_packs) state.template add_raw<scalar_t, P::kSize>(loaded[u].v, scale);
      }
    }
    tail_start = n_packs * P::kSize;
  }
  for (int64_t j = tail_start + threadIdx.x; j < a.valid_width; j += kThreads) {
    state.template add_raw<scalar_t, 1>(row + j, scale);
  }

  using Reduce = cub::BlockReduce<RowState<acc>, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const RowState<acc> merged = Reduce(temp).Reduce(state.s, MergeStates<acc>{});
  if (threadIdx.x == 0) {
    const int64_t col = label - a.vocab_start;
    const bool owned = col >= 0 && col < a.valid_width;
    out[0] = merged.max;
    out[1] = merged.sum;
    out[2] = merged.wsum;
    out[3] = owned ? to_acc(row[col]) * scale : -static_cast<acc>(INFINITY);
  }
}

template <typename acc>
__global__ void merge_kernel(LogProbMerge m) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= m.rows) return;
  RowOutputs<acc> o{acc(0), acc(0), acc(0), acc(0)};
  if (m.labels[r] != m.ignore_index) {
    const acc* stats = static_cast<const acc*>(m.stats);
    RowState<acc> merged = empty_row_state<acc>();
    acc target = -static_cast<acc>(INFINITY);
    for (int64_t w = 0; w < m.world; ++w) {
      const acc* s = stats + (w * m.rows + r) * kRowStats;
      merged = merge_row_states(merged, RowState<acc>{s[0], s[1], s[2]});
      target = nan_max(target, s[3]);  // only the owning shard has it finite; NaN is kept
    }
    o = finish_row(merged, target);
  }
  static_cast<acc*>(m.log_probs)[r] = o.log_prob;
  static_cast<acc*>(m.entropy)[r] = o.entropy;
  static_cast<acc*>(m.row_max)[r] = o.max;
  static_cast<acc*>(m.log_sum)[r] = o.log_sum;
}

// d x_j of (g_lp * log p_t + g_h * entropy), x = logit / T:
//   g_lp * ([j == t] - p_j) + g_h * p_j * (E[x] - x_j),  then times 1/T for the logit.
// With gap_j = x_j - lse = log p_j and E[x] - lse = -entropy this is
//   p_j * (base - g_h * gap_j) + g_lp * [j == t],  base = -g_h * entropy - g_lp.
template <typename acc>
struct RowGrad {
  acc row_max, log_sum, scale, gh, base, target_term;
  int64_t target_col, valid_width;

  __device__ __forceinline__ acc operator()(acc logit, int64_t col) const {
    if (col >= valid_width) return acc(0);  // padded vocabulary: outside the softmax
    const acc gap = clamp_gap(logit * scale - row_max - log_sum);  // NaN logit / NaN row stats: NaN
    acc g = scale * fast_exp(gap) * (base - gh * gap);
    if (col == target_col) g += target_term;
    return g;
  }
};

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) row_grads_kernel(LogProbGrad g) {
  using acc = acc_t<scalar_t>;
  using P = Pack<scalar_t>;
  const LogProbRows& a = g.in;
  const int64_t r = blockIdx.x;
  const scalar_t* row = static_cast<const scalar_t*>(a.logits) + r * a.row_stride;
  scalar_t* out = static_cast<scalar_t*>(g.grad_logits) + r * a.width;
  const acc glp = g.grad_log_probs ? static_cast<const acc*>(g.grad_log_probs)[r] : acc(0);
  const acc gh = g.grad_entropy ? static_cast<const acc*>(g.grad_entropy)[r] : acc(0);
  const acc entropy = static_cast<const acc*>(g.entropy)[r];
  const acc scale = static_cast<acc>(a.inv_temperature);
  const bool silent = a.labels[r] == a.ignore_index || (glp == acc(0) && gh == acc(0));
  const RowGrad<acc> grad{static_cast<const acc*>(g.row_max)[r],
                          static_cast<const acc*>(g.log_sum)[r],
                          scale,
                          gh,
                          -gh * entropy - glp,
                          scale * glp,
                          a.labels[r] - a.vocab_start,
                          silent ? 0 : a.valid_width};  // silent rows: every column gives 0

  int64_t tail_start = 0;
  if (aligned16(row) && aligned16(out)) {
    const P* in_packs = reinterpret_cast<const P*>(row);
    P* out_packs = reinterpret_cast<P*>(out);
    const int64_t n_packs = a.width / P::kSize;
    for (int64_t base = threadIdx.x; base < n_packs; base += int64_t(kThreads) * kUnroll) {
      P loaded[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + int64_t(u) * kThreads;
        loaded[u] = P{};
        if (i < n_packs && i * P::kSize < grad.valid_width) loaded[u] = in_packs[i];  // padded: no read
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + int64_t(u) * kThreads;
        if (i >= n_packs) continue;
        P res;
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) res.v[k] = from_acc<scalar_t>(grad(to_acc(loaded[u].v[k]), i * P::kSize + k));
        out_packs[i] = res;
      }
    }
    tail_start = n_packs * P::kSize;
  }
  for (int64_t j = tail_start + threadIdx.x; j < a.width; j += kThreads) {
    out[j] = from_acc<scalar_t>(j < grad.valid_width ? grad(to_acc(row[j]), j) : acc(0));  // no read past it
  }
}

}  // namespace

cudaError_t log_prob_stats(const LogProbRows& a, void* stats, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.rows)), block(kThreads);
  switch (a.dtype) {
    case ElemType::kFloat32:
      row_stats_kernel<float><<<grid, block, 0, stream>>>(a, static_cast<float*>(stats));
      break;
    case ElemType::kFloat16:
      row_stats_kernel<__half><<<grid, block, 0, stream>>>(a, static_cast<float*>(stats));
      break;
    case ElemType::kBFloat16:
      row_stats_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(a, static_cast<float*>(stats));
      break;
    case ElemType::kFloat64:
      row_stats_kernel<double><<<grid, block, 0, stream>>>(a, static_cast<double*>(stats));
      break;
  }
  return cudaGetLastError();
}

cudaError_t log_prob_merge(const LogProbMerge& m, cudaStream_t stream) {
  const int threads = 256;
  const dim3 grid(static_cast<unsigned>((m.rows + threads - 1) / threads));
  if (m.is_double) {
    merge_kernel<double><<<grid, threads, 0, stream>>>(m);
  } else {
    merge_kernel<float><<<grid, threads, 0, stream>>>(m);
  }
  return cudaGetLastError();
}

cudaError_t log_prob_backward(const LogProbGrad& g, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(g.in.rows)), block(kThreads);
  switch (g.in.dtype) {
    case ElemType::kFloat32: row_grads_kernel<float><<<grid, block, 0, stream>>>(g); break;
    case ElemType::kFloat16: row_grads_kernel<__half><<<grid, block, 0, stream>>>(g); break;
    case ElemType::kBFloat16: row_grads_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(g); break;
    case ElemType::kFloat64: row_grads_kernel<double><<<grid, block, 0, stream>>>(g); break;
  }
  return cudaGetLastError();
}

}  // namespace megatron_rl::cuda
