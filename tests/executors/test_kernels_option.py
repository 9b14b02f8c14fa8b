"""The `kernels` option of the torch executor (reference | cuda) without a GPU: its plumbing from
`peagle-trt build --kernels` through config.pbtxt to `TorchExecutor`, the typed errors when the CUDA
kernels cannot run, and that the op dispatchers change nothing outside `kernels.routed()`.
The kernels themselves, on a GPU: test_kernels_gpu.py and test_executor_gpu.py (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.config import SpecConfig
from peagle_trt.errors import BuildError, ConfigError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.ops import kernels, reference
from tests.helpers import greedy, make_decoder


@pytest.fixture
def restore_ops():
    yield
    kernels.disable()  # puts the reference functions back in place of the dispatchers


def test_unknown_kernels_value_is_a_config_error(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3)
    ex = decoder.ex
    with pytest.raises(ConfigError, match=r"kernels='triton' is not one of \('reference', 'cuda'\)"):
        TorchExecutor(ex.target_model, ex.drafter_model, kernels="triton")


def test_cuda_kernels_on_a_cpu_model_raise_with_the_fix(tiny):
    ex = make_decoder(tiny, "llama", "aws", "peagle", 3).ex
    with pytest.raises(kernels.KernelsUnavailable, match="needs the model on a CUDA device, got cpu"):
        TorchExecutor(ex.target_model, ex.drafter_model, kernels="cuda")
    assert issubclass(kernels.KernelsUnavailable, ConfigError)


def test_routed_ops_never_fall_back_to_the_reference(restore_ops):
    """Inside routed() (kernels="cuda") a call the kernel cannot serve raises; here: CPU tensors."""
    logits = torch.randn(2, 3, 11)
    with kernels.routed():
        from peagle_trt.executors import torch as executor

        with pytest.raises(kernels.KernelsUnavailable, match="no CUDA device"):
            executor.draft_sample(logits, None)


def test_installed_dispatchers_change_no_result_outside_routed(tiny, restore_ops):
    from peagle_trt.models import layers
    from peagle_trt.runtime.scheduler import generate

    prompt = list(range(3, 30))
    expected = generate(make_decoder(tiny, "llama", "aws", "peagle", 3), prompt, greedy(12)).output
    kernels.install()
    assert layers.kv_attention is not reference.kv_attention  # the dispatcher is in place
    assert generate(make_decoder(tiny, "llama", "aws", "peagle", 3), prompt, greedy(12)).output == expected
    kernels.disable()
    assert layers.kv_attention is reference.kv_attention


def test_build_plumbs_kernels_into_config_pbtxt_and_checks_it(tiny, tmp_path):
    from peagle_trt.build import RepositoryOptions, build_repository
    from peagle_trt.serve.generator import make_executor
    from peagle_trt.serve.options import read_options

    spec = SpecConfig("peagle", 3)
    with pytest.raises(BuildError, match="needs --backend torch --device cuda"):
        RepositoryOptions(spec, kernels="cuda")  # device cpu
    with pytest.raises(BuildError, match="not one of"):
        RepositoryOptions(spec, kernels="fast")
    repo = RepositoryOptions(spec, device="cuda", dtype="bfloat16", kernels="cuda")
    manifest = build_repository(tiny["llama"], tiny["aws"], tmp_path / "repo", repo)
    config = (tmp_path / "repo" / "peagle" / "config.pbtxt").read_text()
    assert 'key: "kernels" value { string_value: "cuda" }' in config
    assert manifest["repo"]["kernels"] == "cuda"
    model_dir, options, paths = read_options(tmp_path / "repo")
    assert options.kernels == "cuda"  # read back from config.pbtxt
    with pytest.raises(kernels.KernelsUnavailable, match="CUDA device"):  # the served executor checks too
        make_executor(options, paths, model_dir / "1")
