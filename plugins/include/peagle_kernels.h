/*
 * peagle_kernels.h: C API of the P-EAGLE kernels (libpeagle_kernels.so).
 *
 * One entry point per custom op of docs/EXPORT.md; the semantics are those of
 * peagle_trt/ops/reference.py. Behind it: the Triton kernels of peagle_trt/ops/triton_kernels,
 * compiled ahead of time to sm_90a and sm_100a cubins, embedded in the library and launched by
 * plugins/src/launcher/tritonLauncher.cpp (CUDA runtime library API). Every function takes device
 * pointers, plain sizes and a stream, enqueues its kernels asynchronously on that stream and returns
 * the launch status (cudaSuccess, cudaErrorInvalidValue for bad arguments,
 * cudaErrorNoKernelImageForDevice on a GPU that is neither sm_90 nor sm_100, or the first launch error).
 * Nothing here allocates or synchronizes. Tensors are dense row-major (contiguous).
 *
 * Used by the TensorRT plugins (plugins/src/plugins).
 */
#ifndef PEAGLE_KERNELS_H
#define PEAGLE_KERNELS_H

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PEAGLE_KERNELS_API __attribute__((visibility("default")))

/* Element types of activations and caches. */
typedef enum peagle_dtype
{
    PEAGLE_F32 = 0,
    PEAGLE_F16 = 1,
    PEAGLE_BF16 = 2,
    PEAGLE_FP8_E4M3 = 3 /* KV cache only: stored = value / scale, read back as stored * scale */
} peagle_dtype_t;

/* ---------------------------------------------------------------------------------------------
 * PEagleKVAttention over a paged KV cache
 *
 *   q        [B, S, H*d]    act_dtype      k, v [B, S, KV*d] act_dtype (RoPE applied)
 *   positions [B, S] int64  (-1 = padding row: writes the trash block, returns zeros)
 *   block_tables [B, M] int64  entry j = the block holding positions j*bs .. j*bs + bs - 1 of the
 *            request (-1 = no block)
 *   k_cache, v_cache [NB, bs, KV, d] cache_dtype (NB = cache_blocks; block NB - 1 is the trash
 *            block), updated IN PLACE
 *   out      [B, S, H*d]    act_dtype
 *
 * First writes every row's k/v at (block_tables[b, p / bs], p % bs), p = positions[b, s]
 * (FP8: value / k_scale); rows with p < 0, p >= M * bs, or a table entry -1 (or outside
 * [0, NB - 1)) write to (trash, 0). Then row (b, s) of head h attends over the keys of request b at positions
 * 0..min(p, M*bs - 1), looked up through the table, of kv head h / (H / KV) (causal by absolute
 * position, GQA), softmax(q.k * scale) with fp32 accumulation; FP8 caches are read back as
 * stored * k_scale / v_scale. Keys whose entry is -1 or outside [0, NB - 1) are masked (the runtime never leaves one in
 * a row's range; a row that sees no key returns zeros); a padding row returns zeros.
 *
 * act_dtype: F32, F16 or BF16. cache_dtype: act_dtype, or FP8_E4M3 under F16 / BF16.
 * k_scale / v_scale are ignored unless cache_dtype is FP8. head_dim: 64, 128 or 256 (the compiled
 * variants). scale <= 0 means 1/sqrt(head_dim). No sliding window, no sinks here (the Triton
 * kernels have them; the plugins do not expose them yet). workspace / workspace_size / flags are
 * unused (kept for ABI stability). M * bs must fit in int32.
 * ------------------------------------------------------------------------------------------- */
PEAGLE_KERNELS_API cudaError_t peagle_kv_attention(void const* q, void const* k, void const* v,
    int64_t const* positions, int64_t const* block_tables, void* k_cache, void* v_cache, void* out, int32_t batch,
    int32_t rows, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t cache_blocks,
    int32_t block_size, int32_t max_blocks, float scale, float k_scale, float v_scale, peagle_dtype_t act_dtype,
    peagle_dtype_t cache_dtype, void* workspace, size_t workspace_size, int32_t flags, cudaStream_t stream);

