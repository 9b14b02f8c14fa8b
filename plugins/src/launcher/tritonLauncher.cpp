// The C API of include/peagle_kernels.h over the Triton kernels compiled ahead of time
// (tritonCubins.h): a variant is picked by name and the device's compute capability, its cubin is
// loaded once per device with the CUDA runtime's library API (cudaLibraryLoadData /
// cudaLibraryGetKernel) and launched with cudaLaunchKernel. Written by hand because Triton 3.9's
// generated C launcher passes fp32 arguments as double. The argument lists below follow the
// kernels' signatures in peagle_trt/ops/triton_kernels/*.py (variants.py lists them): the runtime
// arguments in order, then Triton's global and profile scratch pointers (NULL: aot.py refuses any
// kernel that needs them). Grids are those of the Python launchers.
#include "peagle_kernels.h"
#include "tritonCubins.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace peagle
{
namespace
{

struct Loaded
{
    cudaKernel_t kernel;
    TritonCubin const* cubin;
};

// (device, variant) -> loaded kernel; libraries stay loaded for the life of the process
std::mutex gMutex;
std::map<std::pair<int, std::string>, Loaded> gLoaded;

cudaError_t findKernel(std::string const& variant, Loaded& out)
{
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess)
        return err;
    std::lock_guard<std::mutex> lock(gMutex);
    auto const it = gLoaded.find({device, variant});
    if (it != gLoaded.end())
    {
        out = it->second;
        return cudaSuccess;
    }
    int major = 0, minor = 0;
    if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) != cudaSuccess
        || (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) != cudaSuccess)
        return err;
    int const arch = major * 10 + minor;
    for (size_t i = 0; i < kNumTritonCubins; ++i)
    {
        TritonCubin const& c = kTritonCubins[i];
        if (c.arch != arch || variant != c.variant)
            continue;
        cudaLibrary_t library;
        if ((err = cudaLibraryLoadData(&library, c.image, nullptr, nullptr, 0, nullptr, nullptr, 0)) != cudaSuccess)
            return err;
        Loaded loaded{nullptr, &c};
        if ((err = cudaLibraryGetKernel(&loaded.kernel, library, c.symbol)) != cudaSuccess)
            return err;
        if (c.sharedBytes > 48 * 1024
            && (err = cudaKernelSetAttributeForDevice(
                    loaded.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, c.sharedBytes, device))
                != cudaSuccess)
            return err;
        gLoaded[{device, variant}] = loaded;
        out = loaded;
        return cudaSuccess;
    }
    return cudaErrorNoKernelImageForDevice; // no such variant for this GPU (sm_90 and sm_100 only)
}

// Launch `variant` with `args` (pointers to each runtime argument, in order) plus the two scratch pointers.
cudaError_t launch(std::string const& variant, dim3 grid, void** args, int numArgs, cudaStream_t stream)
{
    Loaded k{};
    cudaError_t const err = findKernel(variant, k);
    if (err != cudaSuccess)
        return err;
    if (k.cubin->numArgs != numArgs)
        return cudaErrorInvalidValue; // the table and this file disagree: rebuild
    for (int i = 0; i < numArgs; ++i) // the kernel vectorizes loads on these: a misaligned one would fault
        if ((k.cubin->alignedArgs >> i & 1u) && reinterpret_cast<uintptr_t>(*static_cast<void**>(args[i])) % 16)
            return cudaErrorMisalignedAddress;
    void* scratch[2] = {nullptr, nullptr};
    void* all[32];
    std::memcpy(all, args, sizeof(void*) * numArgs);
    all[numArgs] = &scratch[0];
    all[numArgs + 1] = &scratch[1];
    return cudaLaunchKernel(reinterpret_cast<void const*>(k.kernel), grid, dim3(k.cubin->threads), all,
        k.cubin->sharedBytes, stream);
}

char const* dtypeName(peagle_dtype_t t)
{
    switch (t)
    {
    case PEAGLE_F32: return "f32";
    case PEAGLE_F16: return "f16";
    case PEAGLE_BF16: return "bf16";
    case PEAGLE_FP8_E4M3: return "fp8";
    }
    return nullptr;
}

bool isActivation(peagle_dtype_t t)
{
    return t == PEAGLE_F32 || t == PEAGLE_F16 || t == PEAGLE_BF16;
}

} // namespace
} // namespace peagle

using namespace peagle;

