"""vLLM's serve command on `peagle-trt serve` (peagle_trt/serve/vllm.py): the gpt-oss-120b head
card's command, program name aside, is taken as it is (its flags honoured or said to have no
effect, with why; `--kv-cache-dtype fp8` builds E4M3 KV caches) and flags serve does not have are
refused by name; with a small GPT-OSS pair held
under the card's hub ids in an offline cache, the command builds into the cache, serves on the
OpenAI port, and a chat request through the `openai` client equals target-only greedy decoding of
the same checkpoint with the same FP8 KV cache; the same request again reuses the built repository.
`--seed` seeds unseeded requests."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys

import pytest

from peagle_trt import speculative_config
from peagle_trt.cli import build_parser, main
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.flags import normalize_argv
from peagle_trt.serve import vllm
from tests.hub_layout import offline_hub, put_model
from tests.serve.conftest import free_port

# amazon/gpt-oss-120b-p-eagle's model card, "Usage" (its em dash before `tp` included)
CARD = """CUDA_VISIBLE_DEVICES=0 VLLM_USE_FLASHINFER_MOE_MXFP4_MXFP8=1 \\
vllm serve openai/gpt-oss-120b \\
--speculative-config '{"method": "eagle3", "model": "amazon/gpt-oss-120b-p-eagle", "num_speculative_tokens": 5, \
"parallel_drafting": true}' \\
\u2014tp 1 \\
--max-num-batched-tokens 32768 \\
--kv-cache-dtype fp8 \\
--async-scheduling \\
--stream-interval 20 \\
--max-cudagraph-capture-size 4096 \\
--no-enable-prefix-caching \\
--port 8040 \\
--gpu-memory-utilization 0.9 \\
--max-num-seqs 128 \\
--max-model-len 32768"""


def card_argv(**values) -> list[str]:
    """The card's command after `vllm` (its environment assignments dropped), flag values replaced."""
    words = shlex.split(CARD.replace("\\\n", " "))  # line continuations, as a shell reads them
    argv = words[words.index("vllm") + 1:]
    for flag, value in values.items():
        argv[argv.index("--" + flag.replace("_", "-")) + 1] = str(value)
    return argv


def test_the_card_command_is_taken_as_it_is():
    parser = build_parser()
    args, unknown = parser.parse_known_args(normalize_argv(card_argv(), parser))
    assert unknown == [] and args.func.__name__ == "cmd_serve" and args.tensor_parallel_size == 1
    vllm.check_flags(args, model_mode=True)
    said = [note.split(":")[0] for note in vllm.notes(args)]
    assert said == ["--async-scheduling", "--max-num-batched-tokens", "--stream-interval",
                    "--max-cudagraph-capture-size", "--gpu-memory-utilization"]  # --kv-cache-dtype fp8: applied
    parsed = speculative_config.resolve(args.speculative_config, "serve")
    assert (parsed.model, parsed.spec) == ("amazon/gpt-oss-120b-p-eagle", SpecConfig("peagle", 5))
    assert vllm._build_argv(args, parsed) == [
        "--backend", "auto", "--device", "cpu",
        "--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 5, "parallel_drafting": true}',
        "--max-seq-len", "32768", "--max-batch", "128", "--no-prefix-caching", "--kv-cache-dtype", "fp8"]
    assert args.port == 8040
    prompt = ["generate", "--prompt", "\u2014tp is a flag here"]  # only flags are read as such
    assert normalize_argv(prompt + ["\u2014max-tokens", "4"], parser) == prompt + ["--max-tokens", "4"]


