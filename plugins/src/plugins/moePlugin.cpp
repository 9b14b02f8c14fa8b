// PEagleMoE: TensorRT wrapper of peagle_moe (see peaglePlugins.h for the I/O). The inputs are the ONNX
// node's, by position; an absent optional input is an empty (0-element) tensor in its slot, or left off
// at the end of the list (TensorRT takes no empty input name).
#include "peaglePlugins.h"

#include <new>

namespace peagle
{
namespace trt
{
namespace
{
enum : int32_t
{
    kX = 0,
    kLogits,
    kW13,
    kW2,
    kB13,
    kB2,
    kExpertScale,
    kW13Scale,
    kW2Scale,
    kA13Scale,
    kA2Scale,
    kMaxInputs,
    kMinInputs = kW2 + 1,
    kY = 0,
    kNbOutputs
};

//! What one call's inputs are: sizes (-1 where not known yet), which optional inputs are present and
//! the FP8 scale kind.
struct MoeInputs
{
    int64_t tokens = -1, hidden = -1, experts = -1, inter = -1;
    bool present[kMaxInputs] = {};
    peagle_moe_scale_t kind = PEAGLE_MOE_NO_SCALE;
};

bool known(int64_t a, int64_t b)
{
    return a < 0 || b < 0 || a == b; // -1: a dimension TensorRT does not know at build time
}

//! Read the inputs' dims and types (nb of them); nullptr when they fit the contract, else why not.
char const* describe(nvinfer1::Dims const* dims, nvinfer1::DataType const* types, int32_t nb, int32_t topK,
    MoeInputs& io) noexcept
{
    if (nb < kMinInputs || nb > kMaxInputs)
        return "PEagleMoE: expects 4 to 11 inputs (x, router_logits, w13, w2, then the optional ones)";
    for (int32_t i = 0; i < nb; ++i)
        io.present[i] = volume(dims[i]) != 0; // dynamic dims (-1) count as present
    if (!io.present[kX] || !io.present[kLogits] || !io.present[kW13] || !io.present[kW2])
        return "PEagleMoE: x, router_logits, w13 and w2 are required";
    nvinfer1::Dims const &x = dims[kX], &logits = dims[kLogits], &w13 = dims[kW13], &w2 = dims[kW2];
    if (x.nbDims != 2 || logits.nbDims != 2 || w13.nbDims != 3 || w2.nbDims != 3)
        return "PEagleMoE: expected x [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I]";
    io.tokens = x.d[0];
    io.hidden = x.d[1];
    io.experts = w13.d[0];
    io.inter = w2.d[2];
    if (!known(logits.d[0], io.tokens) || !known(logits.d[1], io.experts) || !known(w2.d[0], io.experts)
        || !known(w13.d[2], io.hidden) || !known(w2.d[1], io.hidden)
        || !known(w13.d[1], io.inter < 0 ? -1 : 2 * io.inter))
        return "PEagleMoE: input shapes disagree (x [T, H], router_logits [T, E], w13 [E, 2I, H], w2 [E, H, I])";
    if (io.experts >= 0 && topK > io.experts)
        return "PEagleMoE: top_k exceeds the number of experts";
    if (types[kW2] != types[kW13])
        return "PEagleMoE: w13 and w2 must share a type";
    bool const fp8 = types[kW13] == nvinfer1::DataType::kFP8;
    bool const anyScale = io.present[kW13Scale] || io.present[kW2Scale] || io.present[kA13Scale] || io.present[kA2Scale];
    if (!fp8)
        return anyScale ? "PEagleMoE: scales are only for FP8 weights" : nullptr;
    if (!io.present[kW13Scale] || !io.present[kW2Scale])
        return "PEagleMoE: FP8 weights need w13_scale and w2_scale";
    int32_t const rank = dims[kW13Scale].nbDims; // [E] per tensor, [E, N] per channel, [E, N/128, K/128] blocks
    if (rank < 1 || rank > 3 || dims[kW2Scale].nbDims != rank)
        return "PEagleMoE: w13_scale / w2_scale must both be [E], [E, N] or [E, ceil(N/128), ceil(K/128)]";
    io.kind = static_cast<peagle_moe_scale_t>(rank);
    bool const statics = io.present[kA13Scale] && io.present[kA2Scale];
    if ((io.kind == PEAGLE_MOE_PER_TENSOR) != statics || (!statics && (io.present[kA13Scale] || io.present[kA2Scale])))
        return "PEagleMoE: a13_scale and a2_scale are required with per-tensor scales and refused otherwise";
    return nullptr;
}

bool isFp8(nvinfer1::DataType t)
{
    return t == nvinfer1::DataType::kFP8;
}
} // namespace

MoEPlugin::MoEPlugin(
    int32_t topK, int32_t routing, int32_t renormalize, int32_t activation, float swigluAlpha, float swigluLimit)
    : mTopK(topK)
    , mRouting(routing)
    , mRenormalize(renormalize)
    , mActivation(activation)
    , mSwigluAlpha(swigluAlpha)
    , mSwigluLimit(swigluLimit)
{
}

nvinfer1::IPluginV3* MoEPlugin::clone() noexcept
{
    auto* plugin = new (std::nothrow) MoEPlugin(mTopK, mRouting, mRenormalize, mActivation, mSwigluAlpha, mSwigluLimit);
    if (plugin)
        plugin->mNbInputs = mNbInputs;
    return plugin;
}

int32_t MoEPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs || nbOutputs != kNbOutputs)
        return 1;
    outputTypes[kY] = inputTypes[kX];
    return 0;
}

