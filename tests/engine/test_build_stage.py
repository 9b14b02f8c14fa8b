"""The TensorRT build stage without TensorRT: a clear error when it is missing, the documented
optimization profiles (paged KV cache: block tables and [blocks + 1, block_size, KV, d] caches), and
an end-to-end build against a fake `tensorrt` module that only records the calls (network flags,
plugin loading, profiles, timing cache, atomic plans, manifest), then the executor over its plans."""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import replace

import pytest
import torch

from peagle_trt.config import KVLayout
from peagle_trt.engine import EngineOptions, build_engines, profiles_for
from peagle_trt.engine import build as stage
from peagle_trt.errors import BuildError, RuntimeInvariantError
from peagle_trt.manifest import sha256, verify_manifest, write_manifest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

N, KV, D, H3 = 8, 2, 4, 12
BS = 8  # positions per KV block
SPEC = EngineOptions("sm_90", max_batch=N, max_seq_len=32, num_spec_tokens=3, prefill_chunk=16, workspace_gb=1.0,
                     block_size=BS)
M = 5  # table entries per request: ceil((max_seq_len + K + 1) / BS) = ceil(36 / 8)
NB1 = N * M + 1  # blocks for N full-length requests, plus the trash block


# -- a fake tensorrt that records calls -----------------------------------------------------------
def fake_tensorrt(calls: list, parse_errors=(), fail_build=False, creators=stage.PLUGIN_OPS,
                  version="10.99.0", refuse_library=False):
    trt = types.ModuleType("tensorrt")
    plans = {}  # plan bytes -> (onnx path, profiles): what a deserialized engine declares
    trt.__version__ = version
    ns = types.SimpleNamespace
    trt.NetworkDefinitionCreationFlag = ns(STRONGLY_TYPED=1)
    trt.MemoryPoolType = ns(WORKSPACE="WORKSPACE")
    trt.PreviewFeature = ns(ALIASED_PLUGIN_IO_10_03="ALIASED_PLUGIN_IO_10_03")
    trt.HardwareCompatibilityLevel = ns(AMPERE_PLUS="AMPERE_PLUS")

    class ILogger:
        Severity = ns(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

        def __init__(self):
            pass

    class Registry:
        def __init__(self):
            self.loaded = False

        def load_library(self, path):  # IPluginRegistry::loadLibrary: a handle, nullptr if refused
            calls.append(("load_library", path))
            if refuse_library:
                return None
            self.loaded = True
            return object()

        def get_creator(self, name, version, namespace):
            calls.append(("get_creator", name, version, namespace))
            return object() if self.loaded and name in creators else None

    registry = Registry()

    class Network:
        def __init__(self):
            self.inputs = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.num_errors = network, 0

        def parse_from_file(self, path):
            calls.append(("parse_from_file", path))
            if parse_errors:
                self.num_errors = len(parse_errors)
                return False
            graph = onnx.load(path, load_external_data=False).graph  # what the parser would declare
            for value in graph.input:
                shape = value.type.tensor_type.shape
                dims = [d.dim_value if d.HasField("dim_value") else -1 for d in shape.dim]
                self.network.inputs.append(ns(name=value.name, shape=dims))
            self.network.path = path
            return True

        def get_error(self, i):
            return parse_errors[i]

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+"

    class Config:
        def __init__(self):
            self.profiles, self.cache = [], None

        def set_memory_pool_limit(self, pool, size):
            calls.append(("set_memory_pool_limit", pool, size))

        def set_preview_feature(self, feature, on):
            calls.append(("set_preview_feature", feature, on))

        def __setattr__(self, key, value):
            if key == "hardware_compatibility_level":
                calls.append(("hardware_compatibility_level", value))
            object.__setattr__(self, key, value)

        def add_optimization_profile(self, profile):
            calls.append(("add_optimization_profile", dict(profile.shapes)))
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, data):
            calls.append(("create_timing_cache", bytes(data)))
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network", network.path))
            if fail_build:
                self.logger.log(ILogger.Severity.ERROR, "out of memory while timing tactics")
                return None
            plan = b"PLAN:" + network.path.encode()
            plans[plan] = (network.path, [p.shapes for p in config.profiles])
            return plan

    trt.ILogger, trt.Builder, trt.OnnxParser = ILogger, Builder, OnnxParser
    trt.get_plugin_registry = lambda: registry
    _add_fake_runtime(trt, calls, plans)
    return trt


