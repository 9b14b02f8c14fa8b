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

#include <algorithm>
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

size_t elementBytes(peagle_dtype_t t)
{
    return t == PEAGLE_F32 ? 4 : t == PEAGLE_FP8_E4M3 ? 1 : 2;
}

// ---- PEagleMoE (peagle_trt/ops/triton_kernels/moe.py: the same launches, tiles and buffers) -----------

constexpr int32_t kMoeMaxExperts = 256; // BLOCK_E of the routing / alignment variants (variants.py)
constexpr int32_t kMoeMaxTopK = 8;      // BLOCK_TOPK
constexpr int32_t kMoeGroup = 128;      // FP8 block scales / dynamic activation groups
constexpr int32_t kMoeBlockN = 64;      // N tile of both regimes (moe.regime_tiles)
constexpr int32_t kMoeSumBlock = 512;   // moe.SUM_BLOCK
constexpr int32_t kMoeSmallRows = 16;   // moe.SMALL_ROWS: "small" tiles while T * k <= 16 * E
constexpr int32_t kMoeMaxBlockM = 64;   // the largest BLOCK_M: the workspace is sized with it

int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

int32_t moeBlockK(peagle_dtype_t act, peagle_moe_scale_t kind) // moe.block_k_for
{
    return kind != PEAGLE_MOE_NO_SCALE ? kMoeGroup : act == PEAGLE_F32 ? 32 : 64;
}

int32_t moeBlockM(bool small, peagle_dtype_t act) // moe.regime_tiles
{
    return small ? 16 : act == PEAGLE_F32 ? 32 : 64;
}

//! Byte offsets of peagle_moe's buffers in its workspace (each 256-byte aligned), for T rows and BLOCK_M.
struct MoeLayout
{
    size_t weights, ids, sorted, blockExpert, total, xCodes, xScales, h, hCodes, hScales, o, bytes;
    int64_t pairs, slots, blocks;

    MoeLayout(int64_t tokens, int64_t hidden, int64_t experts, int64_t inter, int64_t topK, peagle_dtype_t act,
        peagle_moe_scale_t kind, int64_t blockM)
    {
        pairs = tokens * topK;
        slots = pairs + std::min(experts, pairs) * (blockM - 1); // moe.slots_for: shapes only
        blocks = ceilDiv(slots, blockM);
        bool const dynamic = kind == PEAGLE_MOE_PER_CHANNEL || kind == PEAGLE_MOE_BLOCK_128;
        int64_t const hGroups = kind == PEAGLE_MOE_PER_CHANNEL ? 1 : ceilDiv(hidden, kMoeGroup);
        int64_t const iGroups = kind == PEAGLE_MOE_PER_CHANNEL ? 1 : ceilDiv(inter, kMoeGroup);
        size_t at = 0;
        auto take = [&at](int64_t bytes) {
            size_t const here = at;
            at += static_cast<size_t>(ceilDiv(bytes, 256) * 256);
            return here;
        };
        weights = take(pairs * 4);
        ids = take(pairs * 4);
        sorted = take(slots * 4);
        blockExpert = take(blocks * 4);
        total = take(4);
        xCodes = take(dynamic ? tokens * hidden : 0);
        xScales = take(dynamic ? tokens * hGroups * 4 : 0);
        h = take(pairs * inter * static_cast<int64_t>(elementBytes(act)));
        hCodes = take(dynamic ? pairs * inter : 0);
        hScales = take(dynamic ? pairs * iGroups * 4 : 0);
        o = take(pairs * hidden * 4);
        bytes = at;
    }
};

