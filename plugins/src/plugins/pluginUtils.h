// Helpers shared by the P-EAGLE TensorRT plugins: attribute parsing, serialization fields,
// data-type mapping to the kernels' C API, error logging through TensorRT's logger.
#pragma once

#include "NvInferRuntime.h"
#include "peagle_kernels.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace peagle
{
namespace trt
{

constexpr char const* kPluginVersion = "2";
constexpr char const* kPluginNamespace = "";

//! Log through the ILogger handed to setLoggerFinder() (stderr when there is none).
void logError(char const* msg) noexcept;

//! Numeric attribute `name` of `fc` (INT8/16/32/64, FLOAT32/64); false when absent.
inline bool readNumber(nvinfer1::PluginFieldCollection const* fc, char const* name, double& out) noexcept
{
    if (fc == nullptr || fc->fields == nullptr)
        return false;
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& f = fc->fields[i];
        if (f.name == nullptr || std::strcmp(f.name, name) != 0 || f.data == nullptr || f.length < 1)
            continue;
        switch (f.type)
        {
        case nvinfer1::PluginFieldType::kINT8: out = *static_cast<int8_t const*>(f.data); return true;
        case nvinfer1::PluginFieldType::kINT16: out = *static_cast<int16_t const*>(f.data); return true;
        case nvinfer1::PluginFieldType::kINT32: out = *static_cast<int32_t const*>(f.data); return true;
        case nvinfer1::PluginFieldType::kINT64:
            out = static_cast<double>(*static_cast<int64_t const*>(f.data));
            return true;
        case nvinfer1::PluginFieldType::kFLOAT32: out = *static_cast<float const*>(f.data); return true;
        case nvinfer1::PluginFieldType::kFLOAT64: out = *static_cast<double const*>(f.data); return true;
        default: return false;
        }
    }
    return false;
}

//! The fields a plugin serializes (pointers into the plugin's own members).
class FieldList
{
public:
    void addInt(char const* name, int32_t const* value)
    {
        mFields.emplace_back(name, value, nvinfer1::PluginFieldType::kINT32, 1);
    }

    void addInt64(char const* name, int64_t const* value)
    {
        mFields.emplace_back(name, value, nvinfer1::PluginFieldType::kINT64, 1);
    }

    void addFloat(char const* name, float const* value)
    {
        mFields.emplace_back(name, value, nvinfer1::PluginFieldType::kFLOAT32, 1);
    }

    nvinfer1::PluginFieldCollection const* collection() noexcept
    {
        mCollection.nbFields = static_cast<int32_t>(mFields.size());
        mCollection.fields = mFields.empty() ? nullptr : mFields.data();
        return &mCollection;
    }

    void clear() noexcept
    {
        mFields.clear();
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! TensorRT data type -> kernel dtype; false for types the kernels do not take.
inline bool toKernelType(nvinfer1::DataType t, peagle_dtype_t& out) noexcept
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT: out = PEAGLE_F32; return true;
    case nvinfer1::DataType::kHALF: out = PEAGLE_F16; return true;
    case nvinfer1::DataType::kBF16: out = PEAGLE_BF16; return true;
    case nvinfer1::DataType::kFP8: out = PEAGLE_FP8_E4M3; return true;
    default: return false;
    }
}

inline bool isActivationType(nvinfer1::DataType t) noexcept
{
    return t == nvinfer1::DataType::kFLOAT || t == nvinfer1::DataType::kHALF || t == nvinfer1::DataType::kBF16;
}

inline size_t elementSize(nvinfer1::DataType t) noexcept
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT: return 4;
    case nvinfer1::DataType::kHALF:
    case nvinfer1::DataType::kBF16: return 2;
    case nvinfer1::DataType::kFP8: return 1;
    case nvinfer1::DataType::kINT64: return 8;
    default: return 0;
    }
}

inline int64_t volume(nvinfer1::Dims const& d) noexcept
{
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i)
        v *= d.d[i];
    return v;
}

inline bool isLinear(nvinfer1::DynamicPluginTensorDesc const& d) noexcept
{
    return d.desc.format == nvinfer1::TensorFormat::kLINEAR;
}

//! Report a failed kernel launch; returns the plugin status (0 ok, 1 failure).
inline int32_t kernelStatus(cudaError_t err, char const* op) noexcept
{
    if (err == cudaSuccess)
        return 0;
    char msg[256];
    std::snprintf(msg, sizeof(msg), "%s: kernel launch failed: %s", op, peagle_error_string(err));
    logError(msg);
    return 1;
}

} // namespace trt
} // namespace peagle