/* The same over a draft tree: tree_mask [B, S, mask_words] int32 packed ancestor bits (bit j % 32 of
 * word j / 32 of row i: row i attends to row j of its request; TensorRT-LLM's spec_decoding_packed_mask
 * layout). positions are then the rows' RoPE positions (by depth) and row s of request b writes and
 * is read at KV position positions[b, 0] + s (its rows contiguous, padding rows last); a row sees
 * the keys below positions[b, 0] and the rows whose bits it has (peagle_trt/ops/reference.py,
 * kv_attention). tree_mask NULL (mask_words 0) is peagle_kv_attention. */
PEAGLE_KERNELS_API cudaError_t peagle_kv_attention_tree(void const* q, void const* k, void const* v,
    int64_t const* positions, int64_t const* block_tables, int32_t const* tree_mask, int32_t mask_words,
    void* k_cache, void* v_cache, void* out, int32_t batch, int32_t rows, int32_t num_heads, int32_t num_kv_heads,
    int32_t head_dim, int32_t cache_blocks, int32_t block_size, int32_t max_blocks, float scale, float k_scale,
    float v_scale, peagle_dtype_t act_dtype, peagle_dtype_t cache_dtype, cudaStream_t stream);

/* Workspace (bytes) peagle_kv_attention needs: 0 (kept for ABI stability). */
PEAGLE_KERNELS_API size_t peagle_kv_attention_workspace_size(
    int32_t max_batch, int32_t max_rows, int32_t num_heads, int32_t head_dim, int32_t max_keys);

/* ---------------------------------------------------------------------------------------------
 * PEagleDraftInputs (R = P + K - 1 rows per request, K = num_spec_tokens)
 *
 *   pending_ids [B, P] int64, pending_hidden [B, P, Hs] dtype, num_pending [B] int64 (n >= 1),
 *   cur [B] int64 (pending rows sit at cur-n .. cur-1), embed_tokens [V, Hs] dtype, h_mask [Hs] dtype
 *   -> embeds [B, R, Hs], hidden [B, R, Hs] (dtype), positions [B, R] int64, sample_rows [B, K] int64
 *
 * Row j < n: (embed[pending_ids[j]], pending_hidden[j]); n <= j < n+K-1: (embed[mask_token_id],
 * h_mask); other rows zero with position -1. positions = cur - n + j; sample_rows = n-1 .. n+K-2.
 * mask_token_id must lie in [0, V); pending ids are clamped to [0, V) before the gather.
 * ------------------------------------------------------------------------------------------- */
PEAGLE_KERNELS_API cudaError_t peagle_draft_inputs(int64_t const* pending_ids, void const* pending_hidden,
    int64_t const* num_pending, int64_t const* cur, void const* embed_tokens, void const* h_mask, void* embeds,
    void* hidden, int64_t* positions, int64_t* sample_rows, int32_t batch, int32_t pending, int32_t hidden_size,
    int64_t vocab, int32_t num_spec_tokens, int64_t mask_token_id, peagle_dtype_t dtype, cudaStream_t stream);

/* ---------------------------------------------------------------------------------------------
 * PEagleDraftSample
 *
 *   logits [rows, V] (F32, F16 or BF16), d2t [V] int64 (required) -> draft_ids [rows] int64
 *
 * draft = argmax over V (ties -> lowest index), draft_ids = draft + d2t[draft]. One program per
 * row. NaN logits: unspecified (torch.argmax returns the NaN's index). workspace is unused.
 * ------------------------------------------------------------------------------------------- */
PEAGLE_KERNELS_API cudaError_t peagle_draft_sample(void const* logits, int64_t const* d2t, int64_t* draft_ids,
    int32_t rows, int64_t vocab, peagle_dtype_t logits_dtype, void* workspace, size_t workspace_size,
    cudaStream_t stream);

/* 0 (kept for ABI stability). */
PEAGLE_KERNELS_API size_t peagle_draft_sample_workspace_size(int32_t max_rows, int64_t vocab);