def _add_fake_runtime(trt, calls: list, plans: dict):
    """Runtime side: a deserialized 'plan' declares the ONNX file's I/O and the built profiles."""
    ns = types.SimpleNamespace
    kinds = ("FLOAT", "HALF", "BF16", "INT32", "INT64", "INT8", "UINT8", "BOOL", "FP8")
    trt.DataType = ns(**{k: k for k in kinds})
    trt.TensorIOMode = ns(INPUT="INPUT", OUTPUT="OUTPUT")
    dtypes = {TensorProto.FLOAT: "FLOAT", TensorProto.INT64: "INT64", TensorProto.INT32: "INT32"}

    class Engine:
        def __init__(self, path, profiles):
            graph = onnx.load(path, load_external_data=False).graph
            self.io = {}  # name -> (mode, dtype, dims with names for dynamic axes)
            for mode, values in (("INPUT", graph.input), ("OUTPUT", graph.output)):
                for v in values:
                    dims = [d.dim_value if d.HasField("dim_value") else d.dim_param
                            for d in v.type.tensor_type.shape.dim]
                    self.io[v.name] = (mode, dtypes[v.type.tensor_type.elem_type], dims)
            self.names, self.profiles = list(self.io), profiles
            self.num_io_tensors, self.num_optimization_profiles = len(self.names), len(profiles)

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.io[name][0]

        def get_tensor_dtype(self, name):
            return self.io[name][1]

        def get_tensor_shape(self, name):
            return [d if isinstance(d, int) else -1 for d in self.io[name][2]]

        def get_tensor_profile_shape(self, name, p):
            return self.profiles[p][name]

        def create_execution_context(self):
            return Context(self)

    class Context:
        def __init__(self, engine):
            self.engine, self.profile, self.shapes, self.addresses = engine, 0, {}, {}

        def set_optimization_profile_async(self, p, stream):
            calls.append(("set_optimization_profile_async", p))
            self.profile = p
            return True

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = ptr

        def get_tensor_shape(self, name):
            sizes = {}
            for n, shape in self.shapes.items():
                sizes.update({d: s for d, s in zip(self.engine.io[n][2], shape) if isinstance(d, str)})
            return [d if isinstance(d, int) else sizes[d] for d in self.engine.io[name][2]]

        def execute_async_v3(self, stream):
            calls.append(("execute_async_v3", self.profile, dict(self.shapes)))
            return True

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            path, profiles = plans[bytes(data)]
            return Engine(path, profiles)

    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, severity=None: None})
    trt.Runtime = Runtime