extern "C" {

cudaError_t peagle_kv_attention(void const* q, void const* k, void const* v, int64_t const* positions,
    int64_t const* block_tables, void* k_cache, void* v_cache, void* out, int32_t batch, int32_t rows,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t cache_blocks, int32_t block_size,
    int32_t max_blocks, float scale, float k_scale, float v_scale, peagle_dtype_t act_dtype,
    peagle_dtype_t cache_dtype, void* /*workspace*/, size_t /*workspace_size*/, int32_t /*flags*/,
    cudaStream_t stream)
{
    return peagle_kv_attention_tree(q, k, v, positions, block_tables, nullptr, 0, k_cache, v_cache, out, batch, rows,
        num_heads, num_kv_heads, head_dim, cache_blocks, block_size, max_blocks, scale, k_scale, v_scale, act_dtype,
        cache_dtype, stream);
}

cudaError_t peagle_kv_attention_tree(void const* q, void const* k, void const* v, int64_t const* positions,
    int64_t const* block_tables, int32_t const* tree_mask, int32_t mask_words, void* k_cache, void* v_cache,
    void* out, int32_t batch, int32_t rows, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
    int32_t cache_blocks, int32_t block_size, int32_t max_blocks, float scale, float k_scale, float v_scale,
    peagle_dtype_t act_dtype, peagle_dtype_t cache_dtype, cudaStream_t stream)
{
    bool const fp8 = cache_dtype == PEAGLE_FP8_E4M3;
    bool const tree = tree_mask != nullptr;
    if ((tree && mask_words < (rows + 31) / 32) || (!tree && mask_words != 0))
        return cudaErrorInvalidValue;
    if (!q || !k || !v || !positions || !block_tables || !k_cache || !v_cache || !out || !isActivation(act_dtype)
        || (cache_dtype != act_dtype && !fp8) || (fp8 && act_dtype == PEAGLE_F32) || batch < 0 || rows < 0
        || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || cache_blocks < 1 || block_size < 1 || max_blocks < 1
        || static_cast<int64_t>(max_blocks) * block_size >= (int64_t{1} << 31)
        || (head_dim != 64 && head_dim != 128 && head_dim != 256)
        || (fp8 && !(k_scale > 0.f && v_scale > 0.f && std::isfinite(k_scale) && std::isfinite(v_scale))))
        return cudaErrorInvalidValue;
    if (batch == 0 || rows == 0)
        return cudaSuccess;
    if (!fp8)
        k_scale = v_scale = 1.f;
    std::string const act = dtypeName(act_dtype), cache = dtypeName(cache_dtype);
    int32_t trash = cache_blocks - 1, kvd = num_kv_heads * head_dim;
    void* writeArgs[] = {&k, &v, &positions, &block_tables, &k_cache, &v_cache, &rows, &max_blocks, &trash,
        &block_size, &k_scale, &v_scale, &kvd};
    std::string const form = tree ? ".tree" : ""; // the draft-tree variants (variants.py)
    cudaError_t err = launch("kv_write." + act + "." + cache + form, dim3(batch, rows), writeArgs, 13, stream);
    if (err != cudaSuccess)
        return err;
    int32_t group = num_heads / num_kv_heads, window = 0;
    int32_t const tileRows = 16; // BLOCK_M of the compiled variants (variants.py)
    float qkScale = (scale > 0.f ? scale : 1.f / std::sqrt(static_cast<float>(head_dim))) * 1.4426950408889634f;
    void const* noSinks = q;
    void const* mask = tree ? static_cast<void const*>(tree_mask) : q; // unread without a tree
    int32_t words = tree ? mask_words : 1;
    void* attnArgs[] = {&q, &out, &positions, &block_tables, &k_cache, &v_cache, &noSinks, &mask, &rows,
        &max_blocks, &trash, &block_size, &num_heads, &num_kv_heads, &group, &qkScale, &k_scale, &v_scale, &window,
        &words};
    std::string const variant = "kv_attention." + act + "." + cache + ".d" + std::to_string(head_dim) + ".m"
        + std::to_string(tileRows) + ".nosinks" + form;
    dim3 const grid(batch, num_kv_heads, (rows * group + tileRows - 1) / tileRows);
    return launch(variant, grid, attnArgs, 20, stream);
}

size_t peagle_kv_attention_workspace_size(int32_t, int32_t, int32_t, int32_t, int32_t)
{
    return 0;
}

cudaError_t peagle_draft_inputs(int64_t const* pending_ids, void const* pending_hidden, int64_t const* num_pending,
    int64_t const* cur, void const* embed_tokens, void const* h_mask, void* embeds, void* hidden,
    int64_t* positions, int64_t* sample_rows, int32_t batch, int32_t pending, int32_t hidden_size, int64_t vocab,
    int32_t num_spec_tokens, int64_t mask_token_id, peagle_dtype_t dtype, cudaStream_t stream)
{
    if (!pending_ids || !pending_hidden || !num_pending || !cur || !embed_tokens || !h_mask || !embeds || !hidden
        || !positions || !sample_rows || !isActivation(dtype) || batch < 0 || pending < 1 || hidden_size < 1
        || num_spec_tokens < 1 || mask_token_id < 0 || mask_token_id >= vocab)
        return cudaErrorInvalidValue;
    if (batch == 0)
        return cudaSuccess;
    int32_t rows = pending + num_spec_tokens - 1;
    void* args[] = {&pending_ids, &pending_hidden, &num_pending, &cur, &embed_tokens, &h_mask, &embeds, &hidden,
        &positions, &sample_rows, &pending, &rows, &hidden_size, &num_spec_tokens, &vocab, &mask_token_id};
    return launch(std::string("draft_inputs.") + dtypeName(dtype), dim3(batch, rows), args, 16, stream);
}

cudaError_t peagle_draft_sample(void const* logits, int64_t const* d2t, int64_t* draft_ids, int32_t rows,
    int64_t vocab, peagle_dtype_t logits_dtype, void* /*workspace*/, size_t /*workspace_size*/, cudaStream_t stream)
{
    if (!logits || !d2t || !draft_ids || !isActivation(logits_dtype) || rows < 0 || vocab < 1
        || vocab >= (int64_t{1} << 31))
        return cudaErrorInvalidValue;
    if (rows == 0)
        return cudaSuccess;
    int32_t vocab32 = static_cast<int32_t>(vocab);
    void* args[] = {&logits, &d2t, &draft_ids, &vocab32};
    return launch(std::string("draft_sample.") + dtypeName(logits_dtype), dim3(rows), args, 4, stream);
}

size_t peagle_draft_sample_workspace_size(int32_t, int64_t)
{
    return 0;
}

char const* peagle_error_string(cudaError_t err)
{
    return cudaGetErrorString(err);
}

int32_t peagle_kernels_version(void)
{
    return 3;
}

} // extern "C"
