// The only translation unit that sees torch: validates tensors, converts them to the raw argument
// blocks of kernel_args.h, picks the CPU or CUDA kernels and registers everything as torch ops
// (namespace `megatron_rl`, so torch.compile and fake tensors can see them; fake kernels live in
// megatron_rl/ops/_extension.py).
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/cpu_kernels.h"
#include "kernel_args.h"

#ifdef MEGATRON_RL_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_kernels.h"
#endif

namespace megatron_rl {
namespace {

using at::Tensor;

ElemType elem_type(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return ElemType::kFloat32;
    case at::kHalf: return ElemType::kFloat16;
    case at::kBFloat16: return ElemType::kBFloat16;
    case at::kDouble: return ElemType::kFloat64;
    default: TORCH_CHECK_TYPE(false, name, " must be float32/float16/bfloat16/float64, got ", t.scalar_type());
  }
}

// Statistics and outputs are fp64 for fp64 logits (gradcheck), fp32 otherwise.
at::ScalarType acc_type(const Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_same_device(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " is on ", a.device(), " but ", b_name, " is on ", b.device());
}

// [n] int64 contiguous labels / group ids; int32 is widened.
Tensor as_index_vector(const Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, name,
                   " must be int64 or int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n, name, " must have shape [", n, "], got ", t.sizes());
  return t.to(at::kLong).contiguous();
}

Tensor as_float_contiguous(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  return t.to(at::kFloat).contiguous();
}

// Logits with a contiguous last dim; any row stride is fine (no copy for a row slice of a batch).
Tensor rows_view(const Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "logits must be [rows, vocab], got ", logits.sizes());
  return logits.stride(1) == 1 ? logits : logits.contiguous();
}

LogProbRows make_rows(const Tensor& logits, const Tensor& labels, int64_t vocab_start, int64_t valid_width,
                      double inv_temperature, int64_t ignore_index) {
  TORCH_CHECK_VALUE(valid_width >= 0 && valid_width <= logits.size(1), "valid_width must be in [0, ",
                    logits.size(1), "], got ", valid_width);
  TORCH_CHECK_VALUE(inv_temperature > 0, "inv_temperature must be positive, got ", inv_temperature);
  return LogProbRows{logits.data_ptr(), elem_type(logits, "logits"), logits.size(0), logits.size(1),
                     logits.stride(0), labels.data_ptr<int64_t>(), vocab_start, valid_width,
                     inv_temperature, ignore_index};
}

// A large output in a block kept from an earlier step (cpu/block_cache.cpp), a small one from torch.
Tensor cpu_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(shape)) * options.dtype().itemsize();
  if (bytes < cpu::kMinCachedBytes) return at::empty(shape, options);
  const cpu::CachedBlock block = cpu::take_cached_block(bytes);
  return at::from_blob(block.ptr, shape, [block](void*) { cpu::give_cached_block(block); }, options);
}

struct CpuKernels {
  struct Guard {
    explicit Guard(const at::Device&) {}
  };
  static Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& o) { return cpu_output(shape, o); }
  static void log_prob_stats(const LogProbRows& r, void* stats) { cpu::log_prob_stats(r, stats); }
  static void log_prob_merge(const LogProbMerge& m) { cpu::log_prob_merge(m); }
  static void log_prob_backward(const LogProbGrad& g) { cpu::log_prob_backward(g); }
  static void masked_gae(const GaeArgs& a, const Tensor&) { cpu::masked_gae(a); }
  static int64_t gae_workspace_floats(int64_t, int64_t) { return 0; }
  static double masked_whiten_stats(const WhitenArgs& w) { return cpu::masked_whiten_stats(w); }
  static void masked_whiten_apply(const WhitenArgs& w) { cpu::masked_whiten_apply(w); }
  static void group_normalize(const GroupNormArgs& a) { cpu::group_normalize(a); }
};

#ifdef MEGATRON_RL_WITH_CUDA
void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}
cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

struct CudaKernels {
  using Guard = c10::cuda::CUDAGuard;  // launch on the tensors' device and its current stream
  static Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions& o) { return at::empty(shape, o); }
  static void log_prob_stats(const LogProbRows& r, void* s) { check_cuda(cuda::log_prob_stats(r, s, stream()), "log_prob_stats"); }
  static void log_prob_merge(const LogProbMerge& m) { check_cuda(cuda::log_prob_merge(m, stream()), "log_prob_merge"); }
  static void log_prob_backward(const LogProbGrad& g) { check_cuda(cuda::log_prob_backward(g, stream()), "log_prob_backward"); }
  static void masked_gae(const GaeArgs& a, const Tensor& ws) {
    check_cuda(cuda::masked_gae(a, ws.data_ptr<float>(), stream()), "masked_gae");
  }
  static int64_t gae_workspace_floats(int64_t batch, int64_t steps) { return cuda::masked_gae_workspace_floats(batch, steps); }
  static double masked_whiten_stats(const WhitenArgs& w) {
    double count = 0;
    check_cuda(cuda::masked_whiten_stats(w, &count, stream()), "masked_whiten_stats");
    return count;
  }
  static void masked_whiten_apply(const WhitenArgs& w) { check_cuda(cuda::masked_whiten_apply(w, stream()), "masked_whiten_apply"); }
  static void group_normalize(const GroupNormArgs& a) { check_cuda(cuda::group_normalize(a, stream()), "group_normalize"); }
};
#endif