# -- a tiny export directory ------------------------------------------------------------------------
def _value(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def _save(path, nodes, inputs, outputs):
    graph = helper.make_graph(nodes, path.stem, inputs, outputs)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("peagle", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    onnx.save(model, str(path))


def _kv(prefix):
    return [_value(f"{prefix}_{kind}_0", TensorProto.FLOAT, [NB1, BS, KV, D]) for kind in ("key", "value")]


def make_export(root, k=3):
    trt_dir = root / "trt"
    trt_dir.mkdir(parents=True)
    i64 = TensorProto.INT64
    attn = helper.make_node("PEagleKVAttention",
                            ["q", "k", "v", "positions", "block_tables", "past_key_0", "past_value_0", "tree_mask"],
                            ["attn", "present_key_0", "present_value_0"], domain="peagle",
                            num_heads=4, num_kv_heads=KV, head_dim=D, scale=0.5)
    _save(trt_dir / "target.onnx", [attn],
          [_value("input_ids", i64, ["batch", "rows"]), _value("positions", i64, ["batch", "rows"]),
           _value("block_tables", i64, [1, "batch", "blocks"]),  # [G, B, M], M dynamic here
           _value("logit_rows", i64, ["batch", "logit_rows"]),
           _value("tree_mask", TensorProto.INT32, ["batch", "rows", "mask_words"]), *_kv("past")],
          [_value("logits", TensorProto.FLOAT, ["batch", "logit_rows", 16]),
           _value("aux_hidden", TensorProto.FLOAT, ["batch", "rows", H3]), *_kv("present")])
    draft = helper.make_node("PEagleDraftInputs",
                             ["pending_ids", "pending_aux", "num_pending", "cur", "e", "h"],
                             ["embeds", "hidden", "pos", "rows"], domain="peagle",
                             num_spec_tokens=k, mask_token_id=3)
    _save(trt_dir / "drafter.onnx", [draft],
          [_value("pending_ids", i64, ["batch", "pending"]),
           _value("pending_aux", TensorProto.FLOAT, ["batch", "pending", H3]),
           _value("num_pending", i64, ["batch"]), _value("cur", i64, ["batch"]),
           _value("draft_slots", i64, ["drafts"]), _value("draft_width", i64, ["width"]),
           _value("block_tables", i64, ["batch", M]),  # [B, M] (group 0), M static here
           *_kv("past")],
          [_value("draft_ids", i64, ["batch", "drafts"]), *_kv("present")])
    write_manifest(root, {"stage": "export", "num_spec_tokens": k})
    return root


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake tensorrt, an H200 on the 'bus', CUDA 13.0, an export dir and a plugin library."""
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(calls))
    monkeypatch.setattr(stage, "visible_gpu", lambda: ("NVIDIA H200", "sm_90"))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    plugin = tmp_path / "libpeagle_trt_plugins.so"
    plugin.write_bytes(b"\x7fELF fake")
    spec = replace(SPEC, plugin_library=plugin, timing_cache=tmp_path / "cache" / "t.bin")
    return types.SimpleNamespace(calls=calls, export=make_export(tmp_path / "export"),
                                 out=tmp_path / "engines", spec=spec, root=tmp_path, monkeypatch=monkeypatch)


def _leftovers(root):
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# -- (a) no TensorRT -------------------------------------------------------------------------------
def test_missing_tensorrt_names_the_container(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    with pytest.raises(BuildError, match=r"nvcr\.io/nvidia/tritonserver:<yy\.mm>-py3") as err:
        build_engines(tmp_path / "export", tmp_path / "out", SPEC)
    assert "not installed" in str(err.value) and "pip install tensorrt" in str(err.value)
    assert not (tmp_path / "out").exists()
    from peagle_trt.executors.tensorrt import TensorRTExecutor

    with pytest.raises(BuildError, match="nvcr.io/nvidia/tensorrt"):
        TensorRTExecutor(tmp_path / "out")


# -- (b) profiles ----------------------------------------------------------------------------------
def test_profiles_follow_docs_export_md():
    spec = EngineOptions("sm_90", max_batch=8, max_seq_len=2048, num_spec_tokens=7, prefill_chunk=256)
    m = 65  # ceil((2048 + 7 + 1) / 32) table entries per request
    nb1 = 8 * m + 1  # blocks for 8 full-length requests + the trash block
    kv = {"past_key_0": [nb1, 32, 4, 128], "past_value_0": [-1, -1, 4, 128]}  # static or dynamic blocks / size
    target = profiles_for("target", spec, {"input_ids": [-1, -1], "positions": [-1, -1],
                                           "block_tables": [1, -1, -1], "logit_rows": [-1, -1],
                                           "tree_mask": [-1, -1, -1], **kv})
    assert list(target) == ["prefill", "decode"]
    pre, dec = target["prefill"], target["decode"]
    assert pre["input_ids"] == {"min": [1, 1], "opt": [1, 256], "max": [8, 256]}
    assert pre["logit_rows"] == {"min": [1, 1], "opt": [1, 1], "max": [8, 1]}
    assert pre["block_tables"] == {"min": [1, 1, m], "opt": [1, 1, m], "max": [1, 8, m]}
    assert dec["block_tables"] == {"min": [1, 1, m], "opt": [1, 8, m], "max": [1, 8, m]}
    assert dec["positions"] == {"min": [1, 1], "opt": [8, 8], "max": [8, 8]}
    assert dec["logit_rows"] == {"min": [1, 1], "opt": [8, 8], "max": [8, 8]}
    assert pre["tree_mask"] == {"min": [1, 1, 1], "opt": [1, 256, 8], "max": [8, 256, 8]}  # ceil(rows / 32) words
    assert dec["tree_mask"] == {"min": [1, 1, 1], "opt": [8, 8, 1], "max": [8, 8, 1]}
    fixed = [nb1, 32, 4, 128]  # [blocks + 1, block_size, KV, d]
    for p in (pre, dec):
        assert p["past_key_0"] == p["past_value_0"] == {"min": fixed, "opt": fixed, "max": fixed}
    drafter = profiles_for("drafter", spec, {"pending_ids": [-1, -1], "pending_aux": [-1, -1, 3 * 512],
                                             "num_pending": [-1], "cur": [-1], "draft_slots": [-1],
                                             "draft_width": [-1], "block_tables": [-1, m], **kv})
    d = drafter["draft"]
    assert d["draft_slots"] == {"min": [1], "opt": [7], "max": [7]}  # k = 1..K drafts per pass
    assert d["draft_width"] == {"min": [1], "opt": [1], "max": [1]}  # chains: one candidate per position
    tree = EngineOptions("sm_90", max_batch=8, max_seq_len=2048, num_spec_tokens=7, prefill_chunk=256,
                         max_nodes=40, tree_width=16)  # a draft tree of up to 40 nodes, 16 candidates
    tkv = {"past_key_0": [-1, 32, 4, 128], "past_value_0": [-1, 32, 4, 128]}
    dec = profiles_for("target", tree, {"input_ids": [-1, -1], "positions": [-1, -1], "block_tables": [1, -1, -1],
                                        "logit_rows": [-1, -1], "tree_mask": [-1, -1, -1], **tkv})["decode"]
    assert dec["positions"]["max"] == [8, 41] and dec["tree_mask"]["max"] == [8, 41, 2]
    width = profiles_for("drafter", tree, {"pending_ids": [-1, -1], "pending_aux": [-1, -1, 1536],
                                           "num_pending": [-1], "cur": [-1], "draft_slots": [-1],
                                           "draft_width": [-1], "block_tables": [-1, -1], **tkv})
    assert width["draft"]["draft_width"]["max"] == [16]
    assert d["pending_ids"] == {"min": [1, 1], "opt": [8, 8], "max": [8, 256]}  # max(prefill_chunk, K+1)
    assert d["pending_aux"] == {"min": [1, 1, 1536], "opt": [8, 8, 1536], "max": [8, 256, 1536]}
    assert d["block_tables"] == {"min": [1, m], "opt": [8, m], "max": [8, m]}
    step = profiles_for("drafter_step", spec, {"input_ids": [-1, -1], "hidden": [-1, -1, 512],
                                               "positions": [-1, -1], "block_tables": [-1, -1], **kv})
    assert step["rows"]["block_tables"]["max"] == [8, m]
    small = EngineOptions("sm_100", max_batch=2, num_spec_tokens=15, prefill_chunk=4)
    rows = profiles_for("drafter_fc", small, {"aux": [-1, -1, 96]})["rows"]["aux"]
    assert rows["max"] == [2, 16, 96]  # K+1 > prefill_chunk
    # an explicit block count and size
    paged = EngineOptions(max_batch=8, max_seq_len=2048, num_spec_tokens=7, block_size=16, kv_blocks=300)
    assert paged.kv_layout == KVLayout(300, 2056, 8, 16, 256)
    shapes = {"input_ids": [-1, -1], "positions": [-1, -1], "block_tables": [1, -1, -1], "logit_rows": [-1, -1],
              "tree_mask": [-1, -1, -1], "past_key_0": [-1, -1, 4, 128]}
    assert profiles_for("target", paged, shapes)["decode"]["past_key_0"]["max"] == [301, 16, 4, 128]
    assert profiles_for("target", paged, shapes)["decode"]["block_tables"]["max"] == [1, 8, 129]


def test_profiles_reject_graphs_off_contract():
    spec = EngineOptions(max_batch=8, max_seq_len=2048, num_spec_tokens=7)
    good = {"input_ids": [-1, -1], "positions": [-1, -1], "block_tables": [1, -1, -1], "logit_rows": [-1, -1],
            "tree_mask": [-1, -1, -1]}
    with pytest.raises(BuildError, match=r"missing \['logit_rows'\]"):
        profiles_for("target", spec, {k: v for k, v in good.items() if k != "logit_rows"})
    with pytest.raises(BuildError, match=r"missing \['block_tables'\], unexpected \['slots'\]"):  # the old contract
        profiles_for("target", spec, {**{k: v for k, v in good.items() if k != "block_tables"}, "slots": [-1]})
    with pytest.raises(BuildError, match=r"axis 0 = 9 but blocks \+ 1 = .* gives 521"):
        profiles_for("target", spec, {**good, "past_key_0": [9, 32, 2, 64]})
    with pytest.raises(BuildError, match="axis 1 = 16 but --block-size gives 32"):
        profiles_for("target", spec, {**good, "past_key_0": [-1, 16, 2, 64]})
    with pytest.raises(BuildError, match="expected \\[blocks \\+ 1, block_size, kv_heads, head_dim\\]"):
        profiles_for("target", spec, {**good, "past_key_0": [8, 2, -1, 64]})  # [N, KV, T+1, d] of the slots
    with pytest.raises(BuildError, match=r"\(blocks\) was exported as 64 but the KV layout gives 65"):
        profiles_for("target", spec, {**good, "block_tables": [1, -1, 64]})
    with pytest.raises(BuildError, match="must be static"):
        profiles_for("target", spec, {**good, "block_tables": [-1, -1, -1]})  # G: the KV groups
    with pytest.raises(BuildError, match="must be dynamic"):
        profiles_for("target", spec, {**good, "input_ids": [1, -1]})
    with pytest.raises(BuildError, match="cannot hold one request"):
        EngineOptions(max_seq_len=2048, kv_blocks=10)


# -- (c) end to end against the fake -----------------------------------------------------------------
def test_build_end_to_end_with_fake_tensorrt(env):
    manifest = build_engines(env.export, env.out, env.spec)
    names = [c[0] for c in env.calls]
    assert ("create_network", 1 << 1) in env.calls  # 1 << int(STRONGLY_TYPED)
    assert names.index("load_library") < names.index("parse_from_file")  # plugins before any parse
    assert ("load_library", str(env.spec.plugin_library)) in env.calls
    assert {c[1] for c in env.calls if c[0] == "get_creator"} == {"PEagleKVAttention", "PEagleDraftInputs"}
    assert ("set_preview_feature", "ALIASED_PLUGIN_IO_10_03", True) in env.calls
    assert ("set_memory_pool_limit", "WORKSPACE", 1 << 30) in env.calls
    assert [c[1] for c in env.calls if c[0] == "parse_from_file"] == [
        str(env.export / "trt" / "target.onnx"), str(env.export / "trt" / "drafter.onnx")]
    profiles = [c[1] for c in env.calls if c[0] == "add_optimization_profile"]
    assert len(profiles) == 3  # target prefill + decode, drafter
    assert profiles[0]["input_ids"] == ((1, 1), (1, 16), (N, 16))
    assert profiles[1]["logit_rows"] == ((1, 1), (N, 4), (N, 4))
    assert profiles[2]["pending_ids"] == ((1, 1), (N, 4), (N, 16))
    assert profiles[0]["block_tables"] == ((1, 1, M), (1, 1, M), (1, N, M))  # M dynamic in target.onnx
    assert profiles[2]["block_tables"] == ((1, M), (N, M), (N, M))
    assert all("past_key_0" not in p for p in profiles)  # static KV inputs need no profile
    # the timing cache: created empty, then grown by each build and saved
    assert [c[1] for c in env.calls if c[0] == "create_timing_cache"] == [b"", b"+"]
    assert env.spec.timing_cache.read_bytes() == b"++"
    # plans and manifest, atomically in place
    plan = (env.out / "target.sm_90.plan").read_bytes()
    assert plan == b"PLAN:" + str(env.export / "trt" / "target.onnx").encode()
    assert (env.out / "drafter.sm_90.plan").is_file()
    assert (env.out / "plugins" / "sm_90" / "libpeagle_trt_plugins.so").is_file()
    assert _leftovers(env.root) == []
    assert verify_manifest(env.out)["engines"] == manifest["engines"]
    assert manifest["tensorrt_version"] == "10.99.0" and manifest["cuda_version"] == "13.0"
    assert manifest["gpu_name"] == "NVIDIA H200" and manifest["gpu_arch"] == "sm_90"
    assert manifest["export"]["manifest_sha256"] == sha256(env.export / "manifest.json")
    entry = manifest["engines"]["sm_90"]
    assert entry["strongly_typed"] and entry["aliased_plugin_io"]
    assert entry["hardware_compatibility"] == "NONE"
    assert entry["graphs"]["target"]["profiles"]["decode"]["past_key_0"]["max"] == [NB1, BS, KV, D]
    assert entry["graphs"]["target"]["profiles"]["decode"]["block_tables"]["max"] == [1, N, M]
    assert entry["kv"] == {"num_blocks": NB1 - 1, "max_len": 36, "max_batch": N, "block_size": BS, "max_rows": 16,
                           "cache_dtype": "auto"}  # the export's (its manifest's kv)
    assert {"target.sm_90.plan", "drafter.sm_90.plan", "plugins/sm_90/libpeagle_trt_plugins.so"} <= set(
        manifest["files"])
    # a rebuild loads the saved timing cache
    env.calls.clear()
    build_engines(env.export, env.out, env.spec)
    assert [c[1] for c in env.calls if c[0] == "create_timing_cache"][0] == b"++"


def test_second_arch_is_added_next_to_the_first(env):
    build_engines(env.export, env.out, env.spec)
    env.monkeypatch.setattr(stage, "visible_gpu", lambda: ("NVIDIA B200", "sm_100"))
    manifest = build_engines(env.export, env.out, replace(env.spec, gpu_arch="sm_100"))
    assert set(manifest["engines"]) == {"sm_90", "sm_100"}
    assert (env.out / "target.sm_90.plan").is_file() and (env.out / "target.sm_100.plan").is_file()
    verify_manifest(env.out)


def test_parse_errors_are_each_reported_and_nothing_is_left(env):
    env.monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(env.calls, parse_errors=[
        "In node 3 (PEagleKVAttention): UNSUPPORTED_NODE: plugin not found", "In node 7: INVALID_GRAPH"]))
    with pytest.raises(BuildError) as err:
        build_engines(env.export, env.out, env.spec)
    assert "UNSUPPORTED_NODE: plugin not found" in str(err.value) and "INVALID_GRAPH" in str(err.value)
    assert not env.out.exists() and _leftovers(env.root) == []


class FakeParserError:
    """tensorrt.ParserError's accessors (nvonnxparser::IParserError)."""

    def code(self):
        return "ErrorCode.UNSUPPORTED_NODE"

    def desc(self):
        return "creator not found"

    def node(self):
        return 3

    def node_name(self):
        return "attn_0"

    def node_operator(self):
        return "PEagleKVAttention"


def test_parser_error_accessors_are_reported(env):
    env.monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(env.calls, parse_errors=[FakeParserError()]))
    with pytest.raises(BuildError, match=r"node 3 'attn_0' \(PEagleKVAttention\): ErrorCode.UNSUPPORTED_NODE: "
                                         r"creator not found"):
        build_engines(env.export, env.out, env.spec)


def test_tensorrt_11_networks_take_no_strongly_typed_flag(env):
    env.monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(env.calls, version="11.1.0"))
    build_engines(env.export, env.out, env.spec)
    assert [c for c in env.calls if c[0] == "create_network"] == [("create_network", 0)] * 2


