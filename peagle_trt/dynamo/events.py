"""The paged cache's prefix events as Dynamo KV events, for the KV-aware router.

The scheduler's BlockManager reports every block that enters or leaves its prefix cache
(`peagle_trt.runtime.blocks.BlockEvent`: a chained 16-byte blake2b key, the parent's key, the
block's tokens). Dynamo's router keeps, per worker, a radix tree of the blocks it holds: it hashes
each stored block's TOKENS itself (the same hash it applies to an incoming prompt, block by block),
and knows blocks by the worker's own 64-bit ids for the chain (parent) and for removals. So:
  stored   publish_stored(token_ids, [block_size], [id(key)], parent_hash=id(parent) or None)
  removed  publish_removed([id(key)])
with id(key) = the key's first 8 bytes as a signed 64-bit integer.
The listener runs on the stepping thread: it only queues; a relay thread publishes (Dynamo's
`PushSource` contract), so a slow event plane never stalls a step. Events that arrive before the
publisher is attached wait in the queue, in order.
Our keys also cover the token after each block (the drafter's KV pairs it); the router's do not,
so the last shared block of two prompts that diverge right after it can look cached and is not:
the request then prefills one block more than the router counted, and stays correct.
Tested by tests/dynamo/test_dynamo.py (routing) and tests/dynamo/test_events.py (the translation).
"""

from __future__ import annotations

import logging
import queue
import threading

from peagle_trt.runtime.blocks import BlockEvent

log = logging.getLogger(__name__)


def block_id(key: bytes) -> int:
    """A prefix key as the signed 64-bit block hash Dynamo's events carry."""
    return int.from_bytes(key[:8], "little", signed=True)


def to_call(event: BlockEvent) -> tuple[str, dict]:
    """(publisher method, keyword arguments) of one block event."""
    if event.kind == "stored":
        return "publish_stored", {"token_ids": list(event.tokens), "num_block_tokens": [len(event.tokens)],
                                  "block_hashes": [block_id(event.key)],
                                  "parent_hash": block_id(event.parent) if event.parent else None}
    return "publish_removed", {"block_hashes": [block_id(event.key)]}


class KvEventRelay:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.published = 0
        self._thread: threading.Thread | None = None

    def push(self, event: BlockEvent) -> None:
        """BlockManager listener (the stepping thread): queue only."""
        self.queue.put(event)

    def attach(self, publisher) -> None:
        """Dynamo's PushSource.on_ready: start publishing through `publisher` (a KvEventPublisher)."""
        self._thread = threading.Thread(target=self._run, args=(publisher,), name="peagle-kv-events", daemon=True)
        self._thread.start()

    def _run(self, publisher) -> None:
        while True:
            event = self.queue.get()
            if event is None:
                return
            method, kwargs = to_call(event)
            try:
                getattr(publisher, method)(**kwargs)
                self.published += 1
            except Exception:  # the router then under-counts this worker's cache; serving goes on
                log.exception("KV event %s dropped", method)

    def close(self) -> None:
        self.queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=5.0)
