"""RepositoryOptions + ArtifactPaths round-trip through config.pbtxt parameters (peagle_trt/serve/options.py):
what `peagle-trt build` writes is what the Triton model and `generate --repo` read back."""

import pytest

from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.serve.options import ArtifactPaths, RepositoryOptions, from_parameters, to_parameters


@pytest.mark.parametrize("options, paths", [
    (RepositoryOptions(SpecConfig("peagle", 3), model_name="m", backend="torch", max_batch=2,
                       max_seq_len=96, prefill_chunk=16, device="cpu", dtype="bfloat16", max_prompt_bytes=100,
                       max_stop_bytes=0),
     ArtifactPaths("artifacts/target", "artifacts/drafter")),
    (RepositoryOptions(SpecConfig("eagle3", 5), backend="tensorrt", gpu_arch="sm_100",
                       plugin_library="/x/lib.so", max_prompt_bytes=4096, max_stop_bytes=64),
     ArtifactPaths("artifacts/tokenizer", onnx="artifacts/onnx", engine="artifacts/engines")),
    (RepositoryOptions(SpecConfig("none", 1), backend="onnxruntime", max_prompt_bytes=7, max_stop_bytes=9,
                       kv_cache_dtype="fp8"),
     ArtifactPaths("artifacts/tokenizer", onnx="artifacts/onnx")),
])
def test_options_round_trip_through_parameters(options, paths):
    params = to_parameters(options, paths)
    assert all(isinstance(v, str) for v in params.values())  # config.pbtxt string_value
    assert from_parameters(params, options.model_name) == (options, paths)


def test_default_input_limits_are_written_resolved():
    options = RepositoryOptions(SpecConfig("peagle", 2), max_seq_len=128)
    params = to_parameters(options, ArtifactPaths("t"))
    assert (params["max_prompt_bytes"], params["max_stop_bytes"]) == (str(16 * 128), "1024")
    back, _ = from_parameters(params)
    assert (back.max_prompt_bytes, back.max_stop_bytes) == (16 * 128, 1024)
    assert back.input_limits() == options.input_limits()


def test_missing_or_malformed_parameters_are_named():
    params = to_parameters(RepositoryOptions(SpecConfig("peagle", 2)), ArtifactPaths("t"))
    with pytest.raises(ConfigError, match="'target_path'"):
        from_parameters({k: v for k, v in params.items() if k != "target_path"})
    with pytest.raises(ConfigError, match="'max_batch' must be an integer"):
        from_parameters({**params, "max_batch": "eight"})
    with pytest.raises(ConfigError, match="backend"):
        from_parameters({**params, "backend": "vllm"})


def test_kv_cache_dtype_reaches_the_layout_and_is_checked():
    """`--kv-cache-dtype` is one parameter of config.pbtxt: the executors' KVLayout carries it; a
    repository built before it existed reads as auto; a value outside auto / fp8 is refused by name."""
    from peagle_trt.errors import BuildError

    options = RepositoryOptions(SpecConfig("peagle", 2), kv_cache_dtype="fp8")
    params = to_parameters(options, ArtifactPaths("t"))
    assert params["kv_cache_dtype"] == "fp8"
    assert from_parameters(params)[0].kv_layout.cache_dtype == "fp8"
    older = {k: v for k, v in params.items() if k != "kv_cache_dtype"}
    assert from_parameters(older)[0].kv_layout.cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype 'fp8_e5m2' is not one of"):
        from_parameters({**params, "kv_cache_dtype": "fp8_e5m2"})
    with pytest.raises(BuildError, match="kv_cache_dtype 'float16'"):
        RepositoryOptions(SpecConfig("peagle", 2), kv_cache_dtype="float16")
