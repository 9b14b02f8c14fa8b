"""`peagle-trt train` end to end on the tiny target (CPU, seconds): the output loads with our
loader in both layouts and drafts through the speculative decoder; runs are reproducible and a
resumed run equals an uninterrupted one; JSONL prompts are answered by the target itself."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from peagle_trt.checkpoint import load_drafter, load_pair
from peagle_trt.cli import main
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import CheckpointError, ConfigError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.make_tiny import CORPUS
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.train import TrainConfig, train


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("\n".join(CORPUS * 6))
    return path


def _cfg(tiny, text_file, out, **kw):
    base = dict(target=tiny["llama"], output=out, text=(text_file,), steps=4, batch=2, seq_len=40,
                depths=4, draft_vocab=200, taps=(1, 3, 5), log_every=100, lr=3e-3)
    return TrainConfig(**{**base, **kw})


def _quiet(line, final=False):
    pass


@pytest.mark.parametrize("method,layout", [("peagle", "aws"), ("peagle", "speculators"), ("eagle3", "aws"),
                                           ("eagle3", "speculators")])
def test_short_run_writes_a_loadable_head(tiny, text_file, tmp_path, method, layout):
    out = tmp_path / "head"
    result = train(_cfg(tiny, text_file, out, method=method, layout=layout, segments=2), _quiet)
    assert result["steps"] == 4 and result["final_loss"] > 0
    ckpt = load_drafter(out)
    assert ckpt.config.layout == ("speculators" if layout == "speculators" else
                                  "aws" if method == "peagle" else "eagle3")
    assert ckpt.config.supports_parallel == (method == "peagle")
    assert ckpt.config.aux_layer_ids == (1, 3, 5) and ckpt.config.draft_vocab_size == 200
    assert ckpt.config.trained_depth == 4
    # served as trained: the training-time test feeds back the pre-norm state, so must the loaded head
    # (a speculators config once said norm_output and the served EAGLE-3 fed back norm(x))
    assert (ckpt.config.norm_output, ckpt.config.norm_before_fc) == (False, False)
    spec = SpecConfig(method, 3)
    target, drafter = load_pair(tiny["llama"], out, spec).build()
    ref = SpecDecoder(TorchExecutor(target, None, 1, 256, deterministic=True), SpecConfig("none", 0))
    dec = SpecDecoder(TorchExecutor(target, drafter, 1, 256, deterministic=True), spec)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [5, 17, 33, 2]
    assert generate(dec, prompt, params).output == generate(ref, prompt, params).output


def test_seeded_runs_are_reproducible_and_resume_equals_uninterrupted(tiny, text_file, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(_cfg(tiny, text_file, a, steps=6), _quiet)
    train(_cfg(tiny, text_file, b, steps=6), _quiet)
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    class Interrupt(Exception):
        pass

    def stop_at_step_5(line, final=False):
        if line.startswith("step 5/"):
            raise Interrupt

    ckpt = tmp_path / "ckpt"
    with pytest.raises(Interrupt):
        train(_cfg(tiny, text_file, c, steps=6, checkpoint_dir=ckpt, save_every=3), stop_at_step_5)
    assert (ckpt / "state.pt").is_file() and not c.exists()
    result = train(_cfg(tiny, text_file, c, steps=6, checkpoint_dir=ckpt, save_every=3), _quiet)
    assert result["resumed_at"] == 3
    tc = load_file(c / "model.safetensors")
    assert all(torch.equal(ta[k], tc[k]) for k in ta)
    with pytest.raises(CheckpointError, match="different training config"):
        train(_cfg(tiny, text_file, c, steps=6, checkpoint_dir=ckpt, lr=1e-2, force=True), _quiet)


def test_jsonl_prompts_regenerated_by_the_target_via_cli(tiny, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in CORPUS[:3]) + "\n")
    out = tmp_path / "head"
    code = main(["train", "--target", str(tiny["llama"]), "--output", str(out), "--data", str(data),
                 "--regen-max-tokens", "12", "--steps", "2", "--batch", "2", "--depths", "3",
                 "--taps", "1,3,5", "--method", "eagle3", "--save-dtype", "bfloat16"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["method"] == "eagle3" and summary["steps"] == 2
    assert load_file(out / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    load_pair(tiny["llama"], out, SpecConfig("eagle3", 3)).build()


def test_bad_input_gets_a_clear_error(tiny, text_file, tmp_path):
    with pytest.raises(ConfigError, match="pass a data source"):
        train(TrainConfig(target=tiny["llama"], output=tmp_path / "x"), _quiet)
    with pytest.raises(ConfigError, match="--taps"):
        train(_cfg(tiny, text_file, tmp_path / "y", taps=(1, 2, 99)), _quiet)
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "f").write_text("x")
    with pytest.raises(ConfigError, match="--force"):
        train(_cfg(tiny, text_file, tmp_path / "z"), _quiet)


def test_batched_regeneration_equals_transformers_greedy(tiny):
    """The responses `train --data` supervises are the target's own greedy answers: regenerated in
    one batch through the scheduler, each equals transformers' greedy `generate` on its prompt."""
    from peagle_trt.train.data import regenerate_all
    from tests.helpers import hf_target, our_target

    target = our_target(tiny["llama"], (1, 3, 5))
    torch.manual_seed(1)
    prompts = [torch.randint(5, target.config.vocab_size, (n,)).tolist() for n in (3, 9, 5, 14)]
    got = regenerate_all(target, prompts * 5, 10, 0.0, (), seed=0, batch=2)  # more than the queue holds at once
    hf = hf_target(tiny["llama"])
    assert got[:4] * 5 == got
    for prompt, response in zip(prompts, got):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        assert response == out[0, len(prompt):].tolist()
