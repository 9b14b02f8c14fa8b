// Minimal stand-in for TensorRT 10's NvInferRuntime.h, used ONLY to syntax-check the plugin sources on
// machines without TensorRT (tests/plugins/test_kernels_build.py). It declares the subset of the
// interfaces the plugins use, with the signatures of TensorRT 10.x's public headers
// (NvInferRuntimeBase.h, NvInferPluginBase.h, NvInferRuntimePlugin.h, NvInferRuntime.h). It is never
// used to build the real libpeagle_plugins.so, which compiles against the installed TensorRT.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime_api.h>

#define TENSORRTAPI

namespace nvinfer1
{
using AsciiChar = char;

enum class DataType : int32_t
{
    kFLOAT = 0,
    kHALF = 1,
    kINT8 = 2,
    kINT32 = 3,
    kBOOL = 4,
    kUINT8 = 5,
    kFP8 = 6,
    kBF16 = 7,
    kINT64 = 8,
    kINT4 = 9,
};

enum class TensorFormat : int32_t
{
    kLINEAR = 0,
    kCHW2 = 1,
    kHWC8 = 2,
};

class Dims64
{
public:
    static constexpr int32_t MAX_DIMS{8};
    int32_t nbDims;
    int64_t d[MAX_DIMS];
};
using Dims = Dims64;

struct PluginTensorDesc
{
    Dims dims;
    DataType type;
    TensorFormat format;
    float scale;
};

struct DynamicPluginTensorDesc
{
    PluginTensorDesc desc;
    Dims min;
    Dims max;
    Dims opt;
};

enum class DimensionOperation : int32_t
{
    kSUM = 0,
    kPROD = 1,
    kMAX = 2,
    kMIN = 3,
    kSUB = 4,
    kEQUAL = 5,
    kLESS = 6,
    kFLOOR_DIV = 7,
    kCEIL_DIV = 8
};

// TensorRT's IDimensionExpr / IExprBuilder are non-virtual wrappers around an implementation
// object; here they are abstract so that the host check can supply a toy implementation. The calls
// the plugins make are the same either way.
class IDimensionExpr
{
public:
    virtual bool isConstant() const noexcept = 0;
    virtual int64_t getConstantValue() const noexcept = 0;

protected:
    virtual ~IDimensionExpr() noexcept = default;
};

class IExprBuilder
{
public:
    virtual IDimensionExpr const* constant(int64_t value) noexcept = 0;
    virtual IDimensionExpr const* operation(
        DimensionOperation op, IDimensionExpr const& first, IDimensionExpr const& second) noexcept = 0;

protected:
    virtual ~IExprBuilder() noexcept = default;
};

class DimsExprs
{
public:
    int32_t nbDims;
    IDimensionExpr const* d[Dims::MAX_DIMS];
};

enum class PluginFieldType : int32_t
{
    kFLOAT16 = 0,
    kFLOAT32 = 1,
    kFLOAT64 = 2,
    kINT8 = 3,
    kINT16 = 4,
    kINT32 = 5,
    kCHAR = 6,
    kDIMS = 7,
    kUNKNOWN = 8,
    kBF16 = 9,
    kINT64 = 10,
    kFP8 = 11,
    kINT4 = 12,
};

class PluginField
{
public:
    AsciiChar const* name;
    void const* data;
    PluginFieldType type;
    int32_t length;

    PluginField(AsciiChar const* const name_ = nullptr, void const* const data_ = nullptr,
        PluginFieldType const type_ = PluginFieldType::kUNKNOWN, int32_t const length_ = 0) noexcept
        : name(name_)
        , data(data_)
        , type(type_)
        , length(length_)
    {
    }
};

struct PluginFieldCollection
{
    int32_t nbFields{};
    PluginField const* fields{};
};

enum class TensorRTPhase : int32_t
{
    kBUILD = 0,
    kRUNTIME = 1
};

enum class PluginCapabilityType : int32_t
{
    kCORE = 0,
    kBUILD = 1,
    kRUNTIME = 2
};

class InterfaceInfo
{
public:
    AsciiChar const* kind;
    int32_t major;
    int32_t minor;
};

enum class APILanguage : int32_t
{
    kCPP = 0,
    kPYTHON = 1
};

class IVersionedInterface
{
public:
    virtual APILanguage getAPILanguage() const noexcept
    {
        return APILanguage::kCPP;
    }
    virtual InterfaceInfo getInterfaceInfo() const noexcept = 0;
    virtual ~IVersionedInterface() noexcept = default;
};

class ILogger
{
public:
    enum class Severity : int32_t
    {
        kINTERNAL_ERROR = 0,
        kERROR = 1,
        kWARNING = 2,
        kINFO = 3,
        kVERBOSE = 4,
    };
    virtual void log(Severity severity, AsciiChar const* msg) noexcept = 0;
    virtual ~ILogger() = default;
};

class ILoggerFinder
{
public:
    virtual ILogger* findLogger() = 0;

protected:
    virtual ~ILoggerFinder() = default;
};

class IPluginResourceContext;

namespace v_1_0
{
class IPluginCapability : public IVersionedInterface
{
};

class IPluginCreatorInterface : public IVersionedInterface
{
public:
    ~IPluginCreatorInterface() noexcept override = default;
};

class IPluginV3 : public IVersionedInterface
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN", 1, 0};
    }
    virtual IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept = 0;
    virtual IPluginV3* clone() noexcept = 0;
};

