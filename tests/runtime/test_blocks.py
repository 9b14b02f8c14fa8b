"""The paged KV cache under the scheduler: block pressure with preemption, prefix reuse, windows,
cancellation, and a fuzz of arrivals and cancels checking the pools' invariants after every step.
Every output is token-identical to one-at-a-time greedy decoding (peagle_trt/runtime/blocks.py)."""

from __future__ import annotations

import random

import pytest

from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.runtime.blocks import BlockManager, BlockPool
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from tests.helpers import collect, make_decoder

SMALL = KVLayout(num_blocks=16, max_len=96, max_batch=6, block_size=8, max_rows=16)  # 128 positions in all


def workload(n: int, seed: int, shared: list[int] | None = None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(500) for _ in range(rng.randint(1, 40))]
        if shared and rng.random() < 0.5:
            prompt = shared + prompt[:8]
        out.append((prompt, rng.randint(1, 40)))
    return out


def references(decoder, load):
    return [generate(decoder, p, SamplingParams(max_tokens=m, ignore_eos=True)).output for p, m in load]


def held(sched: Scheduler) -> list:
    return [r.seq for r in sched.running]


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_block_pressure_preempts_and_every_output_stays_identical(tiny, mode):
    load = workload(16, 3)
    refs = references(make_decoder(tiny, "llama", "aws", mode, 3, max_len=256), load)
    sched = Scheduler(make_decoder(tiny, "llama", "aws", mode, 3, kv=SMALL), prefill_chunk=16)
    outputs: dict = {}
    for i, (prompt, m) in enumerate(load):
        sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(outputs)))
    while sched.has_work:
        sched.step()
        sched.blocks.check(held(sched))
        assert sched.blocks.used_blocks <= SMALL.num_blocks
    for i, ref in enumerate(refs):
        assert outputs[str(i)]["ids"] == ref and outputs[str(i)]["final"] == 1, i
    assert sched.blocks.stats.preemptions > 0  # 16 requests of up to 80 positions in 128
    assert sched.blocks.used_blocks == 0


def test_prefix_reuse_hits_and_outputs_equal_recomputation(tiny):
    system = list(range(100, 140))  # a 40-token shared prefix: 4 full blocks of 8 (with the next token)
    load = [(system + [7, 8, 9], 12), (system + [7, 8, 9], 12), (system + [1, 2], 12), ([5] * 30, 12)]
    refs = references(make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256), load)
    kv = KVLayout(num_blocks=64, max_len=96, max_batch=4, block_size=8, max_rows=16)
    for reuse in (True, False):
        sched = Scheduler(make_decoder(tiny, "llama", "aws", "peagle", 3, kv=kv), prefill_chunk=16,
                          prefix_caching=reuse)
        outputs: dict = {}
        for i, (prompt, m) in enumerate(load):  # one after the other: each finds the previous ones' blocks
            sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(outputs)))
            sched.run_until_idle()
            sched.blocks.check(held(sched))
        assert [outputs[str(i)]["ids"] for i in range(4)] == refs
        stats = sched.blocks.metrics()
        # request 1 reuses 5 blocks (40 positions: at least its last prompt token is recomputed);
        # request 2 only 4: a block's key covers the token after it (the drafter's row at the block's
        # last position pairs that token), and position 40 holds 1, not 7
        if reuse:
            assert stats["prefix_hit_tokens"] == 40 + 32 and stats["prefix_queried_tokens"] == 43 + 43 + 42 + 30
        else:
            assert stats["prefix_hit_tokens"] == 0 and not stats["prefix_caching"]


def test_prefix_cache_events_mirror_the_cache(tiny):
    """Every key stored is announced once, every eviction too: replaying the events gives the
    cache's keys (what a KV-aware router keeps per worker)."""
    kv = KVLayout(num_blocks=14, max_len=96, max_batch=2, block_size=8, max_rows=16)
    sched = Scheduler(make_decoder(tiny, "llama", "aws", "peagle", 3, kv=kv), prefill_chunk=16)
    events: list = []
    sched.blocks.listeners.append(events.append)
    outputs: dict = {}
    for i, (prompt, m) in enumerate(workload(8, 21, list(range(300, 330)))):
        sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(outputs)))
    sched.run_until_idle()
    live: dict = {}
    for e in events:
        assert (e.key in live) == (e.kind == "removed")
        if e.kind == "stored":  # the content a router hashes: the block's tokens, chained by parent keys
            assert len(e.tokens) == 8 and (e.parent == b"" or e.parent in live)
            live[e.key] = e.tokens
        else:
            del live[e.key]
    assert set(live) == set(sched.blocks.pools[0].by_hash) and any(e.kind == "removed" for e in events)


