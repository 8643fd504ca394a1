// Element types of the CUDA kernels: accumulator type, conversions and 16-byte packs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace megatron_rl::cuda {

template <typename scalar_t>
struct AccType {
  using type = float;
};
template <>
struct AccType<double> {
  using type = double;
};
template <typename scalar_t>
using acc_t = typename AccType<scalar_t>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename scalar_t>
__device__ __forceinline__ scalar_t from_acc(acc_t<scalar_t> x);
template <>
__device__ __forceinline__ float from_acc<float>(float x) { return x; }
template <>
__device__ __forceinline__ double from_acc<double>(double x) { return x; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Fast exp for the float path (ex2.approx based, ~2 ulp); exact library exp for double.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
__device__ __forceinline__ double fast_exp(double x) { return exp(x); }

// 16 bytes of elements, loaded and stored with one vector instruction.
template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace megatron_rl::cuda