// ---- ops ----------------------------------------------------------------------------------------

template <typename K>
Tensor log_prob_stats(const Tensor& logits_in, const Tensor& labels_in, int64_t vocab_start, int64_t valid_width,
                      double inv_temperature, int64_t ignore_index) {
  check_same_device(logits_in, "logits", labels_in, "labels");
  const typename K::Guard guard(logits_in.device());
  const Tensor logits = rows_view(logits_in);
  const Tensor labels = as_index_vector(labels_in, logits.size(0), "labels");
  const LogProbRows rows = make_rows(logits, labels, vocab_start, valid_width, inv_temperature, ignore_index);
  Tensor stats = at::empty({logits.size(0), kRowStats}, logits.options().dtype(acc_type(logits)));
  if (rows.rows > 0) K::log_prob_stats(rows, stats.data_ptr());
  return stats;
}

template <typename K>
std::tuple<Tensor, Tensor, Tensor, Tensor> log_prob_merge(const Tensor& stats_in, const Tensor& labels_in,
                                                         int64_t ignore_index) {
  check_same_device(stats_in, "stats", labels_in, "labels");
  const typename K::Guard guard(stats_in.device());
  TORCH_CHECK_VALUE(stats_in.dim() == 3 && stats_in.size(2) == kRowStats,
                    "stats must be [world, rows, 4], got ", stats_in.sizes());
  TORCH_CHECK_TYPE(stats_in.scalar_type() == at::kFloat || stats_in.scalar_type() == at::kDouble,
                   "stats must be float32 or float64, got ", stats_in.scalar_type());
  const Tensor stats = stats_in.contiguous();
  const int64_t rows = stats.size(1);
  const Tensor labels = as_index_vector(labels_in, rows, "labels");
  auto make = [&] { return at::empty({rows}, stats.options()); };
  Tensor log_probs = make(), entropy = make(), row_max = make(), log_sum = make();
  if (rows > 0) {
    K::log_prob_merge(LogProbMerge{stats.data_ptr(), stats.scalar_type() == at::kDouble, stats.size(0), rows,
                                   labels.data_ptr<int64_t>(), ignore_index, log_probs.data_ptr(),
                                   entropy.data_ptr(), row_max.data_ptr(), log_sum.data_ptr()});
  }
  return {log_probs, entropy, row_max, log_sum};
}

// An optional upstream gradient as a contiguous [rows] tensor of the accumulator type, or nullptr.
const void* grad_ptr(const std::optional<Tensor>& grad, Tensor& holder, int64_t rows, at::ScalarType acc,
                     const char* name) {
  if (!grad.has_value() || !grad->defined()) return nullptr;
  TORCH_CHECK_VALUE(grad->dim() == 1 && grad->size(0) == rows, name, " must be [", rows, "], got ", grad->sizes());
  holder = grad->to(acc).contiguous();
  return holder.data_ptr();
}

template <typename K>
Tensor log_prob_backward(const Tensor& logits_in, const Tensor& labels_in, const Tensor& row_max_in,
                         const Tensor& log_sum_in, const Tensor& entropy_in,
                         const std::optional<Tensor>& grad_log_probs,
                         const std::optional<Tensor>& grad_entropy, int64_t vocab_start, int64_t valid_width,
                         double inv_temperature, int64_t ignore_index) {
  check_same_device(logits_in, "logits", labels_in, "labels");
  const typename K::Guard guard(logits_in.device());
  const Tensor logits = rows_view(logits_in);
  const int64_t rows = logits.size(0);
  const at::ScalarType acc = acc_type(logits);
  const Tensor labels = as_index_vector(labels_in, rows, "labels");
  auto saved = [&](const Tensor& t, const char* name) {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows, name, " must be [", rows, "], got ", t.sizes());
    return t.to(acc).contiguous();
  };
  const Tensor row_max = saved(row_max_in, "row_max"), log_sum = saved(log_sum_in, "log_sum"),
               entropy = saved(entropy_in, "entropy");
  Tensor glp_holder, gh_holder;
  LogProbGrad g{make_rows(logits, labels, vocab_start, valid_width, inv_temperature, ignore_index),
                row_max.data_ptr(), log_sum.data_ptr(), entropy.data_ptr(),
                grad_ptr(grad_log_probs, glp_holder, rows, acc, "grad_log_probs"),
                grad_ptr(grad_entropy, gh_holder, rows, acc, "grad_entropy"), nullptr};
  Tensor grad_logits = K::empty_output({rows, logits.size(1)}, logits.options());
  g.grad_logits = grad_logits.data_ptr();
  if (rows > 0) K::log_prob_backward(g);
  return grad_logits;
}

