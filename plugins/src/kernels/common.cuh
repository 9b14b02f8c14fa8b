// Shared device helpers of the P-EAGLE kernels: element conversions, checks, small utilities.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "peagle_kernels.h"

namespace peagle
{

constexpr int kWarpSize = 32;

inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

inline int64_t roundUp(int64_t a, int64_t b)
{
    return ceilDiv(a, b) * b;
}

inline bool isAligned(void const* p, size_t bytes)
{
    return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

__device__ __forceinline__ bool isAligned16(void const* p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- element conversions (fp32 is the compute type everywhere) ------------------------------

template <typename T>
__device__ __forceinline__ float toFloat(T x);

template <>
__device__ __forceinline__ float toFloat<float>(float x)
{
    return x;
}

template <>
__device__ __forceinline__ float toFloat<__half>(__half x)
{
    return __half2float(x);
}

template <>
__device__ __forceinline__ float toFloat<__nv_bfloat16>(__nv_bfloat16 x)
{
    return __bfloat162float(x);
}

template <>
__device__ __forceinline__ float toFloat<__nv_fp8_e4m3>(__nv_fp8_e4m3 x)
{
    return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float x);

template <>
__device__ __forceinline__ float fromFloat<float>(float x)
{
    return x;
}

template <>
__device__ __forceinline__ __half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}

template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

template <>
__device__ __forceinline__ __nv_fp8_e4m3 fromFloat<__nv_fp8_e4m3>(float x)
{
    __nv_fp8_e4m3 r;
    r.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); // round to nearest even, saturate
    return r;
}

template <typename T>
struct IsFp8
{
    static constexpr bool value = false;
};

template <>
struct IsFp8<__nv_fp8_e4m3>
{
    static constexpr bool value = true;
};

// ---- warp reductions -------------------------------------------------------------------------

__device__ __forceinline__ float warpMax(float x)
{
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

__device__ __forceinline__ float warpSum(float x)
{
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
        x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

} // namespace peagle

// Return early with the first launch error of the kernels enqueued so far.
#define PEAGLE_RETURN_IF_LAUNCH_ERROR()                                                                               \
    do                                                                                                                 \
    {                                                                                                                  \
        cudaError_t peagleErr_ = cudaGetLastError();                                                                   \
        if (peagleErr_ != cudaSuccess)                                                                                 \
            return peagleErr_;                                                                                         \
    } while (0)
