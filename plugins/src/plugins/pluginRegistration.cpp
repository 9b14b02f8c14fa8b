// Shared plugin plumbing and the library's entry points.
//
// Loading: IPluginRegistry::loadLibrary("libpeagle_plugins.so") (Python:
// trt.get_plugin_registry().load_library(path); trtexec --dynamicPlugins=...), which calls the
// exported setLoggerFinder() and getCreators(). The library does NOT register itself statically, so
// it can also be serialized into a plan with setPluginsToSerialize. Code that loads it with dlopen /
// ctypes instead can call peagle_register_plugins() once.
#include "peaglePlugins.h"

#include <atomic>
#include <cstdio>

#define PEAGLE_PLUGIN_API extern "C" __attribute__((visibility("default")))

namespace peagle
{
namespace trt
{
namespace
{
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
} // namespace

void logError(char const* msg) noexcept
{
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    nvinfer1::ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
        logger->log(nvinfer1::ILogger::Severity::kERROR, msg);
    else
        std::fprintf(stderr, "[peagle plugins] %s\n", msg);
}

nvinfer1::IPluginCapability* PluginBase::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    }
    return nullptr;
}

int32_t PluginBase::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* /*in*/, int32_t /*nbInputs*/,
    nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    return 0;
}

int32_t PluginBase::onShapeChange(nvinfer1::PluginTensorDesc const* /*in*/, int32_t /*nbInputs*/,
    nvinfer1::PluginTensorDesc const* /*out*/, int32_t /*nbOutputs*/) noexcept
{
    return 0;
}

nvinfer1::IPluginV3* PluginBase::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone(); // no per-context resources
}

namespace
{
nvinfer1::IPluginCreatorInterface* const* creators(int32_t& count) noexcept
{
    static KVAttentionPluginCreator kvAttention;
    static DraftInputsPluginCreator draftInputs;
    static DraftSamplePluginCreator draftSample;
    static MoEPluginCreator moe;
    static nvinfer1::IPluginCreatorInterface* const kCreators[] = {&kvAttention, &draftInputs, &draftSample, &moe};
    count = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}
} // namespace

} // namespace trt
} // namespace peagle

PEAGLE_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    peagle::trt::gLoggerFinder.store(finder);
}

PEAGLE_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    return peagle::trt::creators(nbCreators);
}

//! Register the creators with the global registry (for dlopen / ctypes users); true on success.
PEAGLE_PLUGIN_API bool peagle_register_plugins()
{
    nvinfer1::IPluginRegistry* registry = getPluginRegistry();
    if (registry == nullptr)
        return false;
    int32_t n = 0;
    nvinfer1::IPluginCreatorInterface* const* list = peagle::trt::creators(n);
    bool ok = true;
    for (int32_t i = 0; i < n; ++i)
        ok = registry->registerCreator(*list[i], peagle::trt::kPluginNamespace) && ok;
    return ok;
}