@pytest.mark.parametrize("extra, expected", [
    (["--pipeline-parallel-size", "2"], "does not take --pipeline-parallel-size"),
    (["-tp", "2"], "--tensor-parallel-size 2: one device"),
    (["--trust-remote-code"], "--trust-remote-code is refused"),
    (["--kv-cache-dtype", "bfloat16"], "--kv-cache-dtype bfloat16: the KV cache stores the model dtype"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: only E4M3 FP8 caches are implemented"),
    (["--model", "/no/such/model"], "not a built repository, a model directory or a hub id"),
])
def test_flags_serve_does_not_have_are_refused_by_name(extra, expected, capsys):
    model = [] if "--model" in extra else ["openai/gpt-oss-120b"]
    assert main(["serve", *model, *extra]) == 2
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["error_type"] == "ConfigError" and expected in result["error"]


def test_seed_gives_unseeded_requests_repeatable_seeds(tiny, monkeypatch):
    """`serve --seed N` reaches the models as PEAGLE_SERVE_SEED (peagle_trt/serve/server.py): requests
    without a seed get one from N and their arrival order (a seeded sampler is tested in test_openai.py)."""
    from peagle_trt.serve.generator import TextGenerator

    monkeypatch.setenv("PEAGLE_SERVE_SEED", "7")
    params = SamplingParams(max_tokens=12, temperature=1.0)

    def seeds() -> list[int | None]:
        gen = TextGenerator.from_checkpoints(tiny["llama"], None, SpecConfig("none", 1), max_seq_len=64)
        return [gen.seeded(params).seed, gen.seeded(params).seed, gen.seeded(SamplingParams(seed=3)).seed]

    first = seeds()
    assert first == seeds() and first[0] != first[1] and first[2] == 3  # per run, per request; own seeds kept
    monkeypatch.setenv("PEAGLE_SERVE_SEED", "8")
    assert seeds()[:2] != first[:2]
    monkeypatch.delenv("PEAGLE_SERVE_SEED")
    assert seeds() == [None, None, 3]


@pytest.mark.triton
def test_the_card_command_builds_serves_and_reuses_a_pair_held_under_its_ids(tiny_gpt_oss, tmp_path, monkeypatch):
    openai = pytest.importorskip("openai")
    pytest.importorskip("pytriton")
    from peagle_trt.serve.generator import TextGenerator
    from peagle_trt.serve.options import read_options

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    offline_hub(monkeypatch, cache)
    target = put_model(cache, "openai/gpt-oss-120b", tiny_gpt_oss["target"])
    put_model(cache, "amazon/gpt-oss-120b-p-eagle", tiny_gpt_oss["drafter"])
    monkeypatch.setenv("PEAGLE_TRT_CACHE", str(tmp_path / "peagle-cache"))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # vLLM's switch: the same tokens in any batch (exact check)
    # the card's sizes are a 120B model's: this pair gets a small KV cache, and free ports
    argv = card_argv(port=free_port(), max_model_len=256, max_num_seqs=4) + [
        "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "peagle_trt.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"serve exited before it was ready: {proc.communicate(timeout=30)}")
        ready = json.loads(line)
        assert ready["built"] is True and ready["served_model_names"] == ["openai/gpt-oss-120b"]
        assert ready["target"] == str(target) and len(ready["notes"]) == 5
        assert read_options(ready["repository"])[1].kv_layout.cache_dtype == "fp8"  # the card's --kv-cache-dtype fp8
        client = openai.OpenAI(base_url=ready["openai"], api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["openai/gpt-oss-120b"]
        messages = [{"role": "user", "content": "Explain how a transformer attends to earlier tokens"}]
        reply = client.chat.completions.create(model="openai/gpt-oss-120b", messages=messages, max_tokens=24,
                                               temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        spec = reply.model_extra["metrics"]["speculative_decoding"]
        assert spec["num_spec_tokens"] == 5 and spec["num_spec_steps"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    alone = TextGenerator.from_checkpoints(target, None, SpecConfig("none", 1), max_seq_len=256,
                                           backend="onnxruntime", deterministic=True, kv_cache_dtype="fp8")
    expected = alone.generate(messages[0]["content"], SamplingParams(max_tokens=24, ignore_eos=True))
    assert reply.choices[0].model_extra["token_ids"] == expected["token_ids"]
    # the same request again: the repository in the cache, not rebuilt
    parser = build_parser()
    args, _ = parser.parse_known_args(normalize_argv(argv, parser))
    again = vllm.prepare(args, "openai/gpt-oss-120b")
    assert (str(again.repo), again.built) == (ready["repository"], False)