/* ---------------------------------------------------------------------------------------------
 * PEagleMoE: a sparse mixture-of-experts MLP (peagle_trt/ops/reference.py, moe)
 *
 *   x [T, H] act_dtype, router_logits [T, E] logits_dtype (F32, F16 or BF16; routing in float32),
 *   w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up), w2 [E, H, I]: act_dtype, or FP8_E4M3 when
 *   scale_kind != PEAGLE_MOE_NO_SCALE; b13 [E, 2I], b2 [E, H] act_dtype or NULL; expert_scale [E]
 *   float32 or NULL; w13_scale / w2_scale float32: [E] per tensor, [E, N] per channel,
 *   [E, ceil(N/128), ceil(K/128)] per 128 x 128 block (N, K: that weight's out / in features);
 *   a13_scale / a2_scale [E] float32 (per tensor only, required there; NULL otherwise)
 *   -> y [T, H] act_dtype
 *
 * Per row: the top_k experts by descending float32 logit (ties: the lower id); routing 0 =
 * softmax over all experts then the picks (renormalize != 0: divided by their sum), 1 = softmax over
 * the picked logits; weights times expert_scale[id]. Per pick: h = act(x W_gate^T (+b), x W_up^T (+b))
 * (activation 0 silu, 1 gelu_tanh, 2 clamped SwiGLU with swiglu_alpha / swiglu_limit) in float32,
 * rounded to act_dtype; o = h W2^T (+ b2) in float32; y = sum over the picks in order of weight * o,
 * rounded once. FP8: activations quantized statically (a13 / a2, per tensor) or dynamically per row
 * (per channel) / per row and 128 columns (block). Everything runs on the device from shapes alone
 * (no host synchronization: capturable in a CUDA graph); no atomics (deterministic).
 *
 * Limits of the compiled variants: experts <= 256, top_k <= 8, H and I multiples of 32 (F32), 64
 * (F16 / BF16) or 128 (FP8), FP8 under F16 / BF16 activations only, block scales need I % 128 == 0.
 * workspace: at least peagle_moe_workspace_size(tokens, ...) bytes, 256-byte aligned.
 * ------------------------------------------------------------------------------------------- */
typedef enum peagle_moe_scale
{
    PEAGLE_MOE_NO_SCALE = 0,    /* act_dtype weights */
    PEAGLE_MOE_PER_TENSOR = 1,  /* FP8, one scale per expert, static activation scales */
    PEAGLE_MOE_PER_CHANNEL = 2, /* FP8, one scale per output feature, dynamic per-row activation scales */
    PEAGLE_MOE_BLOCK_128 = 3    /* FP8, 128 x 128 weight blocks, dynamic per-row, per-128-column scales */
} peagle_moe_scale_t;

PEAGLE_KERNELS_API cudaError_t peagle_moe(void const* x, void const* router_logits, void const* w13, void const* w2,
    void const* b13, void const* b2, float const* expert_scale, float const* w13_scale, float const* w2_scale,
    float const* a13_scale, float const* a2_scale, void* y, int32_t tokens, int32_t hidden, int32_t experts,
    int32_t inter, int32_t top_k, int32_t routing, int32_t renormalize, int32_t activation, float swiglu_alpha,
    float swiglu_limit, peagle_dtype_t act_dtype, peagle_dtype_t logits_dtype, peagle_moe_scale_t scale_kind,
    void* workspace, size_t workspace_size, cudaStream_t stream);

/* Workspace (bytes) of peagle_moe for up to max_tokens rows: the routing, the expert-aligned pair list,
 * the FP8 codes (dynamic kinds), h [T*k, I] and the float32 expert outputs [T*k, H]. 0 on bad sizes. */
PEAGLE_KERNELS_API size_t peagle_moe_workspace_size(int32_t max_tokens, int32_t hidden, int32_t experts,
    int32_t inter, int32_t top_k, peagle_dtype_t act_dtype, peagle_moe_scale_t scale_kind);

/* Human-readable name of a cudaError_t (cudaGetErrorString of the library's runtime). */
PEAGLE_KERNELS_API char const* peagle_error_string(cudaError_t err);

/* Library version (bumped when the C API changes; 2: paged KV cache, block tables; 3: the Triton
 * kernels, no workspace; 4: peagle_moe). */
PEAGLE_KERNELS_API int32_t peagle_kernels_version(void);

#ifdef __cplusplus
}
#endif

#endif /* PEAGLE_KERNELS_H */
