// PEagleDraftSample: greedy draft ids. argmax over the draft vocabulary of each row (ties -> lowest
// index, NaN is the maximum: torch.argmax semantics), then target_id = draft_id + d2t[draft_id].
//
// Pass 1: grid (splits, rows); each block scans one chunk of one row (float4 loads when aligned) and
//         reduces (value, index) with warp shuffles. With one split it writes the final id directly.
// Pass 2: one warp per row merges the per-split winners and applies d2t.
// Splitting V (up to 201088 for gpt-oss-style vocabularies) keeps the GPU busy when rows = B*K is small.
#include "common.cuh"

#include <cfloat>

namespace peagle
{
namespace
{

constexpr int kThreads = 256;
constexpr int64_t kChunkTarget = 16384; // elements per block
constexpr int kMaxSplits = 32;

struct Best
{
    float v;
    int64_t i;
};

// true when (a, ia) wins over (b, ib)
__device__ __forceinline__ bool better(float a, int64_t ia, float b, int64_t ib)
{
    bool const an = isnan(a), bn = isnan(b);
    if (an || bn)
        return an && bn ? ia < ib : an;
    if (a != b)
        return a > b;
    return ia < ib;
}

__device__ __forceinline__ void consider(Best& best, float v, int64_t i)
{
    if (better(v, i, best.v, best.i))
    {
        best.v = v;
        best.i = i;
    }
}

__device__ __forceinline__ Best warpBest(Best b)
{
#pragma unroll
    for (int o = kWarpSize / 2; o > 0; o >>= 1)
    {
        float const v = __shfl_xor_sync(0xffffffffu, b.v, o);
        int64_t const i = __shfl_xor_sync(0xffffffffu, b.i, o);
        consider(b, v, i);
    }
    return b;
}

__device__ __forceinline__ int64_t toTarget(int64_t draft, int64_t const* d2t, int64_t vocab)
{
    if (draft < 0 || draft >= vocab) // only when the row was empty: keep in range
        draft = 0;
    return d2t ? draft + d2t[draft] : draft;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) argmaxChunkKernel(T const* __restrict__ logits,
    int64_t const* __restrict__ d2t, int64_t* __restrict__ out, float* __restrict__ partVal,
    int64_t* __restrict__ partIdx, int64_t vocab, int64_t chunk, int32_t splits)
{
    int32_t const split = blockIdx.x;
    int64_t const row = blockIdx.y;
    int64_t const begin = split * chunk;
    int64_t const end = min(vocab, begin + chunk);
    T const* const x = logits + row * vocab;

    Best best{-INFINITY, INT64_MAX};
    if constexpr (sizeof(T) == 4)
    {
        // float4 body when the chunk start is 16-byte aligned (chunk is a multiple of 4)
        if (isAligned16(x + begin))
        {
            int64_t const nvec = (end - begin) / 4;
            float4 const* xv = reinterpret_cast<float4 const*>(x + begin);
            for (int64_t t = threadIdx.x; t < nvec; t += blockDim.x)
            {
                float4 const f = xv[t];
                int64_t const i = begin + 4 * t;
                consider(best, f.x, i);
                consider(best, f.y, i + 1);
                consider(best, f.z, i + 2);
                consider(best, f.w, i + 3);
            }
            for (int64_t i = begin + 4 * nvec + threadIdx.x; i < end; i += blockDim.x)
                consider(best, toFloat(x[i]), i);
        }
        else
        {
            for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
                consider(best, toFloat(x[i]), i);
        }
    }
    else
    {
        for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
            consider(best, toFloat(x[i]), i);
    }

    __shared__ Best warpResults[kThreads / kWarpSize];
    best = warpBest(best);
    int const warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    if (lane == 0)
        warpResults[warp] = best;
    __syncthreads();
    if (warp != 0)
        return;
    best = lane < kThreads / kWarpSize ? warpResults[lane] : Best{-INFINITY, INT64_MAX};
    best = warpBest(best);
    if (lane != 0)
        return;
    if (splits == 1)
        out[row] = toTarget(best.i, d2t, vocab);
    else
    {
        partVal[row * splits + split] = best.v;
        partIdx[row * splits + split] = best.i;
    }
}

__global__ void argmaxMergeKernel(float const* __restrict__ partVal, int64_t const* __restrict__ partIdx,
    int64_t const* __restrict__ d2t, int64_t* __restrict__ out, int32_t rows, int32_t splits, int64_t vocab)
{
    int64_t const row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
    int const lane = threadIdx.x % kWarpSize;
    if (row >= rows)
        return;
    Best best{-INFINITY, INT64_MAX};
    if (lane < splits)
        best = Best{partVal[row * splits + lane], partIdx[row * splits + lane]};
    best = warpBest(best);
    if (lane == 0)
        out[row] = toTarget(best.i, d2t, vocab);
}

// Split count and chunk length for a row of `vocab` elements (chunk is a multiple of 4).
void plan(int64_t vocab, int32_t& splits, int64_t& chunk)
{
    int64_t s = ceilDiv(vocab, kChunkTarget);
    s = s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : s);
    chunk = roundUp(ceilDiv(vocab, s), 4);
    splits = static_cast<int32_t>(ceilDiv(vocab, chunk));
}

} // namespace
} // namespace peagle

