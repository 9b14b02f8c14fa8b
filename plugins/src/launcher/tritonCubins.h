// The Triton kernels compiled ahead of time (peagle_trt/ops/triton_kernels/aot.py): one entry per
// (variant, architecture). The table itself is generated into the build directory
// (tritonCubins.cpp, the cubins embedded with .incbin) by plugins/CMakeLists.txt.
#pragma once

#include <cstddef>
#include <cstdint>

namespace peagle
{

struct TritonCubin
{
    char const* variant;        // e.g. "kv_attention.bf16.fp8.d128.m16.nosinks" (variants.py)
    int32_t arch;               // 90 = sm_90a, 100 = sm_100a (runs only on that exact compute capability)
    char const* symbol;         // the kernel's name in the cubin
    unsigned char const* image; // the cubin
    size_t size;
    int32_t threads;            // block size: 32 * num_warps
    int32_t sharedBytes;        // dynamic shared memory the kernel needs at launch
    int32_t numArgs;            // runtime arguments, before Triton's two scratch pointers
    uint32_t alignedArgs;       // bit i: argument i is a pointer compiled as 16-byte aligned (aot.py ALIGN)
};

extern TritonCubin const kTritonCubins[];
extern size_t const kNumTritonCubins;

} // namespace peagle