def test_plugins_already_registered_are_not_loaded_twice_and_a_refusal_is_an_error(env):
    build_engines(env.export, env.out, env.spec)
    env.calls.clear()
    stage.load_plugins(sys.modules["tensorrt"], env.spec.plugin_library, list(stage.PLUGIN_OPS))
    assert not [c for c in env.calls if c[0] == "load_library"]  # loadLibrary would return nullptr
    env.monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(env.calls, refuse_library=True))
    with pytest.raises(BuildError, match="refused the plugin library"):
        build_engines(env.export, env.out, env.spec)


def test_failed_build_keeps_the_previous_engines(env):
    build_engines(env.export, env.out, env.spec)
    before = (env.out / "target.sm_90.plan").read_bytes()
    env.monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(env.calls, fail_build=True))
    with pytest.raises(BuildError, match="(?s)could not build target.*out of memory"):
        build_engines(env.export, env.out, env.spec)
    assert (env.out / "target.sm_90.plan").read_bytes() == before and _leftovers(env.root) == []
    verify_manifest(env.out)


def test_plugin_library_problems(env):
    with pytest.raises(BuildError, match="not found; build it with CMake"):
        build_engines(env.export, env.out, replace(env.spec, plugin_library=env.root / "no.so"))
    with pytest.raises(BuildError, match=r"pass --plugin-library"):
        build_engines(env.export, env.out, replace(env.spec, plugin_library=None))
    only_attention = fake_tensorrt(env.calls, creators=("PEagleKVAttention",))
    env.monkeypatch.setitem(sys.modules, "tensorrt", only_attention)
    with pytest.raises(BuildError, match=r"no creator for \['PEagleDraftInputs'\]"):
        build_engines(env.export, env.out, env.spec)
    assert not env.out.exists()