int32_t MoEPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs || nbOutputs != kNbOutputs || inputs[kX].nbDims != 2)
        return 1;
    outputs[kY] = inputs[kX]; // [T, H]
    return 0;
}

bool MoEPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs || nbOutputs != kNbOutputs || pos < 0
        || pos >= nbInputs + nbOutputs || !isLinear(inOut[pos]))
        return false;
    nvinfer1::DataType const t = inOut[pos].desc.type;
    nvinfer1::DataType const act = inOut[kX].desc.type;
    if (pos >= nbInputs)
        return t == act; // y
    if (pos > kW2 && volume(inOut[pos].desc.dims) == 0)
        return true; // an absent optional input: never read
    switch (pos)
    {
    case kX:
    case kLogits: return isActivationType(t);
    // FP8 experts under 16-bit activations only (the compiled variants, as the FP8 GEMM's)
    case kW13: return t == act || (isFp8(t) && act != nvinfer1::DataType::kFLOAT);
    case kW2: return t == inOut[kW13].desc.type;
    case kB13:
    case kB2: return t == act;
    case kExpertScale:
    case kW13Scale:
    case kW2Scale:
    case kA13Scale:
    case kA2Scale: return t == nvinfer1::DataType::kFLOAT;
    default: return false;
    }
}

int32_t MoEPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs || nbOutputs != kNbOutputs)
        return 1;
    nvinfer1::Dims dims[kMaxInputs];
    nvinfer1::DataType types[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = in[i].desc.dims;
        types[i] = in[i].desc.type;
    }
    mNbInputs = nbInputs;
    MoeInputs io;
    char const* why = describe(dims, types, nbInputs, mTopK, io);
    if (why == nullptr && (io.kind == PEAGLE_MOE_BLOCK_128 && io.inter >= 0 && io.inter % 128))
        why = "PEagleMoE: 128 x 128 block scales need the intermediate size I to be a multiple of 128";
    if (why == nullptr && io.hidden >= 0 && io.experts >= 0 && io.inter >= 0)
    {
        peagle_dtype_t act;
        if (!toKernelType(types[kX], act)
            || peagle_moe_workspace_size(1, static_cast<int32_t>(io.hidden), static_cast<int32_t>(io.experts),
                   static_cast<int32_t>(io.inter), mTopK, act, io.kind)
                == 0)
            why = "PEagleMoE: no compiled kernel for these sizes (experts <= 256, top_k <= 8, H and I multiples "
                  "of 32 / 64 / 128 for fp32 / 16-bit / FP8)";
    }
    if (why != nullptr)
    {
        logError(why);
        return 1;
    }
    return 0;
}

int32_t MoEPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs || nbOutputs != kNbOutputs)
        return 1;
    nvinfer1::Dims dims[kMaxInputs];
    nvinfer1::DataType types[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = in[i].dims;
        types[i] = in[i].type;
    }
    mNbInputs = nbInputs; // enqueue is not told the count
    MoeInputs io;
    return describe(dims, types, nbInputs, mTopK, io) == nullptr ? 0 : 1;
}

size_t MoEPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (nbInputs < kMinInputs || nbInputs > kMaxInputs)
        return 0;
    nvinfer1::Dims dims[kMaxInputs];
    nvinfer1::DataType types[kMaxInputs];
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        dims[i] = inputs[i].max; // the profile's largest shapes: the workspace grows with the rows
        types[i] = inputs[i].desc.type;
    }
    MoeInputs io;
    peagle_dtype_t act;
    if (describe(dims, types, nbInputs, mTopK, io) != nullptr || !toKernelType(types[kX], act) || io.tokens < 0)
        return 0;
    return peagle_moe_workspace_size(static_cast<int32_t>(io.tokens), static_cast<int32_t>(io.hidden),
        static_cast<int32_t>(io.experts), static_cast<int32_t>(io.inter), mTopK, act, io.kind);
}

