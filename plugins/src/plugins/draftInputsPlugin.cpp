// PEagleDraftInputs: TensorRT wrapper of peagle_draft_inputs (see peaglePlugins.h for the I/O).
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
    kPendingIds = 0,
    kPendingHidden,
    kNumPending,
    kCur,
    kEmbedTokens,
    kHMask,
    kNbInputs,
    kEmbeds = 0,
    kHidden,
    kPositions,
    kSampleRows,
    kNbOutputs
};
} // namespace

DraftInputsPlugin::DraftInputsPlugin(int32_t numSpecTokens, int64_t maskTokenId)
    : mNumSpecTokens(numSpecTokens)
    , mMaskTokenId(maskTokenId)
    , mMaskTokenId32(static_cast<int32_t>(maskTokenId))
{
}

nvinfer1::IPluginV3* DraftInputsPlugin::clone() noexcept
{
    return new (std::nothrow) DraftInputsPlugin(mNumSpecTokens, mMaskTokenId);
}

int32_t DraftInputsPlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
        return 1;
    outputTypes[kEmbeds] = inputTypes[kEmbedTokens];
    outputTypes[kHidden] = inputTypes[kPendingHidden];
    outputTypes[kPositions] = nvinfer1::DataType::kINT64;
    outputTypes[kSampleRows] = nvinfer1::DataType::kINT64;
    return 0;
}

int32_t DraftInputsPlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[kPendingIds].nbDims != 2
        || inputs[kPendingHidden].nbDims != 3)
        return 1;
    nvinfer1::IDimensionExpr const* batch = inputs[kPendingIds].d[0];
    // R = P + K - 1 rows per request
    nvinfer1::IDimensionExpr const* rows = exprBuilder.operation(
        nvinfer1::DimensionOperation::kSUM, *inputs[kPendingIds].d[1], *exprBuilder.constant(mNumSpecTokens - 1));
    nvinfer1::IDimensionExpr const* hidden = inputs[kPendingHidden].d[2];
    for (int32_t i : {static_cast<int32_t>(kEmbeds), static_cast<int32_t>(kHidden)})
    {
        outputs[i].nbDims = 3;
        outputs[i].d[0] = batch;
        outputs[i].d[1] = rows;
        outputs[i].d[2] = hidden;
    }
    outputs[kPositions].nbDims = 2;
    outputs[kPositions].d[0] = batch;
    outputs[kPositions].d[1] = rows;
    outputs[kSampleRows].nbDims = 2;
    outputs[kSampleRows].d[0] = batch;
    outputs[kSampleRows].d[1] = exprBuilder.constant(mNumSpecTokens);
    return 0;
}

bool DraftInputsPlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
        return false;
    if (!isLinear(inOut[pos]))
        return false;
    nvinfer1::DataType const t = inOut[pos].desc.type;
    switch (pos)
    {
    case kPendingIds:
    case kNumPending:
    case kCur:
    case kNbInputs + kPositions:
    case kNbInputs + kSampleRows: return t == nvinfer1::DataType::kINT64;
    case kPendingHidden: return isActivationType(t);
    case kEmbedTokens:
    case kHMask:
    case kNbInputs + kEmbeds:
    case kNbInputs + kHidden: return t == inOut[kPendingHidden].desc.type; // one dtype for all rows
    default: return false;
    }
}

size_t DraftInputsPlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/,
    int32_t /*nbInputs*/, nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

int32_t DraftInputsPlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs,
    void* /*workspace*/, cudaStream_t stream) noexcept
{
    peagle_dtype_t dtype;
    if (!toKernelType(inputDesc[kPendingHidden].type, dtype))
    {
        logError("PEagleDraftInputs: unsupported hidden-state type");
        return 1;
    }
    nvinfer1::Dims const& ids = inputDesc[kPendingIds].dims;
    cudaError_t const err = peagle_draft_inputs(static_cast<int64_t const*>(inputs[kPendingIds]),
        inputs[kPendingHidden], static_cast<int64_t const*>(inputs[kNumPending]),
        static_cast<int64_t const*>(inputs[kCur]), inputs[kEmbedTokens], inputs[kHMask], outputs[kEmbeds],
        outputs[kHidden], static_cast<int64_t*>(outputs[kPositions]), static_cast<int64_t*>(outputs[kSampleRows]),
        static_cast<int32_t>(ids.d[0]), static_cast<int32_t>(ids.d[1]),
        static_cast<int32_t>(inputDesc[kPendingHidden].dims.d[2]), inputDesc[kEmbedTokens].dims.d[0], mNumSpecTokens,
        mMaskTokenId, dtype, stream);
    return kernelStatus(err, kName);
}

nvinfer1::PluginFieldCollection const* DraftInputsPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mFields.clear();
        mFields.addInt("num_spec_tokens", &mNumSpecTokens);
        mFields.addInt("mask_token_id", &mMaskTokenId32);
        return mFields.collection();
    }
    catch (...)
    {
        return nullptr;
    }
}

// ------------------------------------------------------------------------------------------------

DraftInputsPluginCreator::DraftInputsPluginCreator()
{
    declareField("num_spec_tokens", nvinfer1::PluginFieldType::kINT32);
    declareField("mask_token_id", nvinfer1::PluginFieldType::kINT32);
}

nvinfer1::IPluginV3* DraftInputsPluginCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    double k = 0, mask = -1;
    if (!readNumber(fc, "num_spec_tokens", k) || !readNumber(fc, "mask_token_id", mask) || k < 1 || mask < 0)
    {
        logError("PEagleDraftInputs: needs num_spec_tokens >= 1 and mask_token_id >= 0");
        return nullptr;
    }
    return new (std::nothrow) DraftInputsPlugin(static_cast<int32_t>(k), static_cast<int64_t>(mask));
}

} // namespace trt
} // namespace peagle
