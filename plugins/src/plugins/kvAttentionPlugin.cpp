// PEagleKVAttention: TensorRT wrapper of peagle_kv_attention (see peaglePlugins.h for the I/O). An 8th
// input, tree_mask [B, S, W] int32, makes it the draft-tree form (peagle_kv_attention_tree): the target
// graph's nodes carry it (the TensorRT copy drops the empty sinks slot before it, onnx_defs.strip_functions).
#include "peaglePlugins.h"

#include <cmath>
#include <new>

namespace peagle
{
namespace trt
{
namespace
{
enum : int32_t
{
    kQ = 0,
    kK,
    kV,
    kPositions,
    kBlockTables,
    kKCache,
    kVCache,
    kNbInputs, // without a tree mask
    kTreeMask = kNbInputs,
    kOut = 0,
    kKCacheOut,
    kVCacheOut,
    kNbOutputs
};

bool inputCount(int32_t nbInputs)
{
    return nbInputs == kNbInputs || nbInputs == kNbInputs + 1;
}
} // namespace

KVAttentionPlugin::KVAttentionPlugin(
    int32_t numHeads, int32_t numKvHeads, int32_t headDim, float scale, float kScale, float vScale)
    : mNumHeads(numHeads)
    , mNumKvHeads(numKvHeads)
    , mHeadDim(headDim)
    , mScale(scale)
    , mKScale(kScale)
    , mVScale(vScale)
{
}

nvinfer1::IPluginV3* KVAttentionPlugin::clone() noexcept
{
    auto* plugin = new (std::nothrow) KVAttentionPlugin(mNumHeads, mNumKvHeads, mHeadDim, mScale, mKScale, mVScale);
    if (plugin)
        plugin->mTree = mTree;
    return plugin;
}

int32_t KVAttentionPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (!inputCount(nbInputs) || nbOutputs != kNbOutputs)
        return 1;
    outputTypes[kOut] = inputTypes[kQ];
    outputTypes[kKCacheOut] = inputTypes[kKCache];
    outputTypes[kVCacheOut] = inputTypes[kVCache];
    return 0;
}

int32_t KVAttentionPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (!inputCount(nbInputs) || nbOutputs != kNbOutputs || inputs[kQ].nbDims != 3 || inputs[kPositions].nbDims != 2
        || inputs[kBlockTables].nbDims != 2 || inputs[kKCache].nbDims != 4 || inputs[kVCache].nbDims != 4
        || (nbInputs > kNbInputs && inputs[kTreeMask].nbDims != 3))
        return 1;
    outputs[kOut] = inputs[kQ];            // [B, S, H*d]
    outputs[kKCacheOut] = inputs[kKCache]; // [NB+1, bs, KV, d], same buffer
    outputs[kVCacheOut] = inputs[kVCache];
    return 0;
}

bool KVAttentionPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (!inputCount(nbInputs) || nbOutputs != kNbOutputs || pos < 0 || pos >= nbInputs + nbOutputs)
        return false;
    if (!isLinear(inOut[pos]))
        return false;
    nvinfer1::DataType const t = inOut[pos].desc.type;
    if (nbInputs > kNbInputs && pos == kTreeMask)
        return t == nvinfer1::DataType::kINT32; // packed ancestor bits
    if (pos >= nbInputs)
        pos += kNbInputs - nbInputs; // outputs: numbered as without a tree mask
    switch (pos)
    {
    case kQ: return isActivationType(t);
    case kK:
    case kV: return t == inOut[kQ].desc.type;
    case kPositions:
    case kBlockTables: return t == nvinfer1::DataType::kINT64;
    // FP8 caches under 16-bit activations only: no fp32 + FP8 cubin is compiled (it spills registers)
    case kKCache:
        return t == inOut[kQ].desc.type
            || (t == nvinfer1::DataType::kFP8 && inOut[kQ].desc.type != nvinfer1::DataType::kFLOAT);
    case kVCache: return t == inOut[kKCache].desc.type;
    case kNbInputs + kOut: return t == inOut[kQ].desc.type;
    case kNbInputs + kKCacheOut: return t == inOut[kKCache].desc.type;
    case kNbInputs + kVCacheOut: return t == inOut[kVCache].desc.type;
    default: return false;
    }
}

