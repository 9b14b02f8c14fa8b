"""The translation of the paged cache's prefix events into Dynamo KV events (events.py), checked
on a real scheduler's events: the chain (parent ids) and the tokens a router hashes."""

from __future__ import annotations

from peagle_trt.config import KVLayout, SamplingParams
from peagle_trt.dynamo.events import KvEventRelay, block_id, to_call
from peagle_trt.runtime.scheduler import Request, Scheduler
from tests.helpers import collect, make_decoder


class Recorder:
    def __init__(self):
        self.calls = []

    def publish_stored(self, **kw):
        self.calls.append(("stored", kw))

    def publish_removed(self, **kw):
        self.calls.append(("removed", kw))


def test_stored_blocks_chain_by_parent_and_carry_their_tokens(tiny):
    kv = KVLayout(num_blocks=14, max_len=96, max_batch=2, block_size=8, max_rows=16)
    sched = Scheduler(make_decoder(tiny, "llama", "aws", "peagle", 3, kv=kv), prefill_chunk=16)
    relay, recorder = KvEventRelay(8), Recorder()
    sched.blocks.listeners.append(relay.push)
    prompt, outputs = list(range(100, 140)), {}
    sched.add(Request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True), collect(outputs)))
    sched.run_until_idle()
    relay.attach(recorder)
    relay.close()
    stored = [kw for kind, kw in recorder.calls if kind == "stored"]
    assert len(stored) >= 4 and relay.published == len(recorder.calls)
    assert stored[0]["parent_hash"] is None and stored[0]["token_ids"] == prompt[:8]
    for i in range(1, 4):  # block i: tokens i*8 .. i*8+7, parent = block i-1
        assert stored[i]["token_ids"] == prompt[i * 8:(i + 1) * 8] and stored[i]["num_block_tokens"] == [8]
        assert stored[i]["parent_hash"] == stored[i - 1]["block_hashes"][0]
    ids = [kw["block_hashes"][0] for kw in stored]
    assert len(set(ids)) == len(ids) and all(-2**63 <= i < 2**63 for i in ids)


def test_removed_event_names_the_block_by_the_same_id():
    from peagle_trt.runtime.blocks import BlockEvent

    key = bytes(range(16))
    method, kw = to_call(BlockEvent("removed", key))
    assert method == "publish_removed" and kw == {"block_hashes": [block_id(key)]}
    assert to_call(BlockEvent("stored", key, b"", (1, 2)))[1]["block_hashes"] == [block_id(key)]