int32_t MoEPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    nvinfer1::Dims dims[kMaxInputs];
    nvinfer1::DataType types[kMaxInputs];
    for (int32_t i = 0; i < mNbInputs; ++i)
    {
        dims[i] = inputDesc[i].dims;
        types[i] = inputDesc[i].type;
    }
    MoeInputs io;
    peagle_dtype_t act, logits;
    char const* why = describe(dims, types, mNbInputs, mTopK, io);
    if (why != nullptr || !toKernelType(types[kX], act) || !toKernelType(types[kLogits], logits))
    {
        logError(why != nullptr ? why : "PEagleMoE: unsupported input types");
        return 1;
    }
    auto in = [&](int32_t i) { return i < mNbInputs && io.present[i] ? inputs[i] : nullptr; };
    size_t const ws = peagle_moe_workspace_size(static_cast<int32_t>(io.tokens), static_cast<int32_t>(io.hidden),
        static_cast<int32_t>(io.experts), static_cast<int32_t>(io.inter), mTopK, act, io.kind);
    cudaError_t const err = peagle_moe(inputs[kX], inputs[kLogits], inputs[kW13], inputs[kW2], in(kB13), in(kB2),
        static_cast<float const*>(in(kExpertScale)), static_cast<float const*>(in(kW13Scale)),
        static_cast<float const*>(in(kW2Scale)), static_cast<float const*>(in(kA13Scale)),
        static_cast<float const*>(in(kA2Scale)), outputs[kY], static_cast<int32_t>(io.tokens),
        static_cast<int32_t>(io.hidden), static_cast<int32_t>(io.experts), static_cast<int32_t>(io.inter), mTopK,
        mRouting, mRenormalize, mActivation, mSwigluAlpha, mSwigluLimit, act, logits, io.kind, workspace, ws, stream);
    return kernelStatus(err, kName);
}

nvinfer1::PluginFieldCollection const* MoEPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mFields.clear();
        mFields.addInt("top_k", &mTopK);
        mFields.addInt("routing", &mRouting);
        mFields.addInt("renormalize", &mRenormalize);
        mFields.addInt("activation", &mActivation);
        mFields.addFloat("swiglu_alpha", &mSwigluAlpha);
        mFields.addFloat("swiglu_limit", &mSwigluLimit);
        return mFields.collection();
    }
    catch (...)
    {
        return nullptr;
    }
}

// ------------------------------------------------------------------------------------------------

MoEPluginCreator::MoEPluginCreator()
{
    declareField("top_k", nvinfer1::PluginFieldType::kINT32);
    declareField("routing", nvinfer1::PluginFieldType::kINT32);
    declareField("renormalize", nvinfer1::PluginFieldType::kINT32);
    declareField("activation", nvinfer1::PluginFieldType::kINT32);
    declareField("swiglu_alpha", nvinfer1::PluginFieldType::kFLOAT32);
    declareField("swiglu_limit", nvinfer1::PluginFieldType::kFLOAT32);
}

nvinfer1::IPluginV3* MoEPluginCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    double topK = 0, routing = 0, renormalize = 0, activation = 0, alpha = 1.702, limit = 7.0;
    bool const ok = readNumber(fc, "top_k", topK);
    readNumber(fc, "routing", routing); // optional, the contract's defaults
    readNumber(fc, "renormalize", renormalize);
    readNumber(fc, "activation", activation);
    readNumber(fc, "swiglu_alpha", alpha);
    readNumber(fc, "swiglu_limit", limit);
    if (!ok || topK < 1 || topK > 8 || (routing != 0 && routing != 1) || (renormalize != 0 && renormalize != 1)
        || (activation != 0 && activation != 1 && activation != 2))
    {
        logError("PEagleMoE: needs top_k in 1..8; routing 0 (softmax_topk) or 1 (topk_softmax); renormalize 0 or 1; "
                 "activation 0 (silu), 1 (gelu_tanh) or 2 (clamped_swiglu)");
        return nullptr;
    }
    return new (std::nothrow) MoEPlugin(static_cast<int32_t>(topK), static_cast<int32_t>(routing),
        static_cast<int32_t>(renormalize), static_cast<int32_t>(activation), static_cast<float>(alpha),
        static_cast<float>(limit));
}

} // namespace trt
} // namespace peagle