int32_t KVAttentionPlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (!inputCount(nbInputs) || nbOutputs != kNbOutputs)
        return 1;
    mTree = nbInputs > kNbInputs;
    if (mTree && (in[kTreeMask].desc.dims.nbDims != 3 || in[kTreeMask].desc.type != nvinfer1::DataType::kINT32))
    {
        logError("PEagleKVAttention: tree_mask must be int32 [B, S, ceil(S / 32)]");
        return 1;
    }
    if (mHeadDim != 64 && mHeadDim != 128 && mHeadDim != 256)
    {
        // the compiled Triton variants (peagle_trt/ops/triton_kernels/variants.py, HEAD_DIMS)
        logError("PEagleKVAttention: head_dim must be 64, 128 or 256 (the compiled kernel variants)");
        return 1;
    }
    nvinfer1::Dims const& cache = in[kKCache].desc.dims;
    nvinfer1::Dims const& vCache = in[kVCache].desc.dims;
    nvinfer1::Dims const& q = in[kQ].desc.dims;
    nvinfer1::Dims const& tables = in[kBlockTables].desc.dims;
    // static dims must agree with the attributes (-1 = not known yet); caches [NB+1, bs, KV, d]
    if (cache.nbDims != 4 || q.nbDims != 3 || (cache.d[2] >= 0 && cache.d[2] != mNumKvHeads)
        || (cache.d[3] >= 0 && cache.d[3] != mHeadDim)
        || (q.d[2] >= 0 && q.d[2] != static_cast<int64_t>(mNumHeads) * mHeadDim))
    {
        logError("PEagleKVAttention: input shapes do not match num_heads / num_kv_heads / head_dim");
        return 1;
    }
    if (tables.nbDims != 2 || in[kPositions].desc.dims.nbDims != 2 || vCache.nbDims != 4)
    {
        logError("PEagleKVAttention: expected positions [B, S], block_tables [B, M] and caches [NB+1, bs, KV, d]");
        return 1;
    }
    for (int32_t i = 0; i < 4; ++i)
    {
        if (cache.d[i] >= 0 && vCache.d[i] >= 0 && cache.d[i] != vCache.d[i])
        {
            logError("PEagleKVAttention: k_cache and v_cache shapes differ");
            return 1;
        }
    }
    return 0;
}

size_t KVAttentionPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (!inputCount(nbInputs))
        return 0;
    // the bound is monotone in (batch, rows, keys): sized for the profile maximum, enough for any shape in it
    nvinfer1::Dims const& q = inputs[kQ].max;
    nvinfer1::Dims const& tables = inputs[kBlockTables].max;
    nvinfer1::Dims const& cache = inputs[kKCache].max;
    int64_t const keys = tables.d[1] * cache.d[1]; // M * bs: positions a table addresses
    if (q.nbDims != 3 || tables.nbDims != 2 || cache.nbDims != 4 || keys <= 0 || keys > 0x7fffffff)
        return 0;
    return peagle_kv_attention_workspace_size(static_cast<int32_t>(q.d[0]), static_cast<int32_t>(q.d[1]),
        mNumHeads, mHeadDim, static_cast<int32_t>(keys));
}

int32_t KVAttentionPlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept
{
    if (!inputCount(nbInputs) || nbOutputs != kNbOutputs)
        return 1;
    mTree = nbInputs > kNbInputs;
    return mTree && (in[kTreeMask].dims.nbDims != 3 || in[kTreeMask].type != nvinfer1::DataType::kINT32) ? 1 : 0;
}

int32_t KVAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept
{
    if (outputIndex == kKCacheOut)
        return kKCache;
    if (outputIndex == kVCacheOut)
        return kVCache;
    return -1;
}