def test_arch_must_match_the_visible_gpu_unless_allowed(env):
    b200 = replace(env.spec, gpu_arch="sm_100")
    with pytest.raises(BuildError, match=r"sm_90 plans on an H100/H200 and sm_100 plans on a B200"):
        build_engines(env.export, env.out, b200)
    manifest = build_engines(env.export, env.out, replace(b200, allow_arch_mismatch=True))
    assert ("hardware_compatibility_level", "AMPERE_PLUS") in env.calls
    assert manifest["engines"]["sm_100"]["hardware_compatibility"] == "AMPERE_PLUS"
    assert manifest["engines"]["sm_100"]["built_on"] == "sm_90" and (env.out / "target.sm_100.plan").is_file()


def test_drafter_k_must_match_the_export(env):
    with pytest.raises(BuildError, match="exported with K = 3 but --num-spec-tokens is 5"):
        build_engines(env.export, env.out, replace(env.spec, num_spec_tokens=5))


def test_cli_parser_and_command(env):
    from peagle_trt.engine.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "--export-dir", str(env.export), "--output", str(env.out),
                              "--gpu-arch", "sm_90", "--plugin-library", str(env.spec.plugin_library),
                              "--max-batch", str(N), "--max-seq-len", "32", "--num-spec-tokens", "3",
                              "--prefill-chunk", "16", "--block-size", str(BS),
                              "--timing-cache", str(env.spec.timing_cache)])
    out = args.func(args)
    assert out["plans"] == ["target.sm_90.plan", "drafter.sm_90.plan"]
    assert out["tensorrt_version"] == "10.99.0"
    with pytest.raises(SystemExit):
        parser.parse_args(["engine", "--export-dir", "x", "--output", "y", "--gpu-arch", "sm_80"])


