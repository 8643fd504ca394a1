// The log-prob kernels compiled for AVX2+FMA (setup.py gives this file -mavx2 -mfma -mf16c on x86-64);
// log_probs.cpp calls them only when the running CPU has AVX2. Elsewhere this file compiles to stubs.
#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "log_probs_impl.h"

namespace megatron_rl::cpu {
bool avx2_kernels_compiled() { return true; }
void log_prob_stats_avx2(const LogProbRows& a, void* stats) { AVX2::log_prob_stats_impl(a, stats); }
void log_prob_backward_avx2(const LogProbGrad& g) { AVX2::log_prob_backward_impl(g); }
}  // namespace megatron_rl::cpu

#else

namespace megatron_rl::cpu {
bool avx2_kernels_compiled() { return false; }
void log_prob_stats_avx2(const LogProbRows&, void*) {}
void log_prob_backward_avx2(const LogProbGrad&) {}
}  // namespace megatron_rl::cpu

#endif
