// PEagleDraftSample: TensorRT wrapper of peagle_draft_sample (see peaglePlugins.h for the I/O).
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
    kLogits = 0,
    kD2t,
    kNbInputs,
    kDraftIds = 0,
    kNbOutputs
};
} // namespace

nvinfer1::IPluginV3* DraftSamplePlugin::clone() noexcept
{
    return new (std::nothrow) DraftSamplePlugin();
}

int32_t DraftSamplePlugin::getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
    nvinfer1::DataType const* /*inputTypes*/, int32_t nbInputs) const noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
        return 1;
    outputTypes[kDraftIds] = nvinfer1::DataType::kINT64;
    return 0;
}

int32_t DraftSamplePlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
    nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/, nvinfer1::DimsExprs* outputs,
    int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || inputs[kLogits].nbDims != 3)
        return 1;
    outputs[kDraftIds].nbDims = 2; // [B, K]
    outputs[kDraftIds].d[0] = inputs[kLogits].d[0];
    outputs[kDraftIds].d[1] = inputs[kLogits].d[1];
    return 0;
}

bool DraftSamplePlugin::supportsFormatCombination(
    int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
        return false;
    if (!isLinear(inOut[pos]))
        return false;
    nvinfer1::DataType const t = inOut[pos].desc.type;
    switch (pos)
    {
    case kLogits: return isActivationType(t); // float32 per the contract; fp16/bf16 also work
    case kD2t:
    case kNbInputs + kDraftIds: return t == nvinfer1::DataType::kINT64;
    default: return false;
    }
}

size_t DraftSamplePlugin::getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
    nvinfer1::DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    if (nbInputs != kNbInputs)
        return 0;
    nvinfer1::Dims const& logits = inputs[kLogits].max;
    return peagle_draft_sample_workspace_size(static_cast<int32_t>(logits.d[0] * logits.d[1]), logits.d[2]);
}

int32_t DraftSamplePlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
    nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs, void* const* outputs, void* workspace,
    cudaStream_t stream) noexcept
{
    peagle_dtype_t dtype;
    if (!toKernelType(inputDesc[kLogits].type, dtype) || dtype == PEAGLE_FP8_E4M3)
    {
        logError("PEagleDraftSample: unsupported logits type");
        return 1;
    }
    nvinfer1::Dims const& logits = inputDesc[kLogits].dims;
    int32_t const rows = static_cast<int32_t>(logits.d[0] * logits.d[1]);
    size_t const ws = workspace ? peagle_draft_sample_workspace_size(rows, logits.d[2]) : 0;
    cudaError_t const err = peagle_draft_sample(inputs[kLogits], static_cast<int64_t const*>(inputs[kD2t]),
        static_cast<int64_t*>(outputs[kDraftIds]), rows, logits.d[2], dtype, workspace, ws, stream);
    return kernelStatus(err, kName);
}

nvinfer1::PluginFieldCollection const* DraftSamplePlugin::getFieldsToSerialize() noexcept
{
    return mFields.collection(); // no attributes
}

// ------------------------------------------------------------------------------------------------

nvinfer1::IPluginV3* DraftSamplePluginCreator::createPlugin(
    char const* /*name*/, nvinfer1::PluginFieldCollection const* /*fc*/, nvinfer1::TensorRTPhase /*phase*/) noexcept
{
    return new (std::nothrow) DraftSamplePlugin();
}

} // namespace trt
} // namespace peagle