template <typename K>
std::tuple<Tensor, Tensor> masked_gae(const Tensor& rewards_in, const Tensor& values_in, const Tensor& mask_in,
                                      double gamma, double lam) {
  TORCH_CHECK_VALUE(rewards_in.dim() == 2, "token_level_rewards must be [B, T], got ", rewards_in.sizes());
  check_same_device(rewards_in, "token_level_rewards", values_in, "values");
  const typename K::Guard guard(rewards_in.device());
  check_same_device(rewards_in, "token_level_rewards", mask_in, "response_mask");
  const auto shape = rewards_in.sizes();
  const Tensor rewards = rewards_in.to(at::kFloat).contiguous();
  const Tensor values = as_float_contiguous(values_in, "values", shape);
  const Tensor mask = as_float_contiguous(mask_in, "response_mask", shape);
  Tensor advantages = at::empty(shape, rewards.options()), returns = at::empty(shape, rewards.options());
  const int64_t batch = shape[0], steps = shape[1];
  if (batch * steps == 0) return {advantages, returns};
  const Tensor workspace = at::empty({K::gae_workspace_floats(batch, steps)}, rewards.options());
  K::masked_gae(GaeArgs{rewards.data_ptr<float>(), values.data_ptr<float>(), mask.data_ptr<float>(), batch, steps,
                        gamma, lam, advantages.data_ptr<float>(), returns.data_ptr<float>()},
                workspace);
  return {advantages, returns};
}

template <typename K>
Tensor masked_whiten(const Tensor& x_in, const Tensor& mask_in, bool shift_mean) {
  check_same_device(x_in, "x", mask_in, "mask");
  const typename K::Guard guard(x_in.device());
  const Tensor x = x_in.to(at::kFloat).contiguous();
  const Tensor mask = as_float_contiguous(mask_in, "mask", x_in.sizes());
  Tensor out = at::empty_like(x);
  Tensor stats = at::zeros({3}, x.options().dtype(at::kDouble));
  WhitenArgs w{x.data_ptr<float>(), mask.data_ptr<float>(), x.numel(), shift_mean, stats.data_ptr<double>(),
               out.data_ptr<float>()};
  const double count = x.numel() ? K::masked_whiten_stats(w) : 0.0;
  // verl's unbiased variance is undefined below two valid elements; it raises there, and so do we.
  TORCH_CHECK_VALUE(count != 0.0, "masked_whiten: the mask (shape ", mask_in.sizes(), ") selects no element");
  TORCH_CHECK_VALUE(count != 1.0, "masked_whiten: the mask (shape ", mask_in.sizes(),
                    ") selects one element; the unbiased variance needs at least two");
  K::masked_whiten_apply(w);
  return out;
}

GroupMode group_mode(const std::string& mode) {
  if (mode == "grpo") return GroupMode::kGrpo;
  if (mode == "grpo_mean") return GroupMode::kGrpoMean;
  if (mode == "rloo") return GroupMode::kRloo;
  TORCH_CHECK_VALUE(false, "mode must be one of grpo, grpo_mean, rloo, got '", mode, "'");
}

template <typename K>
Tensor group_normalize(const Tensor& scores_in, const Tensor& group_index_in, int64_t num_groups,
                       const std::string& mode, double epsilon) {
  check_same_device(scores_in, "scores", group_index_in, "group_index");
  const typename K::Guard guard(scores_in.device());
  TORCH_CHECK_VALUE(scores_in.dim() == 1, "scores must be [B], got ", scores_in.sizes());
  TORCH_CHECK_VALUE(num_groups >= 0, "num_groups must be >= 0, got ", num_groups);
  const Tensor scores = scores_in.to(at::kFloat).contiguous();
  const Tensor group_index = as_index_vector(group_index_in, scores.size(0), "group_index");
  Tensor out = at::empty_like(scores);
  Tensor workspace = at::zeros({num_groups, 3}, scores.options().dtype(at::kDouble));
  if (scores.numel() > 0) {
    K::group_normalize(GroupNormArgs{scores.data_ptr<float>(), group_index.data_ptr<int64_t>(), scores.numel(),
                                     num_groups, group_mode(mode), epsilon, workspace.data_ptr<double>(),
                                     out.data_ptr<float>()});
  }
  return out;
}

