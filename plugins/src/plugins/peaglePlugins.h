// TensorRT IPluginV3 plugins of the P-EAGLE custom ops (docs/EXPORT.md, "Plugin nodes").
//
//   PEagleKVAttention  inputs  q [B,S,H*d], k [B,S,KV*d], v, positions [B,S] i64,
//                              block_tables [B,M] i64 (-1 = no block), k_cache [NB+1,bs,KV,d], v_cache
//                              (paged: position p of request b at block block_tables[b, p / bs],
//                              offset p % bs; the last block is the trash block), optional tree_mask
//                              [B,S,W] i32 (draft trees: packed ancestor bits; rows at KV position
//                              positions[b,0] + s, positions by depth: peagle_kv_attention_tree)
//                      outputs out [B,S,H*d], k_cache_out (alias of input 5), v_cache_out (alias of 6)
//                      attrs   num_heads, num_kv_heads, head_dim (int), scale (float, <= 0 or absent:
//                              1/sqrt(head_dim)), k_scale, v_scale (float, FP8 caches only, default 1)
//   PEagleDraftInputs  inputs  pending_ids [B,P] i64, pending_hidden [B,P,H], num_pending [B] i64,
//                              cur [B] i64, embed_tokens [V,H], h_mask [H]
//                      outputs embeds [B,R,H], hidden [B,R,H], positions [B,R] i64, sample_rows [B,K] i64
//                      attrs   num_spec_tokens (K), mask_token_id            (R = P + K - 1)
//   PEagleDraftSample  inputs  logits [B,K,V_d] f32, d2t [V_d] i64; output draft_ids [B,K] i64
//   PEagleMoE          inputs  x [T,H], router_logits [T,E], w13 [E,2I,H], w2 [E,H,I] (x's type or FP8),
//                              then optional b13 [E,2I], b2 [E,H] (x's type), expert_scale [E], w13_scale,
//                              w2_scale (FP8: [E] per tensor, [E,N] per channel, [E,N/128,K/128] blocks),
//                              a13_scale [E], a2_scale [E] (per tensor), all f32: by position, an absent
//                              one as an empty (0-element) tensor, or left off at the end of the list
//                      outputs y [T,H] (x's type)
//                      attrs   top_k; routing (0 softmax_topk, 1 topk_softmax), renormalize (0/1), activation
//                              (0 silu, 1 gelu_tanh, 2 clamped_swiglu), swiglu_alpha, swiglu_limit (floats)
//
// Plugin names equal the ONNX op_types; version "2" (2: paged KV), namespace "". Each plugin object implements
// the core, build (V2: I/O aliasing) and runtime capabilities itself; the enqueue calls the C API of
// libpeagle_kernels.so. The KV-cache aliasing needs PreviewFeature::kALIASED_PLUGIN_IO_10_03 on the
// builder config (TensorRT >= 10.3).
#pragma once

#include "pluginUtils.h"

namespace peagle
{
namespace trt
{

//! Capability plumbing shared by the plugins.
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuildV2,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    ~PluginBase() override = default;

    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore (getPluginName in each plugin)
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

    // IPluginV3OneBuild: nothing to precompute
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;

protected:
    PluginBase() = default;
};

//! Creator plumbing: name/version/namespace and the advertised attribute list.
class CreatorBase : public nvinfer1::IPluginCreatorV3One
{
public:
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }

    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override
    {
        mCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
        mCollection.fields = mFieldNames.empty() ? nullptr : mFieldNames.data();
        return &mCollection;
    }

protected:
    void declareField(char const* name, nvinfer1::PluginFieldType type)
    {
        mFieldNames.emplace_back(name, nullptr, type, 1);
    }

private:
    std::vector<nvinfer1::PluginField> mFieldNames;
    nvinfer1::PluginFieldCollection mCollection{};
};

// ------------------------------------------------------------------------------------------------

class KVAttentionPlugin final : public PluginBase
{
public:
    static constexpr char const* kName = "PEagleKVAttention";

    KVAttentionPlugin(int32_t numHeads, int32_t numKvHeads, int32_t headDim, float scale, float kScale, float vScale);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }

    int32_t getNbOutputs() const noexcept override
    {
        return 3;
    }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    int32_t mNumHeads;
    int32_t mNumKvHeads;
    int32_t mHeadDim;
    float mScale;
    float mKScale;
    float mVScale;
    bool mTree{false}; // an 8th input, tree_mask: the draft-tree form (set from the input count)
    FieldList mFields;
};

class KVAttentionPluginCreator final : public CreatorBase
{
public:
    KVAttentionPluginCreator();
    char const* getPluginName() const noexcept override
    {
        return KVAttentionPlugin::kName;
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

// ------------------------------------------------------------------------------------------------

class DraftInputsPlugin final : public PluginBase
{
public:
    static constexpr char const* kName = "PEagleDraftInputs";

    DraftInputsPlugin(int32_t numSpecTokens, int64_t maskTokenId);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }

    int32_t getNbOutputs() const noexcept override
    {
        return 4;
    }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    int32_t mNumSpecTokens;
    int64_t mMaskTokenId;
    int32_t mMaskTokenId32; // serialized as INT32 (ONNX INT attributes arrive as kINT32)
    FieldList mFields;
};

class DraftInputsPluginCreator final : public CreatorBase
{
public:
    DraftInputsPluginCreator();
    char const* getPluginName() const noexcept override
    {
        return DraftInputsPlugin::kName;
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

// ------------------------------------------------------------------------------------------------

class DraftSamplePlugin final : public PluginBase
{
public:
    static constexpr char const* kName = "PEagleDraftSample";

    DraftSamplePlugin() = default;

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }

    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    FieldList mFields;
};

class DraftSamplePluginCreator final : public CreatorBase
{
public:
    DraftSamplePluginCreator() = default;
    char const* getPluginName() const noexcept override
    {
        return DraftSamplePlugin::kName;
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

// ------------------------------------------------------------------------------------------------

class MoEPlugin final : public PluginBase
{
public:
    static constexpr char const* kName = "PEagleMoE";

    MoEPlugin(int32_t topK, int32_t routing, int32_t renormalize, int32_t activation, float swigluAlpha,
        float swigluLimit);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override
    {
        return kName;
    }

    int32_t getNbOutputs() const noexcept override
    {
        return 1;
    }

    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;

    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    int32_t mTopK;
    int32_t mRouting;
    int32_t mRenormalize;
    int32_t mActivation;
    float mSwigluAlpha;
    float mSwigluLimit;
    int32_t mNbInputs{0}; // inputs of the node (4..11), from configurePlugin / onShapeChange
    FieldList mFields;
};

class MoEPluginCreator final : public CreatorBase
{
public:
    MoEPluginCreator();
    char const* getPluginName() const noexcept override
    {
        return MoEPlugin::kName;
    }

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
};

} // namespace trt
} // namespace peagle