def test_executor_binds_kv_in_place_and_picks_the_profile_by_rows(env):
    from peagle_trt.executors.tensorrt import TensorRTExecutor

    build_engines(env.export, env.out, env.spec)
    env.calls.clear()
    ex = TensorRTExecutor(env.out, arch="sm_90", device="cpu")  # the fake runs no kernels
    assert ("load_library", str(env.out / "plugins" / "sm_90" / "libpeagle_trt_plugins.so")) in env.calls
    assert ex.kv == KVLayout(NB1 - 1, 36, N, BS, 16) == env.spec.kv_layout and ex.windows == (0,)
    assert ex.kv.max_blocks == M
    assert [c for c in env.calls if c[0] == "set_optimization_profile_async"] == [
        ("set_optimization_profile_async", 1)]  # target: a context per profile; drafter: one
    target, drafter = ex.runners["target"], ex.runners["drafter"]
    assert len(target.contexts) == 2 and len(drafter.contexts) == 1
    for runner in (target, drafter):
        for ctx in runner.contexts:
            for kind in ("key", "value"):
                ptr = runner.caches[f"past_{kind}_0"].data_ptr()
                assert ctx.addresses[f"past_{kind}_0"] == ctx.addresses[f"present_{kind}_0"] == ptr
    assert target.caches["past_key_0"].shape == (NB1, BS, KV, D)  # paged: [blocks + 1, block_size, KV, d]
    assert drafter.caches["past_key_0"].data_ptr() != target.caches["past_key_0"].data_ptr()
    # verify: K+1 rows, all logits -> decode profile (1); the target takes the [G, B, M] tables
    tokens, pos = torch.zeros(2, 4, dtype=torch.long), torch.arange(4).expand(2, 4)
    tables = torch.full((1, 2, M), -1, dtype=torch.long)
    tables[0, :, 0] = torch.tensor([3, 7])
    logits, aux = ex.target(tokens, pos, tables)
    assert logits.shape == (2, 4, 16) and aux.shape == (2, 4, H3)
    assert env.calls[-1][:2] == ("execute_async_v3", 1) and env.calls[-1][2]["block_tables"] == (1, 2, M)
    # a prefill chunk longer than K+1 with one logit row -> prefill profile (0)
    chunk = torch.zeros(1, 10, dtype=torch.long)
    logits, _ = ex.target(chunk, torch.arange(10)[None], tables[:, :1], torch.tensor([[9]]))
    assert logits.shape == (1, 1, 16) and env.calls[-1][:2] == ("execute_async_v3", 0)
    with pytest.raises(RuntimeInvariantError, match="fit no optimization profile"):
        too_long = torch.zeros(1, 17, dtype=torch.long)
        ex.target(too_long, torch.arange(17)[None], tables[:, :1], torch.tensor([[16]]))
    with pytest.raises(RuntimeInvariantError, match="fit no optimization profile"):  # M entries, no fewer
        ex.target(tokens, pos, tables[:, :, :3])
    aux3 = torch.zeros(2, 4, H3)
    drafts = ex.draft_parallel(tokens, aux3, torch.tensor([4, 2]), torch.tensor([8, 6]), tables, 1)
    assert drafts.shape == (2, 1) and drafts.dtype == torch.long  # the k=1 pass of a partial prefill
    assert env.calls[-1][2]["block_tables"] == (2, M)  # the drafter plan takes group 0's [B, M]
    with pytest.raises(RuntimeInvariantError, match="built for K = 3"):
        ex.draft_parallel(tokens, aux3, torch.tensor([4, 2]), torch.tensor([8, 6]), tables, 4)
    assert not hasattr(ex, "alloc_slot")  # the runtime assigns blocks (peagle_trt/runtime/blocks.py)


