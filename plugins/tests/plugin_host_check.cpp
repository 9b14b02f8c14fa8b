// Host-side check of the plugin wrappers compiled against TensorRT's real public headers
// (TensorRT 11.1, ../shared/third_party/tensorrt-11.1/include): creators and names, attribute parsing,
// serialization round trip, output types and shapes, format support, KV aliasing, workspace sizes,
// argument errors; PEagleMoE's optional inputs (empty slots, left-off tails) and FP8 scale kinds. Needs no GPU and no TensorRT library (getPluginRegistry is defined below; nothing
// here launches a kernel). Built with -Werror and run by tests/plugins/test_kernels_build.py:
//   g++ -std=c++17 -isystem <trt>/include -Iplugins/include -Iplugins/src/plugins -isystem <cuda>/include
//       plugins/tests/plugin_host_check.cpp plugins/src/plugins/*.cpp -Lplugins/build -lpeagle_kernels ...
#include "peaglePlugins.h"

#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

using namespace nvinfer1;

// Compile-time proof that every pure virtual of IPluginV3 / IPluginV3OneCore / IPluginV3OneBuildV2 /
// IPluginV3OneRuntime / IPluginCreatorV3One is implemented (the `override`s prove the signatures).
static_assert(NV_TENSORRT_MAJOR >= 10, "the IPluginV3 plugins need TensorRT >= 10");
static_assert(!std::is_abstract<peagle::trt::KVAttentionPlugin>::value, "PEagleKVAttention is abstract");
static_assert(!std::is_abstract<peagle::trt::DraftInputsPlugin>::value, "PEagleDraftInputs is abstract");
static_assert(!std::is_abstract<peagle::trt::DraftSamplePlugin>::value, "PEagleDraftSample is abstract");
static_assert(!std::is_abstract<peagle::trt::MoEPlugin>::value, "PEagleMoE is abstract");
static_assert(!std::is_abstract<peagle::trt::MoEPluginCreator>::value, "creator is abstract");
static_assert(!std::is_abstract<peagle::trt::KVAttentionPluginCreator>::value, "creator is abstract");
static_assert(!std::is_abstract<peagle::trt::DraftInputsPluginCreator>::value, "creator is abstract");
static_assert(!std::is_abstract<peagle::trt::DraftSamplePluginCreator>::value, "creator is abstract");
static_assert(std::is_base_of<IPluginV3OneBuildV2, peagle::trt::PluginBase>::value, "build capability V2");

// ---- a toy expression builder: every dimension is a known constant. TensorRT's IDimensionExpr and
// IExprBuilder are thin wrappers over the library's apiv::VDimensionExpr / apiv::VExprBuilder (their
// protected mImpl); the doubles implement those interfaces and point mImpl at them.
namespace
{
struct ConstantImpl : apiv::VDimensionExpr
{
    bool isConstant() const override
    {
        return true;
    }
    int64_t getConstantValue() const override
    {
        return value;
    }
    bool isSizeTensor() const override
    {
        return false;
    }
    int64_t value = 0;
};
struct TestExpr : IDimensionExpr
{
    explicit TestExpr(int64_t v)
    {
        impl.value = v;
        mImpl = &impl;
    }
    ~TestExpr() noexcept override = default;
    ConstantImpl impl;
};
std::vector<TestExpr*> gExprs;
TestExpr const* expr(int64_t v)
{
    gExprs.push_back(new TestExpr(v));
    return gExprs.back();
}
struct BuilderImpl : apiv::VExprBuilder
{
    IDimensionExpr const* constant(int64_t value) override
    {
        return expr(value);
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        int64_t const x = a.getConstantValue(), y = b.getConstantValue();
        switch (op)
        {
        case DimensionOperation::kSUM: return expr(x + y);
        case DimensionOperation::kPROD: return expr(x * y);
        case DimensionOperation::kSUB: return expr(x - y);
        default: return nullptr;
        }
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return nullptr;
    }
};
struct TestBuilder : IExprBuilder
{
    TestBuilder()
    {
        mImpl = &impl;
    }
    ~TestBuilder() noexcept override = default;
    BuilderImpl impl;
};
} // namespace