bool moeSizesValid(int32_t tokens, int32_t hidden, int32_t experts, int32_t inter, int32_t topK, peagle_dtype_t act,
    peagle_moe_scale_t kind)
{
    if (!isActivation(act) || static_cast<int>(kind) < 0 || static_cast<int>(kind) > 3 || tokens < 0 || hidden < 1
        || inter < 1 || experts < 1 || experts > kMoeMaxExperts || topK < 1 || topK > kMoeMaxTopK || topK > experts
        || (kind != PEAGLE_MOE_NO_SCALE && act == PEAGLE_F32))
        return false;
    int32_t const blockK = moeBlockK(act, kind); // the compiled variants are ALIGNED: no K remainder
    if (hidden % blockK || inter % blockK)
        return false;
    // every offset of the kernels stays in int32 per expert and the pair count in int32 overall
    return static_cast<int64_t>(tokens) * topK < (int64_t{1} << 31)
        && static_cast<int64_t>(2) * inter * hidden < (int64_t{1} << 31);
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

size_t peagle_moe_workspace_size(int32_t max_tokens, int32_t hidden, int32_t experts, int32_t inter, int32_t top_k,
    peagle_dtype_t act_dtype, peagle_moe_scale_t scale_kind)
{
    if (!moeSizesValid(max_tokens, hidden, experts, inter, top_k, act_dtype, scale_kind))
        return 0;
    // monotone in the rows and in BLOCK_M: the largest BLOCK_M at max_tokens bounds every launch
    return MoeLayout(max_tokens, hidden, experts, inter, top_k, act_dtype, scale_kind, kMoeMaxBlockM).bytes;
}

cudaError_t peagle_moe(void const* x, void const* router_logits, void const* w13, void const* w2, void const* b13,
    void const* b2, float const* expert_scale, float const* w13_scale, float const* w2_scale, float const* a13_scale,
    float const* a2_scale, void* y, int32_t tokens, int32_t hidden, int32_t experts, int32_t inter, int32_t top_k,
    int32_t routing, int32_t renormalize, int32_t activation, float swiglu_alpha, float swiglu_limit,
    peagle_dtype_t act_dtype, peagle_dtype_t logits_dtype, peagle_moe_scale_t scale_kind, void* workspace,
    size_t workspace_size, cudaStream_t stream)
{
    bool const fp8 = scale_kind != PEAGLE_MOE_NO_SCALE;
    bool const perTensor = scale_kind == PEAGLE_MOE_PER_TENSOR;
    if (!moeSizesValid(tokens, hidden, experts, inter, top_k, act_dtype, scale_kind) || !isActivation(logits_dtype)
        || !x || !router_logits || !w13 || !w2 || !y || (fp8 && (!w13_scale || !w2_scale))
        || (perTensor != (a13_scale != nullptr)) || (perTensor != (a2_scale != nullptr))
        || (scale_kind == PEAGLE_MOE_BLOCK_128 && inter % kMoeGroup) || routing < 0 || routing > 1 || activation < 0
        || activation > 2)
        return cudaErrorInvalidValue;
    if (tokens == 0)
        return cudaSuccess;
    bool const small = static_cast<int64_t>(tokens) * top_k <= static_cast<int64_t>(kMoeSmallRows) * experts;
    int32_t const blockM = moeBlockM(small, act_dtype);
    MoeLayout const L(tokens, hidden, experts, inter, top_k, act_dtype, scale_kind, blockM);
    if (!workspace || workspace_size < L.bytes || reinterpret_cast<uintptr_t>(workspace) % 256)
        return cudaErrorInvalidValue;
    char* ws = static_cast<char*>(workspace);
    void* weights = ws + L.weights;
    void* ids = ws + L.ids;
    void* sorted = ws + L.sorted;
    void* blockExpert = ws + L.blockExpert;
    void* total = ws + L.total;
    void* h = ws + L.h;
    void* o = ws + L.o;
    int32_t pairs = static_cast<int32_t>(L.pairs), blocks = static_cast<int32_t>(L.blocks);
    std::string const act = dtypeName(act_dtype);
    std::string const regime = small ? "small" : "large";
    static char const* const kWeights[] = {"w", "fp8t", "fp8c", "fp8b"}; // variants.MOE_WEIGHTS
    std::string const weightKind = kWeights[scale_kind];

    // routing: weights [P] f32, ids [P] i32
    int32_t hasScale = expert_scale != nullptr;
    void const* scale = hasScale ? static_cast<void const*>(expert_scale) : weights; // unread without one
    void* routeArgs[] = {&router_logits, &scale, &weights, &ids, &experts, &top_k, &routing, &renormalize, &hasScale};
    cudaError_t err = launch(std::string("moe_route.") + dtypeName(logits_dtype), dim3(tokens), routeArgs, 9, stream);
    if (err != cudaSuccess)
        return err;
    // the pairs grouped by expert, padded to BLOCK_M; the padded total stays on the device
    void* alignArgs[] = {&ids, &sorted, &blockExpert, &total, &pairs, &blocks};
    if ((err = launch("moe_align.m" + std::to_string(blockM), dim3(1), alignArgs, 6, stream)) != cudaSuccess)
        return err;
    bool const dynamic = scale_kind == PEAGLE_MOE_PER_CHANNEL || scale_kind == PEAGLE_MOE_BLOCK_128;
    std::string const quantForm = scale_kind == PEAGLE_MOE_PER_CHANNEL ? ".row" : ".group"; // per row / 128 columns
    void const* a = x;
    void const* aScales = weights; // unread without dynamic quantization
    int32_t hGroups = static_cast<int32_t>(ceilDiv(hidden, kMoeGroup));
    int32_t iGroups = static_cast<int32_t>(ceilDiv(inter, kMoeGroup));
    int32_t nGroups13 = static_cast<int32_t>(ceilDiv(2 * static_cast<int64_t>(inter), kMoeGroup));
    if (dynamic)
    {
        void* codes = ws + L.xCodes;
        void* scales = ws + L.xScales;
        void* quantArgs[] = {&x, &codes, &scales, &hidden, &hGroups};
        if ((err = launch("moe_quant." + act + quantForm, dim3(tokens), quantArgs, 5, stream)) != cudaSuccess)
            return err;
        a = codes;
        aScales = scales;
    }
    void const* none = nullptr; // absent optional inputs: never read
    void const* s13 = fp8 ? static_cast<void const*>(w13_scale) : none;
    void const* s2 = fp8 ? static_cast<void const*>(w2_scale) : none;
    void const* a13 = perTensor ? static_cast<void const*>(a13_scale) : none;
    void const* a2 = perTensor ? static_cast<void const*>(a2_scale) : none;
    int32_t hasB13 = b13 != nullptr, hasB2 = b2 != nullptr;
    void* gateUpArgs[] = {&a, &aScales, &w13, &s13, &a13, &b13, &h, &sorted, &blockExpert, &total, &pairs, &top_k,
        &hidden, &inter, &hGroups, &nGroups13, &activation, &swiglu_alpha, &swiglu_limit, &hasB13};
    dim3 const gateUpGrid(blocks, static_cast<uint32_t>(ceilDiv(inter, kMoeBlockN)));
    if ((err = launch("moe_gate_up." + act + "." + weightKind + "." + regime, gateUpGrid, gateUpArgs, 20, stream))
        != cudaSuccess)
        return err;
    void const* hIn = h;
    void const* hScales = weights;
    if (dynamic)
    {
        void* codes = ws + L.hCodes;
        void* scales = ws + L.hScales;
        void* quantArgs[] = {&h, &codes, &scales, &inter, &iGroups};
        if ((err = launch("moe_quant." + act + quantForm, dim3(pairs), quantArgs, 5, stream)) != cudaSuccess)
            return err;
        hIn = codes;
        hScales = scales;
    }
    void* downArgs[] = {&hIn, &hScales, &w2, &s2, &a2, &b2, &o, &sorted, &blockExpert, &total, &pairs, &hidden, &inter,
        &iGroups, &hGroups, &hasB2};
    dim3 const downGrid(blocks, static_cast<uint32_t>(ceilDiv(hidden, kMoeBlockN)));
    if ((err = launch("moe_down." + act + "." + weightKind + "." + regime, downGrid, downArgs, 16, stream))
        != cudaSuccess)
        return err;
    void* sumArgs[] = {&o, &weights, &y, &hidden, &top_k};
    dim3 const sumGrid(tokens, static_cast<uint32_t>(ceilDiv(hidden, kMoeSumBlock)));
    return launch("moe_sum." + act, sumGrid, sumArgs, 5, stream);
}

char const* peagle_error_string(cudaError_t err)
{
    return cudaGetErrorString(err);
}

int32_t peagle_kernels_version(void)
{
    return 4;
}

} // extern "C"
