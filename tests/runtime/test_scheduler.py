"""In-flight batching: outputs are token-identical to one-at-a-time greedy decoding whatever the
batch mix, arrivals, chunked prefill, cancellations and capacity limits, and when a request reuses
the cached prefix of a finished tree request."""

from __future__ import annotations

import random

import pytest
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import RequestError
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from tests.helpers import ScriptedDrafter, collect, greedy, make_decoder


def workload(n: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(500) for _ in range(rng.randint(1, 70))], rng.randint(1, 40)) for _ in range(n)]


@pytest.fixture(scope="module")
def references(tiny):
    single = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256)
    return {i: generate(single, p, SamplingParams(max_tokens=m, ignore_eos=True)).output
            for i, (p, m) in enumerate(workload(24, 7))}


@pytest.mark.parametrize("mode,k", [("peagle", 3), ("eagle3", 3), ("none", 1)])
def test_batched_outputs_equal_single_request_outputs(tiny, references, mode, k):
    decoder = make_decoder(tiny, "llama", "aws", mode, k, max_len=256, slots=6)
    sched = Scheduler(decoder, prefill_chunk=16)
    outputs: dict = {}
    pending = list(enumerate(workload(24, 7)))
    steps = 0
    while pending or sched.has_work:
        for _ in range(random.Random(steps).randint(0, 3)):  # staggered arrivals
            if pending:
                i, (prompt, m) = pending.pop(0)
                sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True),
                                  collect(outputs)))
        sched.step()
        steps += 1
        assert len(sched.running) <= 6
    for i, ref in references.items():
        assert outputs[str(i)]["ids"] == ref, i
        assert outputs[str(i)]["final"] == 1 and outputs[str(i)]["reason"] == "length"
    assert sched.blocks.used_blocks == 0
    assert sched.finished_requests == 24 and sched.generated_tokens == sum(map(len, references.values()))


def test_requests_wait_when_all_slots_are_taken(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=2)
    sched = Scheduler(decoder)
    outputs: dict = {}
    for i in range(5):
        sched.add(Request(str(i), [1, 2, 3 + i], SamplingParams(max_tokens=10, ignore_eos=True), collect(outputs)))
    sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    sched.run_until_idle()
    assert all(len(outputs[str(i)]["ids"]) == 10 for i in range(5))


def test_cancel_frees_the_slot_and_others_continue(tiny, references):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=4)
    sched = Scheduler(decoder)
    outputs: dict = {}
    load = workload(24, 7)
    for i in (0, 1, 2):
        prompt, m = load[i]
        sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(outputs)))
    victim = sched.add(Request("victim", [9] * 5, SamplingParams(max_tokens=40, ignore_eos=True),
                               collect(outputs)))
    sched.step()
    sched.step()
    used = sched.blocks.used_blocks
    sched.cancel(victim)
    sched.step()
    assert outputs["victim"]["reason"] == "abort" and outputs["victim"]["final"] == 1
    assert sched.blocks.used_blocks < used
    sched.run_until_idle()
    for i in (0, 1, 2):
        assert outputs[str(i)]["ids"] == references[i]


def test_stop_from_callback_ends_only_that_request(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=2)
    sched = Scheduler(decoder)
    got: dict = {}
    sched.add(Request("a", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True),
                      lambda out: collect(got)(out) or len(got["a"]["ids"]) >= 3))
    sched.add(Request("b", [1, 2], SamplingParams(max_tokens=30, ignore_eos=True), collect(got)))
    sched.run_until_idle()
    assert got["a"]["reason"] == "stop" and 3 <= len(got["a"]["ids"]) < 30
    assert len(got["b"]["ids"]) == 30 and got["b"]["reason"] == "length"