extern "C" IPluginRegistry* getPluginRegistry() noexcept
{
    return nullptr;
}

extern "C" void setLoggerFinder(ILoggerFinder* finder);
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace
{
int gFailures = 0;
#define CHECK(cond)                                                                                                    \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            std::printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                                                \
            ++gFailures;                                                                                               \
        }                                                                                                              \
    } while (0)

struct CaptureLogger : ILogger
{
    void log(Severity, AsciiChar const* msg) noexcept override
    {
        last = msg;
        ++count;
    }
    std::string last;
    int count = 0;
};
struct Finder : ILoggerFinder
{
    ILogger* findLogger() override
    {
        return &logger;
    }
    CaptureLogger logger;
};

IPluginCreatorV3One* creator(char const* name)
{
    int32_t n = 0;
    IPluginCreatorInterface* const* list = getCreators(n);
    for (int32_t i = 0; i < n; ++i)
    {
        auto* c = static_cast<IPluginCreatorV3One*>(list[i]);
        if (std::strcmp(c->getPluginName(), name) == 0)
            return c;
    }
    return nullptr;
}

DimsExprs dimsExprs(std::vector<int64_t> const& v)
{
    DimsExprs d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
        d.d[i] = expr(v[i]);
    return d;
}

Dims dims(std::vector<int64_t> const& v)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
        d.d[i] = v[i];
    return d;
}

DynamicPluginTensorDesc desc(DataType t, std::vector<int64_t> const& shape)
{
    DynamicPluginTensorDesc d{};
    d.desc.type = t;
    d.desc.format = TensorFormat::kLINEAR;
    d.desc.dims = dims(shape);
    d.min = d.max = d.opt = d.desc.dims;
    return d;
}

bool allSupported(IPluginV3OneBuild* b, std::vector<DynamicPluginTensorDesc> const& io, int32_t nbIn)
{
    bool ok = true;
    for (int32_t pos = 0; pos < static_cast<int32_t>(io.size()); ++pos)
        ok = b->supportsFormatCombination(pos, io.data(), nbIn, static_cast<int32_t>(io.size()) - nbIn) && ok;
    return ok;
}