// CPU only: on CUDA torch's broadcast multiply is one pass already and its caching allocator reuses blocks.
Tensor masked_broadcast(const Tensor& values_in, const Tensor& mask_in) {
  TORCH_CHECK_VALUE(mask_in.dim() == 2, "mask must be [B, T], got ", mask_in.sizes());
  TORCH_CHECK_TYPE(mask_in.scalar_type() == at::kFloat || mask_in.scalar_type() == at::kBool,
                   "mask must be float32 or bool, got ", mask_in.scalar_type());
  TORCH_CHECK_TYPE(values_in.scalar_type() == at::kFloat, "values must be float32, got ", values_in.scalar_type());
  TORCH_CHECK_VALUE(values_in.dim() == 1 && values_in.size(0) == mask_in.size(0), "values must be [",
                    mask_in.size(0), "], got ", values_in.sizes());
  const Tensor values = values_in.contiguous(), mask = mask_in.contiguous();
  Tensor out = cpu_output(mask.sizes(), values.options());
  if (out.numel() > 0) {
    cpu::masked_broadcast(MaskedBroadcastArgs{values.data_ptr<float>(), mask.data_ptr(),
                                              mask.scalar_type() == at::kBool, mask.size(0), mask.size(1),
                                              out.data_ptr<float>()});
  }
  return out;
}

// CPU only, as masked_broadcast.
Tensor row_sums(const Tensor& x_in) {
  TORCH_CHECK_VALUE(x_in.dim() == 2, "x must be [B, T], got ", x_in.sizes());
  TORCH_CHECK_TYPE(x_in.scalar_type() == at::kFloat, "x must be float32, got ", x_in.scalar_type());
  const Tensor x = x_in.contiguous();
  Tensor out = at::empty({x.size(0)}, x.options());
  cpu::row_sums(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}

template <typename K>
void register_kernels(torch::Library& m) {
  m.impl("log_prob_stats", &log_prob_stats<K>);
  m.impl("log_prob_merge", &log_prob_merge<K>);
  m.impl("log_prob_backward", &log_prob_backward<K>);
  m.impl("masked_gae", &masked_gae<K>);
  m.impl("masked_whiten", &masked_whiten<K>);
  m.impl("group_normalize", &group_normalize<K>);
}

}  // namespace
}  // namespace megatron_rl

TORCH_LIBRARY(megatron_rl, m) {
  m.def("log_prob_stats(Tensor logits, Tensor labels, int vocab_start, int valid_width, float inv_temperature, "
        "int ignore_index) -> Tensor");
  m.def("log_prob_merge(Tensor stats, Tensor labels, int ignore_index) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("log_prob_backward(Tensor logits, Tensor labels, Tensor row_max, Tensor log_sum, Tensor entropy, "
        "Tensor? grad_log_probs, Tensor? grad_entropy, int vocab_start, int valid_width, float inv_temperature, "
        "int ignore_index) -> Tensor");
  m.def("masked_gae(Tensor token_level_rewards, Tensor values, Tensor response_mask, float gamma, float lam) "
        "-> (Tensor, Tensor)");
  m.def("masked_whiten(Tensor x, Tensor mask, bool shift_mean) -> Tensor");
  m.def("group_normalize(Tensor scores, Tensor group_index, int num_groups, str mode, float epsilon) -> Tensor");
  m.def("masked_broadcast(Tensor values, Tensor mask) -> Tensor");
  m.def("row_sums(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_rl, CPU, m) {
  megatron_rl::register_kernels<megatron_rl::CpuKernels>(m);
  m.impl("masked_broadcast", &megatron_rl::masked_broadcast);
  m.impl("row_sums", &megatron_rl::row_sums);
}

#ifdef MEGATRON_RL_WITH_CUDA
TORCH_LIBRARY_IMPL(megatron_rl, CUDA, m) { megatron_rl::register_kernels<megatron_rl::CudaKernels>(m); }
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-rl fused kernels; the ops are registered under torch.ops.megatron_rl";
#ifdef MEGATRON_RL_WITH_CUDA
  m.attr("cuda_compiled") = true;
#else
  m.attr("cuda_compiled") = false;
#endif
  m.def("cpu_isa", [] { return std::string(megatron_rl::cpu::log_prob_isa()); },
        "Instruction set the CPU log-prob kernels use on this machine");
  m.def("release_cpu_cache", [] { return megatron_rl::cpu::release_cached_blocks(); },
        "Frees the large CPU output blocks kept for reuse; returns their bytes");
}