def test_executor_kv_layout_without_the_manifest_entry(env):
    """An engine manifest without `kv`: the layout comes from the caches and the profiles."""
    from peagle_trt.executors.tensorrt import TensorRTExecutor

    build_engines(env.export, env.out, env.spec)
    import json

    path = env.out / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["engines"]["sm_90"]["kv"]
    path.write_text(json.dumps(manifest))
    ex = TensorRTExecutor(env.out, arch="sm_90", device="cpu", verify=False)
    assert ex.kv == KVLayout(NB1 - 1, M * BS, N, BS)


def test_windowed_attention_is_refused_for_tensorrt(tmp_path):
    """The plugins have no sliding windows / sinks: a graph whose attention carries them is refused
    before any build (a drafter window covering every KV position is left out of the export)."""
    def graph_with(name: str, inputs: list[str], **attrs):
        node = helper.make_node("PEagleKVAttention", inputs, ["out", "k1", "v1"], name="attn", domain="peagle",
                                **attrs)
        graph = helper.make_graph([node], name, [], [])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph), str(path))
        return path

    plain = ["q", "k", "v", "positions", "block_tables", "k0", "v0"]
    assert stage._graph_info(graph_with("full", plain))["plugin_ops"] == ["PEagleKVAttention"]
    for path in (graph_with("window", plain, sliding_window=8), graph_with("sinks", [*plain, "sinks"])):
        with pytest.raises(BuildError, match=r"sliding windows or attention sinks.*--backend torch or onnxruntime"):
            stage._graph_info(path)