extern "C" size_t peagle_draft_sample_workspace_size(int32_t max_rows, int64_t vocab)
{
    if (max_rows <= 0 || vocab <= 0)
        return 0;
    int32_t splits;
    int64_t chunk;
    peagle::plan(vocab, splits, chunk);
    if (splits == 1)
        return 0;
    // int64 indices first (8-byte aligned), then the float values
    return static_cast<size_t>(max_rows) * splits * (sizeof(int64_t) + sizeof(float));
}

extern "C" cudaError_t peagle_draft_sample(void const* logits, int64_t const* d2t, int64_t* draft_ids, int32_t rows,
    int64_t vocab, peagle_dtype_t logits_dtype, void* workspace, size_t workspace_size, cudaStream_t stream)
{
    using namespace peagle;
    if (rows < 0 || vocab < 1 || !logits || !draft_ids)
        return cudaErrorInvalidValue;
    if (logits_dtype != PEAGLE_F32 && logits_dtype != PEAGLE_F16 && logits_dtype != PEAGLE_BF16)
        return cudaErrorInvalidValue;
    if (rows == 0)
        return cudaSuccess;
    if (rows > 65535) // grid.y limit
        return cudaErrorInvalidValue;

    int32_t splits;
    int64_t chunk;
    plan(vocab, splits, chunk);
    size_t const needed = peagle_draft_sample_workspace_size(rows, vocab);
    if (splits > 1 && (workspace == nullptr || workspace_size < needed || !isAligned(workspace, 8)))
    {
        splits = 1; // correct, only slower
        chunk = vocab;
    }
    auto* partIdx = static_cast<int64_t*>(workspace);
    auto* partVal = splits > 1 ? reinterpret_cast<float*>(partIdx + static_cast<int64_t>(rows) * splits) : nullptr;

    dim3 const grid(splits, rows);
#define PEAGLE_LAUNCH_ARGMAX(T)                                                                                        \
    argmaxChunkKernel<T><<<grid, kThreads, 0, stream>>>(                                                              \
        static_cast<T const*>(logits), d2t, draft_ids, partVal, partIdx, vocab, chunk, splits)
    switch (logits_dtype)
    {
    case PEAGLE_F32: PEAGLE_LAUNCH_ARGMAX(float); break;
    case PEAGLE_F16: PEAGLE_LAUNCH_ARGMAX(__half); break;
    default: PEAGLE_LAUNCH_ARGMAX(__nv_bfloat16); break;
    }
#undef PEAGLE_LAUNCH_ARGMAX
    PEAGLE_RETURN_IF_LAUNCH_ERROR();
    if (splits > 1)
    {
        constexpr int kRowsPerBlock = 4;
        argmaxMergeKernel<<<static_cast<unsigned>(ceilDiv(rows, kRowsPerBlock)), kRowsPerBlock * kWarpSize, 0,
            stream>>>(partVal, partIdx, d2t, draft_ids, rows, splits, vocab);
        PEAGLE_RETURN_IF_LAUNCH_ERROR();
    }
    return cudaSuccess;
}