void checkKvAttention()
{
    IPluginCreatorV3One* c = creator("PEagleKVAttention");
    CHECK(c != nullptr);
    if (!c)
        return;
    CHECK(std::strcmp(c->getPluginVersion(), "2") == 0 && std::strcmp(c->getPluginNamespace(), "") == 0);
    CHECK(std::strcmp(c->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
    PluginFieldCollection const* names = c->getFieldNames();
    CHECK(names->nbFields == 6 && std::strcmp(names->fields[0].name, "num_heads") == 0);

    int32_t const heads = 8, kvHeads = 2, headDim = 64;
    float const scale = 0.125f;
    std::vector<PluginField> f = {{"num_heads", &heads, PluginFieldType::kINT32, 1},
        {"num_kv_heads", &kvHeads, PluginFieldType::kINT32, 1}, {"head_dim", &headDim, PluginFieldType::kINT32, 1},
        {"scale", &scale, PluginFieldType::kFLOAT32, 1}};
    PluginFieldCollection fc{static_cast<int32_t>(f.size()), f.data()};
    IPluginV3* p = c->createPlugin("attn", &fc, TensorRTPhase::kBUILD);
    CHECK(p != nullptr);
    if (!p)
        return;

    PluginFieldCollection missing{2, f.data()};
    CHECK(c->createPlugin("bad", &missing, TensorRTPhase::kBUILD) == nullptr);

    auto* core = static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
    auto* build = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    CHECK(std::strcmp(core->getPluginName(), "PEagleKVAttention") == 0);
    CHECK(std::strcmp(core->getPluginVersion(), "2") == 0);
    CHECK(build->getNbOutputs() == 3);
    CHECK(build->getAliasedInput(0) == -1 && build->getAliasedInput(1) == 5 && build->getAliasedInput(2) == 6);

    DataType in[7] = {DataType::kBF16, DataType::kBF16, DataType::kBF16, DataType::kINT64, DataType::kINT64,
        DataType::kFP8, DataType::kFP8};
    DataType out[3];
    CHECK(build->getOutputDataTypes(out, 3, in, 7) == 0);
    CHECK(out[0] == DataType::kBF16 && out[1] == DataType::kFP8 && out[2] == DataType::kFP8);

    // paged cache: M table entries of BS positions per request, NB blocks + the trash block
    int64_t const B = 4, S = 8, BS = 32, M = 129, NB1 = 6 * M + 1;
    DimsExprs inShapes[7] = {dimsExprs({B, S, heads * headDim}), dimsExprs({B, S, kvHeads * headDim}),
        dimsExprs({B, S, kvHeads * headDim}), dimsExprs({B, S}), dimsExprs({B, M}),
        dimsExprs({NB1, BS, kvHeads, headDim}), dimsExprs({NB1, BS, kvHeads, headDim})};
    DimsExprs outShapes[3];
    TestBuilder eb;
    CHECK(build->getOutputShapes(inShapes, 7, nullptr, 0, outShapes, 3, eb) == 0);
    CHECK(outShapes[0].nbDims == 3 && outShapes[0].d[2]->getConstantValue() == heads * headDim);
    CHECK(outShapes[1].nbDims == 4 && outShapes[1].d[0]->getConstantValue() == NB1
        && outShapes[1].d[1]->getConstantValue() == BS && outShapes[1].d[2]->getConstantValue() == kvHeads);
    CHECK(outShapes[2].nbDims == 4 && outShapes[2].d[3]->getConstantValue() == headDim);
    inShapes[4] = dimsExprs({B}); // the slots [B] of the contiguous cache: no longer taken
    CHECK(build->getOutputShapes(inShapes, 7, nullptr, 0, outShapes, 3, eb) != 0);

    for (DataType act : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT})
        for (DataType cache : {act, DataType::kFP8})
        {
            if (act == DataType::kFLOAT && cache == DataType::kFP8)
                continue; // refused: checked below
            std::vector<DynamicPluginTensorDesc> io = {desc(act, {B, S, heads * headDim}),
                desc(act, {B, S, kvHeads * headDim}), desc(act, {B, S, kvHeads * headDim}),
                desc(DataType::kINT64, {B, S}), desc(DataType::kINT64, {B, M}),
                desc(cache, {NB1, BS, kvHeads, headDim}), desc(cache, {NB1, BS, kvHeads, headDim}),
                desc(act, {B, S, heads * headDim}), desc(cache, {NB1, BS, kvHeads, headDim}),
                desc(cache, {NB1, BS, kvHeads, headDim})};
            CHECK(allSupported(build, io, 7));
            CHECK(build->configurePlugin(io.data(), 7, io.data() + 7, 3) == 0);
            size_t const ws = build->getWorkspaceSize(io.data(), 7, io.data() + 7, 3);
            // the Triton kernels need no workspace
            CHECK(ws == peagle_kv_attention_workspace_size(B, S, heads, headDim, M * BS) && ws == 0);
            io[3].desc.type = DataType::kINT32; // positions must be int64
            CHECK(!build->supportsFormatCombination(3, io.data(), 7, 3));
            io[3].desc.type = DataType::kINT64;
            io[4].desc.type = DataType::kINT32; // block tables too
            CHECK(!build->supportsFormatCombination(4, io.data(), 7, 3));
            io[4].desc.type = DataType::kINT64;
            io[1].desc.type = act == DataType::kHALF ? DataType::kBF16 : DataType::kHALF; // k must match q
            CHECK(!build->supportsFormatCombination(1, io.data(), 7, 3));
        }
    {
        // fp32 activations over an FP8 cache: refused (no such cubin)
        std::vector<DynamicPluginTensorDesc> io = {desc(DataType::kFLOAT, {B, S, heads * headDim}),
            desc(DataType::kFLOAT, {B, S, kvHeads * headDim}), desc(DataType::kFLOAT, {B, S, kvHeads * headDim}),
            desc(DataType::kINT64, {B, S}), desc(DataType::kINT64, {B, M}),
            desc(DataType::kFP8, {NB1, BS, kvHeads, headDim}), desc(DataType::kFP8, {NB1, BS, kvHeads, headDim})};
        CHECK(!build->supportsFormatCombination(5, io.data(), 7, 3));
    }
    {
        std::vector<DynamicPluginTensorDesc> io = {desc(DataType::kHALF, {B, S, heads * headDim}),
            desc(DataType::kHALF, {B, S, 1}), desc(DataType::kHALF, {B, S, 1}), desc(DataType::kINT64, {B, S}),
            desc(DataType::kINT64, {B, M}), desc(DataType::kHALF, {NB1, BS, kvHeads + 1, headDim}),
            desc(DataType::kHALF, {NB1, BS, kvHeads + 1, headDim})};
        CHECK(build->configurePlugin(io.data(), 7, io.data(), 3) != 0); // KV heads disagree with the attribute
        io[5] = io[6] = desc(DataType::kHALF, {NB1, BS, kvHeads, headDim});
        CHECK(build->configurePlugin(io.data(), 7, io.data(), 3) == 0);
        io[4] = desc(DataType::kINT64, {B}); // slots [B] (the contiguous cache's input): rank 2 expected
        CHECK(build->configurePlugin(io.data(), 7, io.data(), 3) != 0);
        io[4] = desc(DataType::kINT64, {B, M});
        io[6] = desc(DataType::kHALF, {NB1, 2 * BS, kvHeads, headDim}); // v_cache must match k_cache
        CHECK(build->configurePlugin(io.data(), 7, io.data(), 3) != 0);
        // the old contiguous layout [N, KV, T+1, d]: KV heads are not at axis 2
        io[5] = io[6] = desc(DataType::kHALF, {6, kvHeads, 4097, headDim});
        CHECK(build->configurePlugin(io.data(), 7, io.data(), 3) != 0);
    }

    // serialization round trip through the creator (runtime phase)
    PluginFieldCollection const* ser = runtime->getFieldsToSerialize();
    CHECK(ser != nullptr && ser->nbFields == 6);
    IPluginV3* q = c->createPlugin("attn", ser, TensorRTPhase::kRUNTIME);
    CHECK(q != nullptr);
    if (q)
    {
        auto* qr = static_cast<IPluginV3OneRuntime*>(q->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* ser2 = qr->getFieldsToSerialize();
        for (int32_t i = 0; i < ser->nbFields && i < ser2->nbFields; ++i)
        {
            CHECK(std::strcmp(ser->fields[i].name, ser2->fields[i].name) == 0);
            CHECK(std::memcmp(ser->fields[i].data, ser2->fields[i].data, 4) == 0);
        }
        double v = 0;
        CHECK(peagle::trt::readNumber(ser2, "scale", v) && v == 0.125);
        CHECK(peagle::trt::readNumber(ser2, "k_scale", v) && v == 1.0);
        delete q;
    }
    IPluginV3* cl = runtime->attachToContext(nullptr);
    CHECK(cl != nullptr && cl != p);
    delete cl;

    // enqueue rejects a type the kernels do not take, without launching anything
    PluginTensorDesc rd[7];
    for (int i = 0; i < 7; ++i)
        rd[i] = desc(DataType::kINT32, {1, 1, 1, 1}).desc;
    void const* nullIn[7] = {};
    void* nullOut[3] = {};
    CHECK(runtime->enqueue(rd, rd, nullIn, nullOut, nullptr, nullptr) != 0);
    // ... and shapes off the paged contract (a [B] slot vector instead of [B, M] block tables)
    rd[0] = desc(DataType::kHALF, {B, S, heads * headDim}).desc;
    rd[1] = rd[2] = desc(DataType::kHALF, {B, S, kvHeads * headDim}).desc;
    rd[3] = desc(DataType::kINT64, {B, S}).desc;
    rd[4] = desc(DataType::kINT64, {B}).desc;
    rd[5] = rd[6] = desc(DataType::kHALF, {NB1, BS, kvHeads, headDim}).desc;
    CHECK(runtime->enqueue(rd, rd, nullIn, nullOut, nullptr, nullptr) != 0);
    rd[4] = desc(DataType::kINT64, {B + 1, M}).desc; // one table per request
    CHECK(runtime->enqueue(rd, rd, nullIn, nullOut, nullptr, nullptr) != 0);
    delete p;
}

void checkDraftInputs()
{
    IPluginCreatorV3One* c = creator("PEagleDraftInputs");
    CHECK(c != nullptr);
    if (!c)
        return;
    int32_t const k = 7, mask = 128000;
    std::vector<PluginField> f
        = {{"num_spec_tokens", &k, PluginFieldType::kINT32, 1}, {"mask_token_id", &mask, PluginFieldType::kINT32, 1}};
    PluginFieldCollection fc{2, f.data()};
    IPluginV3* p = c->createPlugin("di", &fc, TensorRTPhase::kBUILD);
    CHECK(p != nullptr);
    if (!p)
        return;
    auto* build = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    CHECK(build->getNbOutputs() == 4);
    CHECK(build->getAliasedInput(0) == -1);

    int64_t const B = 3, P = 5, H = 256, V = 1000;
    DimsExprs in[6] = {dimsExprs({B, P}), dimsExprs({B, P, H}), dimsExprs({B}), dimsExprs({B}), dimsExprs({V, H}),
        dimsExprs({H})};
    DimsExprs out[4];
    TestBuilder eb;
    CHECK(build->getOutputShapes(in, 6, nullptr, 0, out, 4, eb) == 0);
    CHECK(out[0].nbDims == 3 && out[0].d[1]->getConstantValue() == P + k - 1 && out[0].d[2]->getConstantValue() == H);
    CHECK(out[1].nbDims == 3 && out[1].d[1]->getConstantValue() == P + k - 1);
    CHECK(out[2].nbDims == 2 && out[2].d[1]->getConstantValue() == P + k - 1);
    CHECK(out[3].nbDims == 2 && out[3].d[0]->getConstantValue() == B && out[3].d[1]->getConstantValue() == k);

    DataType it[6] = {DataType::kINT64, DataType::kBF16, DataType::kINT64, DataType::kINT64, DataType::kBF16,
        DataType::kBF16};
    DataType ot[4];
    CHECK(build->getOutputDataTypes(ot, 4, it, 6) == 0);
    CHECK(ot[0] == DataType::kBF16 && ot[1] == DataType::kBF16 && ot[2] == DataType::kINT64
        && ot[3] == DataType::kINT64);

    int64_t const R = P + k - 1;
    std::vector<DynamicPluginTensorDesc> io = {desc(DataType::kINT64, {B, P}), desc(DataType::kHALF, {B, P, H}),
        desc(DataType::kINT64, {B}), desc(DataType::kINT64, {B}), desc(DataType::kHALF, {V, H}),
        desc(DataType::kHALF, {H}), desc(DataType::kHALF, {B, R, H}), desc(DataType::kHALF, {B, R, H}),
        desc(DataType::kINT64, {B, R}), desc(DataType::kINT64, {B, k})};
    CHECK(allSupported(build, io, 6));
    io[4].desc.type = DataType::kFLOAT; // the embedding table must share the hidden dtype
    CHECK(!build->supportsFormatCombination(4, io.data(), 6, 4));

    PluginFieldCollection const* ser = runtime->getFieldsToSerialize();
    double v = 0;
    CHECK(peagle::trt::readNumber(ser, "num_spec_tokens", v) && v == k);
    CHECK(peagle::trt::readNumber(ser, "mask_token_id", v) && v == mask);
    IPluginV3* q = c->createPlugin("di", ser, TensorRTPhase::kRUNTIME);
    CHECK(q != nullptr);
    delete q;
    PluginFieldCollection none{0, nullptr};
    CHECK(c->createPlugin("bad", &none, TensorRTPhase::kBUILD) == nullptr);
    delete p;
}

void checkDraftSample()
{
    IPluginCreatorV3One* c = creator("PEagleDraftSample");
    CHECK(c != nullptr);
    if (!c)
        return;
    CHECK(c->getFieldNames()->nbFields == 0);
    IPluginV3* p = c->createPlugin("ds", nullptr, TensorRTPhase::kBUILD);
    CHECK(p != nullptr);
    if (!p)
        return;
    auto* build = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    int64_t const B = 8, K = 7, V = 201088;
    DimsExprs in[2] = {dimsExprs({B, K, V}), dimsExprs({V})};
    DimsExprs out[1];
    TestBuilder eb;
    CHECK(build->getOutputShapes(in, 2, nullptr, 0, out, 1, eb) == 0);
    CHECK(out[0].nbDims == 2 && out[0].d[0]->getConstantValue() == B && out[0].d[1]->getConstantValue() == K);
    DataType it[2] = {DataType::kFLOAT, DataType::kINT64};
    DataType ot[1];
    CHECK(build->getOutputDataTypes(ot, 1, it, 2) == 0 && ot[0] == DataType::kINT64);
    std::vector<DynamicPluginTensorDesc> io
        = {desc(DataType::kFLOAT, {B, K, V}), desc(DataType::kINT64, {V}), desc(DataType::kINT64, {B, K})};
    CHECK(allSupported(build, io, 2));
    CHECK(build->getWorkspaceSize(io.data(), 2, io.data() + 2, 1) == peagle_draft_sample_workspace_size(B * K, V));
    CHECK(build->getWorkspaceSize(io.data(), 2, io.data() + 2, 1) == 0);
    CHECK(runtime->getFieldsToSerialize()->nbFields == 0);
    io[1].desc.type = DataType::kINT32;
    CHECK(!build->supportsFormatCombination(1, io.data(), 2, 1));
    delete p;
}
void checkMoe()
{
    IPluginCreatorV3One* c = creator("PEagleMoE");
    CHECK(c != nullptr);
    if (!c)
        return;
    CHECK(std::strcmp(c->getPluginVersion(), "2") == 0 && std::strcmp(c->getPluginNamespace(), "") == 0);
    PluginFieldCollection const* names = c->getFieldNames();
    CHECK(names->nbFields == 6 && std::strcmp(names->fields[0].name, "top_k") == 0);
    int32_t const k = 8, routing = 0, renorm = 1, act = 0, badK = 9, badAct = 3;
    float const alpha = 1.702f, limit = 7.f;
    std::vector<PluginField> f = {{"top_k", &k, PluginFieldType::kINT32, 1},
        {"routing", &routing, PluginFieldType::kINT32, 1}, {"renormalize", &renorm, PluginFieldType::kINT32, 1},
        {"activation", &act, PluginFieldType::kINT32, 1}, {"swiglu_alpha", &alpha, PluginFieldType::kFLOAT32, 1},
        {"swiglu_limit", &limit, PluginFieldType::kFLOAT32, 1}};
    PluginFieldCollection fc{static_cast<int32_t>(f.size()), f.data()};
    IPluginV3* p = c->createPlugin("moe", &fc, TensorRTPhase::kBUILD);
    CHECK(p != nullptr);
    if (!p)
        return;
    PluginFieldCollection noTopK{0, nullptr};
    CHECK(c->createPlugin("bad", &noTopK, TensorRTPhase::kBUILD) == nullptr);
    std::vector<PluginField> bad = f;
    bad[0].data = &badK; // top_k past the compiled 8
    PluginFieldCollection badFc{static_cast<int32_t>(bad.size()), bad.data()};
    CHECK(c->createPlugin("bad", &badFc, TensorRTPhase::kBUILD) == nullptr);
    bad[0].data = &k;
    bad[3].data = &badAct; // activation 3: none such
    CHECK(c->createPlugin("bad", &badFc, TensorRTPhase::kBUILD) == nullptr);

    auto* build = static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
    auto* runtime = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
    CHECK(build->getNbOutputs() == 1 && build->getAliasedInput(0) == -1);

    // Qwen3-30B-A3B's shapes, FP8 with 128 x 128 block scales; b13, b2 and expert_scale empty, a13 / a2 left off
    int64_t const T = 8, H = 2048, E = 128, I = 768;
    DataType in[9] = {DataType::kBF16, DataType::kFLOAT, DataType::kFP8, DataType::kFP8, DataType::kFLOAT,
        DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out[1];
    CHECK(build->getOutputDataTypes(out, 1, in, 9) == 0 && out[0] == DataType::kBF16);
    DimsExprs inShapes[4] = {dimsExprs({T, H}), dimsExprs({T, E}), dimsExprs({E, 2 * I, H}), dimsExprs({E, H, I})};
    DimsExprs outShapes[1];
    TestBuilder eb;
    CHECK(build->getOutputShapes(inShapes, 4, nullptr, 0, outShapes, 1, eb) == 0);
    CHECK(outShapes[0].nbDims == 2 && outShapes[0].d[0]->getConstantValue() == T
        && outShapes[0].d[1]->getConstantValue() == H);
    CHECK(build->getOutputShapes(inShapes, 3, nullptr, 0, outShapes, 1, eb) != 0); // w2 missing

    auto block = [&](DataType x, DataType w) {
        return std::vector<DynamicPluginTensorDesc>{desc(x, {T, H}), desc(DataType::kFLOAT, {T, E}),
            desc(w, {E, 2 * I, H}), desc(w, {E, H, I}), desc(DataType::kFLOAT, {0}), desc(DataType::kFLOAT, {0}),
            desc(DataType::kFLOAT, {0}), desc(DataType::kFLOAT, {E, 2 * I / 128, H / 128}),
            desc(DataType::kFLOAT, {E, H / 128, I / 128}), desc(x, {T, H})};
    };
    std::vector<DynamicPluginTensorDesc> io = block(DataType::kBF16, DataType::kFP8);
    CHECK(allSupported(build, io, 9));
    CHECK(build->configurePlugin(io.data(), 9, io.data() + 9, 1) == 0);
    size_t const ws = build->getWorkspaceSize(io.data(), 9, io.data() + 9, 1);
    CHECK(ws > 0 && ws == peagle_moe_workspace_size(T, H, E, I, k, PEAGLE_BF16, PEAGLE_MOE_BLOCK_128));
    io[0].max.d[0] = io[1].max.d[0] = io[9].max.d[0] = 4 * T; // the profile's largest rows size the workspace
    CHECK(build->getWorkspaceSize(io.data(), 9, io.data() + 9, 1)
        == peagle_moe_workspace_size(4 * T, H, E, I, k, PEAGLE_BF16, PEAGLE_MOE_BLOCK_128));
    CHECK(ws < build->getWorkspaceSize(io.data(), 9, io.data() + 9, 1));
    io = block(DataType::kFLOAT, DataType::kFP8); // FP8 experts under fp32 activations: no such variant
    CHECK(!build->supportsFormatCombination(2, io.data(), 9, 1));
    io = block(DataType::kHALF, DataType::kFP8);
    CHECK(allSupported(build, io, 9));
    io[3].desc.type = DataType::kHALF; // w2 must share w13's type
    CHECK(!build->supportsFormatCombination(3, io.data(), 9, 1));
    io = block(DataType::kHALF, DataType::kFP8);
    io[8] = desc(DataType::kFLOAT, {E, H}); // w2_scale per channel, w13_scale per block
    CHECK(build->configurePlugin(io.data(), 9, io.data() + 9, 1) != 0);
    io[7] = desc(DataType::kFLOAT, {E, 2 * I});
    CHECK(build->configurePlugin(io.data(), 9, io.data() + 9, 1) == 0); // both per channel
    io[7] = desc(DataType::kFLOAT, {E});
    io[8] = desc(DataType::kFLOAT, {E});
    CHECK(build->configurePlugin(io.data(), 9, io.data() + 9, 1) != 0); // per tensor without a13 / a2
    io.insert(io.begin() + 9, {desc(DataType::kFLOAT, {E}), desc(DataType::kFLOAT, {E})});
    CHECK(allSupported(build, io, 11));
    CHECK(build->configurePlugin(io.data(), 11, io.data() + 11, 1) == 0);
    CHECK(build->getWorkspaceSize(io.data(), 11, io.data() + 11, 1)
        == peagle_moe_workspace_size(T, H, E, I, k, PEAGLE_F16, PEAGLE_MOE_PER_TENSOR));

    // GPT-OSS-20B's shapes in bf16 with biases: every input by position, the scales empty
    int64_t const H2 = 2880, E2 = 32, I2 = 2880;
    std::vector<DynamicPluginTensorDesc> oss = {desc(DataType::kBF16, {T, H2}), desc(DataType::kBF16, {T, E2}),
        desc(DataType::kBF16, {E2, 2 * I2, H2}), desc(DataType::kBF16, {E2, H2, I2}),
        desc(DataType::kBF16, {E2, 2 * I2}), desc(DataType::kBF16, {E2, H2}), desc(DataType::kFLOAT, {0}),
        desc(DataType::kFLOAT, {0}), desc(DataType::kFLOAT, {0}), desc(DataType::kFLOAT, {0}),
        desc(DataType::kFLOAT, {0}), desc(DataType::kBF16, {T, H2})};
    CHECK(allSupported(build, oss, 11));
    CHECK(build->configurePlugin(oss.data(), 11, oss.data() + 11, 1) == 0);
    oss[4].desc.type = DataType::kFLOAT; // biases in x's type
    CHECK(!build->supportsFormatCombination(4, oss.data(), 11, 1));
    oss[4].desc.type = DataType::kBF16;
    oss[7] = desc(DataType::kFLOAT, {E2}); // a scale with unquantized weights
    CHECK(build->configurePlugin(oss.data(), 11, oss.data() + 11, 1) != 0);
    oss[7] = desc(DataType::kFLOAT, {0});
    oss[3] = desc(DataType::kBF16, {E2, H2, I2 + 1}); // w2 [E, H, I] disagrees with w13 [E, 2I, H]
    CHECK(build->configurePlugin(oss.data(), 11, oss.data() + 11, 1) != 0);
    oss[2] = desc(DataType::kBF16, {E2, 2 * 100, H2}); // I = 100: no ALIGNED variant (64 | I)
    oss[3] = desc(DataType::kBF16, {E2, H2, 100});
    CHECK(build->configurePlugin(oss.data(), 11, oss.data() + 11, 1) != 0);

    // serialization round trip through the creator (runtime phase)
    PluginFieldCollection const* ser = runtime->getFieldsToSerialize();
    CHECK(ser != nullptr && ser->nbFields == 6);
    IPluginV3* q = c->createPlugin("moe", ser, TensorRTPhase::kRUNTIME);
    CHECK(q != nullptr);
    if (q)
    {
        auto* qr = static_cast<IPluginV3OneRuntime*>(q->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        PluginFieldCollection const* ser2 = qr->getFieldsToSerialize();
        double v = 0;
        CHECK(peagle::trt::readNumber(ser2, "top_k", v) && v == 8);
        CHECK(peagle::trt::readNumber(ser2, "renormalize", v) && v == 1);
        CHECK(peagle::trt::readNumber(ser2, "swiglu_alpha", v) && static_cast<float>(v) == 1.702f);
        delete q;
    }

    // enqueue refuses before launching anything: unknown types, then a missing workspace
    PluginTensorDesc rd[9];
    for (int i = 0; i < 9; ++i)
        rd[i] = block(DataType::kBF16, DataType::kFP8)[i].desc;
    void const* nullIn[9] = {};
    void* nullOut[1] = {};
    CHECK(runtime->onShapeChange(rd, 9, rd, 1) == 0);
    CHECK(runtime->enqueue(rd, rd, nullIn, nullOut, nullptr, nullptr) != 0);
    rd[0].type = DataType::kINT32;
    CHECK(runtime->enqueue(rd, rd, nullIn, nullOut, nullptr, nullptr) != 0);
    delete p;
}
} // namespace

int main()
{
    Finder finder;
    setLoggerFinder(&finder);
    int32_t n = 0;
    getCreators(n);
    CHECK(n == 4);
    checkKvAttention();
    checkDraftInputs();
    checkDraftSample();
    checkMoe();
    CHECK(finder.logger.count > 0); // the rejected calls above were logged through the finder
    for (TestExpr* e : gExprs)
        delete e;
    if (gFailures == 0)
        std::printf("plugin_host_check: OK\n");
    return gFailures == 0 ? 0 : 1;
}
