// PEagleDraftInputs: the drafter's input rows of one parallel drafting pass, for a batch.
//
// One block per (row j, request b). With R = P + K - 1 rows per request and n = num_pending[b]:
//   j < n          real row:  embeds = embed_tokens[pending_ids[b, j]], hidden = pending_hidden[b, j]
//   n <= j < n+K-1 mask row:  embeds = embed_tokens[mask_token_id],     hidden = h_mask
//   otherwise      padding:   zeros, position -1
// positions[b, j] = cur[b] - n + j (real and mask rows); sample_rows[b, i] = n - 1 + i.
// Example K=3, n=2, cur=12: rows (t0,h0,@10) (t1,h1,@11) (M,hm,@12) (M,hm,@13); sample 1,2,3.
// Rows are copied as raw bytes with the widest vector (16/8/4/2/1 bytes) that divides the row size
// and the base pointers' alignment, so one kernel serves fp32/fp16/bf16.
#include "common.cuh"

namespace peagle
{
namespace
{

constexpr int kThreads = 128;

template <typename V>
__device__ __forceinline__ void copyRow(V* dst, V const* src, int64_t nvec)
{
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
        dst[i] = src[i];
}

template <typename V>
__device__ __forceinline__ void zeroRow(V* dst, int64_t nvec)
{
    V const z{};
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x)
        dst[i] = z;
}

template <typename V>
__global__ void __launch_bounds__(kThreads) draftInputsKernel(int64_t const* __restrict__ pendingIds,
    uint8_t const* __restrict__ pendingHidden, int64_t const* __restrict__ numPending, int64_t const* __restrict__ cur,
    uint8_t const* __restrict__ embed, uint8_t const* __restrict__ hMask, uint8_t* __restrict__ embeds,
    uint8_t* __restrict__ hidden, int64_t* __restrict__ positions, int64_t* __restrict__ sampleRows, int32_t P,
    int32_t R, int32_t K, int64_t rowBytes, int64_t vocab, int64_t maskToken)
{
    int32_t const j = blockIdx.x;
    int32_t const b = blockIdx.y;
    int64_t const n = numPending[b];
    bool const real = j < n;
    bool const mask = !real && j < n + K - 1;
    int64_t const outRow = static_cast<int64_t>(b) * R + j;

    if (threadIdx.x == 0)
    {
        positions[outRow] = (real || mask) ? cur[b] - n + j : -1;
        if (j < K)
            sampleRows[static_cast<int64_t>(b) * K + j] = n - 1 + j;
    }

    int64_t const nvec = rowBytes / static_cast<int64_t>(sizeof(V));
    V* const embOut = reinterpret_cast<V*>(embeds + outRow * rowBytes);
    V* const hidOut = reinterpret_cast<V*>(hidden + outRow * rowBytes);
    if (!real && !mask)
    {
        zeroRow(embOut, nvec);
        zeroRow(hidOut, nvec);
        return;
    }
    int64_t const src = static_cast<int64_t>(b) * P + min(j, P - 1); // same clamp as the reference
    int64_t token = real ? pendingIds[src] : maskToken;
    token = token < 0 ? 0 : (token >= vocab ? vocab - 1 : token); // never gather out of bounds
    copyRow(embOut, reinterpret_cast<V const*>(embed + token * rowBytes), nvec);
    copyRow(hidOut, reinterpret_cast<V const*>(real ? pendingHidden + src * rowBytes : hMask), nvec);
}

size_t elementSize(peagle_dtype_t t)
{
    switch (t)
    {
    case PEAGLE_F32: return 4;
    case PEAGLE_F16:
    case PEAGLE_BF16: return 2;
    default: return 0;
    }
}

} // namespace
} // namespace peagle

extern "C" cudaError_t peagle_draft_inputs(int64_t const* pending_ids, void const* pending_hidden,
    int64_t const* num_pending, int64_t const* cur, void const* embed_tokens, void const* h_mask, void* embeds,
    void* hidden, int64_t* positions, int64_t* sample_rows, int32_t batch, int32_t pending, int32_t hidden_size,
    int64_t vocab, int32_t num_spec_tokens, int64_t mask_token_id, peagle_dtype_t dtype, cudaStream_t stream)
{
    using namespace peagle;
    size_t const esize = elementSize(dtype);
    if (esize == 0 || batch < 0 || pending < 1 || hidden_size < 1 || vocab < 1 || num_spec_tokens < 1)
        return cudaErrorInvalidValue;
    if (batch == 0)
        return cudaSuccess;
    if (batch > 65535) // grid.y limit
        return cudaErrorInvalidValue;
    if (!pending_ids || !pending_hidden || !num_pending || !cur || !embed_tokens || !h_mask || !embeds || !hidden
        || !positions || !sample_rows)
        return cudaErrorInvalidValue;

    int32_t const R = pending + num_spec_tokens - 1;
    int64_t const rowBytes = static_cast<int64_t>(hidden_size) * static_cast<int64_t>(esize);
    void const* ptrs[] = {pending_hidden, embed_tokens, h_mask, embeds, hidden};
    int vec = 16;
    while (vec > 1)
    {
        bool ok = rowBytes % vec == 0;
        for (void const* p : ptrs)
            ok = ok && isAligned(p, vec);
        if (ok)
            break;
        vec /= 2;
    }
    dim3 const grid(R, batch);
    auto const* ph = static_cast<uint8_t const*>(pending_hidden);
    auto const* em = static_cast<uint8_t const*>(embed_tokens);
    auto const* hm = static_cast<uint8_t const*>(h_mask);
    auto* eo = static_cast<uint8_t*>(embeds);
    auto* ho = static_cast<uint8_t*>(hidden);
#define PEAGLE_LAUNCH_DRAFT_INPUTS(V)                                                                                  \
    draftInputsKernel<V><<<grid, kThreads, 0, stream>>>(pending_ids, ph, num_pending, cur, em, hm, eo, ho, positions,  \
        sample_rows, pending, R, num_spec_tokens, rowBytes, vocab, mask_token_id)
    switch (vec)
    {
    case 16: PEAGLE_LAUNCH_DRAFT_INPUTS(uint4); break;
    case 8: PEAGLE_LAUNCH_DRAFT_INPUTS(uint2); break;
    case 4: PEAGLE_LAUNCH_DRAFT_INPUTS(uint32_t); break;
    case 2: PEAGLE_LAUNCH_DRAFT_INPUTS(uint16_t); break;
    default: PEAGLE_LAUNCH_DRAFT_INPUTS(uint8_t); break;
    }
#undef PEAGLE_LAUNCH_DRAFT_INPUTS
    PEAGLE_RETURN_IF_LAUNCH_ERROR();
    return cudaSuccess;
}