class IPluginV3OneCore : public IPluginCapability
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN_V3ONE_CORE", 1, 0};
    }
    virtual AsciiChar const* getPluginName() const noexcept = 0;
    virtual AsciiChar const* getPluginVersion() const noexcept = 0;
    virtual AsciiChar const* getPluginNamespace() const noexcept = 0;
};

class IPluginV3OneBuild : public IPluginCapability
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN_V3ONE_BUILD", 1, 0};
    }
    virtual int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
        DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept = 0;
    virtual int32_t getOutputDataTypes(
        DataType* outputTypes, int32_t nbOutputs, const DataType* inputTypes, int32_t nbInputs) const noexcept = 0;
    virtual int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& exprBuilder) noexcept = 0;
    virtual bool supportsFormatCombination(
        int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept = 0;
    virtual int32_t getNbOutputs() const noexcept = 0;
    virtual size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept
    {
        return 0;
    }
    virtual int32_t getValidTactics(int32_t* tactics, int32_t nbTactics) noexcept
    {
        return 0;
    }
    virtual int32_t getNbTactics() noexcept
    {
        return 0;
    }
    virtual char const* getTimingCacheID() noexcept
    {
        return nullptr;
    }
    virtual int32_t getFormatCombinationLimit() noexcept
    {
        return 100;
    }
    virtual char const* getMetadataString() noexcept
    {
        return nullptr;
    }
};

class IPluginV3OneRuntime : public IPluginCapability
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN_V3ONE_RUNTIME", 1, 0};
    }
    virtual int32_t setTactic(int32_t tactic) noexcept
    {
        return 0;
    }
    virtual int32_t onShapeChange(
        PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept = 0;
    virtual int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept = 0;
    virtual IPluginV3* attachToContext(IPluginResourceContext* context) noexcept = 0;
    virtual PluginFieldCollection const* getFieldsToSerialize() noexcept = 0;
};

class IPluginCreatorV3One : public IPluginCreatorInterface
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN CREATOR_V3ONE", 1, 0};
    }
    virtual IPluginV3* createPlugin(
        AsciiChar const* name, PluginFieldCollection const* fc, TensorRTPhase phase) noexcept = 0;
    virtual PluginFieldCollection const* getFieldNames() noexcept = 0;
    virtual AsciiChar const* getPluginName() const noexcept = 0;
    virtual AsciiChar const* getPluginVersion() const noexcept = 0;
    virtual AsciiChar const* getPluginNamespace() const noexcept = 0;
};
} // namespace v_1_0

namespace v_2_0
{
class IPluginV3OneBuild : public v_1_0::IPluginV3OneBuild
{
public:
    InterfaceInfo getInterfaceInfo() const noexcept override
    {
        return InterfaceInfo{"PLUGIN_V3ONE_BUILD", 2, 0};
    }
    virtual int32_t getAliasedInput(int32_t outputIndex) noexcept
    {
        return -1;
    }
};
} // namespace v_2_0

using IPluginCapability = v_1_0::IPluginCapability;
using IPluginCreatorInterface = v_1_0::IPluginCreatorInterface;
using IPluginV3 = v_1_0::IPluginV3;
using IPluginV3OneCore = v_1_0::IPluginV3OneCore;
using IPluginV3OneBuild = v_1_0::IPluginV3OneBuild;
using IPluginV3OneRuntime = v_1_0::IPluginV3OneRuntime;
using IPluginV3OneBuildV2 = v_2_0::IPluginV3OneBuild;
using IPluginCreatorV3One = v_1_0::IPluginCreatorV3One;

class IPluginResourceContext
{
public:
    virtual ~IPluginResourceContext() noexcept = default;
};

class IPluginRegistry
{
public:
    virtual bool registerCreator(IPluginCreatorInterface& creator, AsciiChar const* const pluginNamespace) noexcept = 0;

protected:
    virtual ~IPluginRegistry() noexcept = default;
};

} // namespace nvinfer1

extern "C" TENSORRTAPI nvinfer1::IPluginRegistry* getPluginRegistry() noexcept;