int32_t KVAttentionPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    nvinfer1::Dims const& q = inputDesc[kQ].dims;
    nvinfer1::Dims const& tables = inputDesc[kBlockTables].dims;
    nvinfer1::Dims const& cache = inputDesc[kKCache].dims;
    peagle_dtype_t actType, cacheType;
    if (!toKernelType(inputDesc[kQ].type, actType) || !toKernelType(inputDesc[kKCache].type, cacheType)
        || q.nbDims != 3 || tables.nbDims != 2 || cache.nbDims != 4 || tables.d[0] != q.d[0]
        || cache.d[2] != mNumKvHeads || cache.d[3] != mHeadDim)
    {
        logError("PEagleKVAttention: unexpected input types or shapes (block_tables [B, M], caches [NB+1, bs, KV, d])");
        return 1;
    }
    int32_t const batch = static_cast<int32_t>(q.d[0]);
    int32_t const rows = static_cast<int32_t>(q.d[1]);
    int32_t const cacheBlocks = static_cast<int32_t>(cache.d[0]); // the trash block included
    int32_t const blockSize = static_cast<int32_t>(cache.d[1]);
    int32_t const maxBlocks = static_cast<int32_t>(tables.d[1]);
    int64_t const keys = static_cast<int64_t>(maxBlocks) * blockSize;

    // outputs 1/2 alias inputs 5/6; should TensorRT ever hand distinct buffers, carry the cache over first
    size_t const cacheBytes = static_cast<size_t>(volume(cache)) * elementSize(inputDesc[kKCache].type);
    for (int32_t i : {0, 1})
    {
        void const* src = inputs[kKCache + i];
        void* dst = outputs[kKCacheOut + i];
        if (src == dst)
            continue;
        cudaError_t const copied = cudaMemcpyAsync(dst, src, cacheBytes, cudaMemcpyDeviceToDevice, stream);
        if (copied != cudaSuccess)
            return kernelStatus(copied, "PEagleKVAttention (cache copy)");
    }
    size_t const ws = workspace && keys > 0 && keys <= 0x7fffffff
        ? peagle_kv_attention_workspace_size(batch, rows, mNumHeads, mHeadDim, static_cast<int32_t>(keys))
        : 0;
    if (mTree)
    {
        nvinfer1::Dims const& mask = inputDesc[kTreeMask].dims;
        if (mask.nbDims != 3 || mask.d[0] != q.d[0] || mask.d[1] != q.d[1])
        {
            logError("PEagleKVAttention: tree_mask must be [B, S, ceil(S / 32)] for q [B, S, H*d]");
            return 1;
        }
        cudaError_t const err = peagle_kv_attention_tree(inputs[kQ], inputs[kK], inputs[kV],
            static_cast<int64_t const*>(inputs[kPositions]), static_cast<int64_t const*>(inputs[kBlockTables]),
            static_cast<int32_t const*>(inputs[kTreeMask]), static_cast<int32_t>(mask.d[2]), outputs[kKCacheOut],
            outputs[kVCacheOut], outputs[kOut], batch, rows, mNumHeads, mNumKvHeads, mHeadDim, cacheBlocks,
            blockSize, maxBlocks, mScale, mKScale, mVScale, actType, cacheType, stream);
        return kernelStatus(err, kName);
    }
    cudaError_t const err = peagle_kv_attention(inputs[kQ], inputs[kK], inputs[kV],
        static_cast<int64_t const*>(inputs[kPositions]), static_cast<int64_t const*>(inputs[kBlockTables]),
        outputs[kKCacheOut], outputs[kVCacheOut], outputs[kOut], batch, rows, mNumHeads, mNumKvHeads, mHeadDim,
        cacheBlocks, blockSize, maxBlocks, mScale, mKScale, mVScale, actType, cacheType, workspace, ws, 0, stream);
    return kernelStatus(err, kName);
}

nvinfer1::PluginFieldCollection const* KVAttentionPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mFields.clear();
        mFields.addInt("num_heads", &mNumHeads);
        mFields.addInt("num_kv_heads", &mNumKvHeads);
        mFields.addInt("head_dim", &mHeadDim);
        mFields.addFloat("scale", &mScale);
        mFields.addFloat("k_scale", &mKScale);
        mFields.addFloat("v_scale", &mVScale);
        return mFields.collection();
    }
    catch (...)
    {
        return nullptr;
    }
}

// ------------------------------------------------------------------------------------------------

KVAttentionPluginCreator::KVAttentionPluginCreator()
{
    declareField("num_heads", nvinfer1::PluginFieldType::kINT32);
    declareField("num_kv_heads", nvinfer1::PluginFieldType::kINT32);
    declareField("head_dim", nvinfer1::PluginFieldType::kINT32);
    declareField("scale", nvinfer1::PluginFieldType::kFLOAT32);
    declareField("k_scale", nvinfer1::PluginFieldType::kFLOAT32);
    declareField("v_scale", nvinfer1::PluginFieldType::kFLOAT32);
}

nvinfer1::IPluginV3* KVAttentionPluginCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    double heads = 0, kvHeads = 0, headDim = 0, scale = 0, kScale = 1, vScale = 1;
    bool const ok = readNumber(fc, "num_heads", heads) && readNumber(fc, "num_kv_heads", kvHeads)
        && readNumber(fc, "head_dim", headDim);
    readNumber(fc, "scale", scale); // optional: <= 0 means 1/sqrt(head_dim)
    readNumber(fc, "k_scale", kScale);
    readNumber(fc, "v_scale", vScale);
    if (!ok || heads < 1 || kvHeads < 1 || headDim < 1 || static_cast<int64_t>(heads) % static_cast<int64_t>(kvHeads)
        || !(kScale > 0) || !(vScale > 0))
    {
        logError("PEagleKVAttention: needs num_heads, num_kv_heads (dividing num_heads) and head_dim > 0");
        return nullptr;
    }
    if (!(scale > 0))
        scale = 1.0 / std::sqrt(headDim);
    return new (std::nothrow) KVAttentionPlugin(static_cast<int32_t>(heads), static_cast<int32_t>(kvHeads),
        static_cast<int32_t>(headDim), static_cast<float>(scale), static_cast<float>(kScale),
        static_cast<float>(vScale));
}

} // namespace trt
} // namespace peagle