def test_requests_that_cannot_fit_are_refused_not_truncated(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=64, slots=2)
    sched = Scheduler(decoder)
    with pytest.raises(RequestError, match="exceeds the maximum sequence length"):
        sched.add(Request("x", [1] * 50, SamplingParams(max_tokens=20), lambda o: None))
    with pytest.raises(RequestError, match="empty"):
        sched.add(Request("y", [], SamplingParams(max_tokens=2), lambda o: None))
    assert not sched.has_work


def test_a_failing_callback_cancels_only_its_request(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=128, slots=2)
    sched = Scheduler(decoder)
    got: dict = {}

    def broken(out):
        raise RuntimeError("client went away")

    sched.add(Request("bad", [1, 2], SamplingParams(max_tokens=20, ignore_eos=True), broken))
    sched.add(Request("good", [1, 2], SamplingParams(max_tokens=20, ignore_eos=True), collect(got)))
    sched.run_until_idle()
    assert len(got["good"]["ids"]) == 20 and sched.blocks.used_blocks == 0


def test_requests_with_one_client_id_are_cancelled_separately(tiny, references):
    """The client's request id is only echoed: cancelling by the uid `add` returned reaches
    that request alone, even when another one carries the same client id."""
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=2)
    sched = Scheduler(decoder)
    first, second = {}, {}
    prompt, m = workload(24, 7)[0]
    a = sched.add(Request("same-id", [9] * 5, SamplingParams(max_tokens=40, ignore_eos=True), collect(first)))
    b = sched.add(Request("same-id", prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(second)))
    assert a != b
    sched.step()
    sched.cancel(a)
    sched.run_until_idle()
    assert first["same-id"]["reason"] == "abort" and first["same-id"]["final"] == 1
    assert second["same-id"]["reason"] == "length" and second["same-id"]["ids"] == references[0]


class SecondBest(ScriptedDrafter):
    """Each position's top candidate wrong (the target's token + 1), the target's token second: a
    tree's accepted path leaves the first-child chain, so its KV moves into place (decoder.py
    SpecDecoder._place_path)."""

    def propose_top(self, batch, k, width):
        wrong = self.propose(batch, k)  # [B, k] the target's tokens + 1
        ids = (wrong[..., None] - torch.arange(width)) % self.vocab  # [B, k, W]: truth + 1, truth, ..
        return ids, -torch.arange(width, dtype=torch.float32).expand(ids.shape)


@pytest.mark.parametrize("seed", [0, 2])  # both fail when a finished request skips the move
def test_a_finished_tree_request_leaves_its_path_in_the_prefix_cache(tiny, seed):
    """A tree request whose last step accepts an off-chain node on a block's last slot: the prefix
    cache takes that block after the step (runtime/blocks.py commit), so the node's KV must have
    moved there although the request finished; a request reusing the prefix decodes as the target."""
    ref = make_decoder(tiny, "llama", None, "none", 0, max_len=256)
    bs, m = ref.ex.kv.block_size, 5  # m odd: after the first token each step emits 2 (a node, the correction)
    rng = random.Random(seed)
    prompt = [rng.randrange(500) for _ in range(2 * bs - m + 1)]  # the request ends with cur = 2 * bs
    cont = generate(ref, prompt, greedy(m)).output
    follow = prompt + cont + [rng.randrange(500) for _ in range(3)]
    want = generate(ref, follow, greedy(12)).output
    vocab = ref.ex.target_model.lm_head.weight.shape[0]
    drafter = SecondBest({tuple(prompt): cont, tuple(follow): want}, vocab, lambda i, g: False)
    dec = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=2, proposer=drafter,
                       spec=SpecConfig("peagle", 3, tree_budget=6))
    sched, out = Scheduler(dec, prefill_chunk=64), {}
    sched.add(Request("a", prompt, greedy(m), collect(out)))
    sched.run_until_idle()
    sched.add(Request("b", follow, greedy(12), collect(out)))
    sched.run_until_idle()
    assert out["a"]["ids"] == cont and out["a"]["stats"].accepted == (m - 1) // 2  # one node per step
    assert out["b"]["ids"] == want