@pytest.mark.parametrize("tree", [None, SpecConfig("peagle", 3, tree_budget=7)])  # chains; draft trees
def test_fuzz_arrivals_and_cancels_keep_the_pool_exact(tiny, tree):
    shared = list(range(200, 224))
    load = workload(30, 5, shared)
    refs = references(make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256), load)
    sched = Scheduler(make_decoder(tiny, "llama", "aws", "peagle", 3, kv=SMALL, spec=tree), prefill_chunk=8)
    outputs: dict = {}
    rng = random.Random(11)
    pending, uids, cancelled = list(enumerate(load)), {}, set()
    while pending or sched.has_work:
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (prompt, m) = pending.pop(0)
                uids[i] = sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True),
                                            collect(outputs)))
        if uids and rng.random() < 0.15:
            i = rng.choice(sorted(uids))
            sched.cancel(uids[i])
            cancelled.add(i)
        sched.step()
        sched.blocks.check(held(sched))
    for i, ref in enumerate(refs):
        out = outputs[str(i)]
        assert out["final"] == 1
        if out["reason"] == "abort":
            assert i in cancelled and ref[:len(out["ids"])] == out["ids"]
        else:
            assert out["ids"] == ref, i
    assert sched.blocks.used_blocks == 0 and sched.blocks.stats.preemptions > 0
    assert sched.blocks.stats.prefix_hit_tokens > 0


def test_windowed_layers_give_back_blocks_and_stay_identical(tiny_moe):
    """GPT-OSS (window 8 on half the layers): its windowed group holds a few blocks per request."""
    load = workload(6, 9)
    refs = references(make_decoder(tiny_moe, "gpt_oss", "drafter-gpt_oss", "peagle", 3, max_len=256), load)
    kv = KVLayout(num_blocks=40, max_len=96, max_batch=3, block_size=4, max_rows=8)
    sched = Scheduler(make_decoder(tiny_moe, "gpt_oss", "drafter-gpt_oss", "peagle", 3, kv=kv), prefill_chunk=8)
    assert sched.decoder.ex.windows == (0, 8) and not sched.blocks.prefix_caching
    outputs: dict = {}
    for i, (prompt, m) in enumerate(load):
        sched.add(Request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), collect(outputs)))
    most = 0
    while sched.has_work:
        sched.step()
        sched.blocks.check(held(sched))
        most = max([most] + [sum(b >= 0 for b in s.blocks[1]) for s in held(sched)])
    assert [outputs[str(i)]["ids"] for i in range(6)] == refs
    assert most <= -(-(8 + 8) // 4) + 1  # window + one forward's rows, block-aligned
    assert sched.blocks.pools[1].num_blocks == 3 * 5  # 3 requests x 5 blocks


def test_cancel_and_finish_free_every_block(tiny):
    sched = Scheduler(make_decoder(tiny, "llama", "aws", "peagle", 3, kv=SMALL), prefix_caching=False)
    outputs: dict = {}
    uid = sched.add(Request("a", list(range(30)), SamplingParams(max_tokens=40, ignore_eos=True), collect(outputs)))
    sched.step()
    assert sched.blocks.used_blocks >= 4
    sched.cancel(uid)
    sched.step()
    assert outputs["a"]["reason"] == "abort" and sched.blocks.used_blocks == 0
    sched.blocks.check([])


def test_pool_refuses_double_release_and_reports_leaks():
    pool = BlockPool(4)
    b = pool.alloc()
    pool.release(b)
    with pytest.raises(Exception, match="released more often"):
        pool.release(b)
    c = pool.alloc()
    with pytest.raises(Exception, match="references, held by 0"):
        pool.check({})  # block c is referenced but no table holds it: a leak
    assert c in range(4)


def test_a_cache_smaller_than_one_request_is_refused():
    with pytest.raises(ConfigError, match="fewer than one request"):
        BlockManager(KVLayout(num_blocks=4, max_len=96, block_size=8), (0,), 6, drafter=True)
