"""Which KV blocks each request holds: block pools, block tables, prefix reuse.

The executors own the paged caches (peagle_trt/models/kv_cache.py); this module decides what goes where.
One `BlockPool` per KV group (group 0: full-attention layers and the drafter; one group per
sliding window). A request's `Sequence.blocks[g]` lists its blocks in position order (entry j
holds positions j*bs .. j*bs + bs - 1; -1: none).

  admit(seq)        prefix reuse, then blocks for its prefill tokens + one step's lookahead, or
                    False (it waits): nothing is allocated for a request that does not fit
  reserve(seq, ..)  before a forward: blocks up to the positions it writes (group 0: a verify's
                    K + 1 rows and the drafter's K - 1 more; windowed groups: the target's rows,
                    after returning the blocks that slid out of the window). False when group 0
                    ran dry (the scheduler preempts)
  commit(seq)       after a step: full blocks whose KV is final enter the prefix cache
  release(seq)      finish, cancel, failure, preemption: every block back (cached ones stay
                    reusable until evicted, least recently used first)
  listeners         callables told a `BlockEvent` as keys enter ("stored": with the parent key
                    and the block's tokens) and leave ("removed") the prefix cache: the block
                    events a KV-aware router consumes (peagle_trt/dynamo/events.py)

Rejected drafts need nothing: their rows sit in blocks the request keeps, and the next step
overwrites them. Prefix reuse (group 0 only, so off for models with windowed layers): a full
block is known by a hash chained over every token before it, its own tokens and, when a drafter
runs, the token after it (the drafter's row at position q pairs token q+1 with the target's
hidden at q: its KV depends on one more token). A new request whose prompt starts with cached
blocks takes them (reference counts) and prefills only the rest; at least one prompt token is
always recomputed (its logits give the first token). Invariants (tested after every step of a
fuzz in tests/runtime/test_blocks.py): a block is free, cached-unreferenced or referenced, never
two at once; references equal the tables that hold the block.
"""

from __future__ import annotations

import collections
import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from peagle_trt.config import KVLayout
from peagle_trt.errors import ConfigError, RuntimeInvariantError

log = logging.getLogger(__name__)
_NOTHING = (0, b"")  # no block of a sequence in the prefix cache yet


@dataclass(frozen=True)
class BlockEvent:
    """One change of the prefix cache (group 0), in the order it happened."""
    kind: str  # "stored" | "removed"
    key: bytes  # the block's chained prefix key
    parent: bytes = b""  # "stored": the previous block's key (b"": the first block of a sequence)
    tokens: tuple[int, ...] = ()  # "stored": the block's own block_size tokens


@dataclass
class BlockStats:
    """Cumulative counters of a `BlockManager` (metrics)."""
    preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found (not recomputed)
    evictions: int = 0


class BlockPool:
    """The blocks of one KV group: free ones, referenced ones (a count each) and, with prefix
    reuse, cached ones (content known by hash; unreferenced ones are evicted LRU when needed)."""

    def __init__(self, num_blocks: int, on_event=None):
        self.num_blocks = num_blocks
        self.on_event = on_event  # (kind, key, content): the prefix cache's changes
        self.free = collections.deque(range(num_blocks))  # no content worth keeping
        self.refs = [0] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced; LRU first
        self.evictions = 0

    @property
    def available(self) -> int:
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        return self.num_blocks - self.available

    def alloc(self) -> int:
        if self.free:
            block = self.free.popleft()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)  # least recently used cached block
            key = self.hash_of.pop(block)
            del self.by_hash[key]
            self.evictions += 1
            if self.on_event is not None:
                self.on_event("removed", key, None)
        else:
            raise RuntimeInvariantError("KV block pool exhausted (the caller checks `available` first)")
        self.refs[block] = 1
        return block

    def take(self, block: int) -> None:
        """One more reference to a cached block."""
        if self.refs[block] == 0:
            del self.idle[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeInvariantError(f"KV block {block} released more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.idle[block] = None  # most recently used end
            else:
                self.free.append(block)

    def remember(self, block: int, key: bytes, content=None) -> None:
        """Block `block` (referenced) now holds the final KV of the prefix `key`; `content`
        (parent key, tokens) only rides along to the event."""
        if key not in self.by_hash and block not in self.hash_of:
            self.by_hash[key] = block
            self.hash_of[block] = key
            if self.on_event is not None:
                self.on_event("stored", key, content)

    def check(self, held: collections.Counter) -> None:
        """Invariants against `held` (block -> tables holding it); raises RuntimeInvariantError."""
        free, idle = set(self.free), set(self.idle)
        problems = []
        if len(free) != len(self.free) or free & idle:
            problems.append("a block is listed twice among the free and cached ones")
        for block in range(self.num_blocks):
            if self.refs[block] != held.get(block, 0):
                problems.append(f"block {block}: {self.refs[block]} references, held by {held.get(block, 0)} tables")
            if (self.refs[block] > 0) == (block in free or block in idle):
                problems.append(f"block {block} is both referenced and free, or neither")
            if block in idle and block not in self.hash_of:
                problems.append(f"block {block} is cached without a hash")
        if {b: k for k, b in self.by_hash.items()} != self.hash_of:
            problems.append("the hash maps disagree")
        if problems:
            raise RuntimeInvariantError("KV block pool: " + "; ".join(problems[:5]))


class BlockManager:
    """Block tables of every running request over one pool per KV group (see the module doc).
    `lookahead`: positions one decode step writes past `cur` (2K: a verify's K + 1 rows, then
    the drafter's K - 1 mask rows after up to K + 1 accepted; 1 without drafts); `drafter`:
    whether a drafter's KV is cached too (prefix keys then cover the next token)."""

    def __init__(self, kv: KVLayout, windows: tuple[int, ...], lookahead: int, drafter: bool,
                 prefix_caching: bool = True):
        if kv.num_blocks < kv.max_blocks:
            raise ConfigError(f"the KV cache has {kv.num_blocks} blocks of {kv.block_size} positions, fewer than "
                              f"one request of the maximum length needs ({kv.max_blocks}, {kv.max_len} positions); "
                              "raise the block count (--kv-blocks) or lower the maximum sequence length")
        self.kv, self.windows, self.lookahead, self.drafter = kv, windows, lookahead, drafter
        # prefix-cache events of group 0 (a block's key entered or left the cache), in order: what a
        # KV-aware router (Dynamo's BlockStored / BlockRemoved) consumes; add a callable to listen.
        # They run on the stepping thread: keep them short (hand off to another thread).
        self.listeners: list = []
        self.pools = [BlockPool(n, self._event if g == 0 else None) for g, n in enumerate(kv.group_blocks(windows))]
        self.prefix_caching = prefix_caching and len(windows) == 1
        if prefix_caching and not self.prefix_caching:
            log.warning("prefix reuse is off: this target has sliding-window layers (windows %s), whose blocks "
                        "slide out; every prompt is prefilled in full", list(windows[1:]))
        self.stats = BlockStats()
        self._committed: dict = {}  # seq -> (blocks entered into the prefix cache, the last one's key)

    def _event(self, kind: str, key: bytes, content) -> None:
        if not self.listeners:
            return
        parent, tokens = content if content is not None else (b"", ())
        event = BlockEvent(kind, key, parent, tokens)
        for listener in self.listeners:
            listener(event)

    # -- sizes -------------------------------------------------------------------------------
    def _entries(self, upto: int) -> int:
        """Table entries covering positions 0 .. upto-1 (capped at the table's length)."""
        n = -(-upto // self.kv.block_size)
        return n if n < self.kv.max_blocks else self.kv.max_blocks

    @property
    def num_blocks(self) -> int:
        return self.pools[0].num_blocks

    @property
    def free_blocks(self) -> int:
        return self.pools[0].available

    @property
    def used_blocks(self) -> int:
        return self.pools[0].used

    def blocks_for(self, positions: int) -> int:
        """Group-0 blocks a request of `positions` positions (plus one step's lookahead) needs."""
        return self._entries(positions + self.lookahead)

    # -- prefix keys ---------------------------------------------------------------------------
    def _keys(self, tokens: list[int], start: int, stop: int, parent: bytes = b"") -> list[bytes]:
        """Chained keys of blocks start .. stop-1 of `tokens` (`parent`: block start-1's key); each
        covers the next token too when a drafter's KV is cached (`tokens` must reach it)."""
        bs, extra = self.kv.block_size, int(self.drafter)
        keys = []
        for i in range(start, stop):
            chunk = np.asarray(tokens[i * bs:(i + 1) * bs + extra], dtype=np.int64).tobytes()
            parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
            keys.append(parent)
        return keys

    # -- the lifecycle -------------------------------------------------------------------------
    def admit(self, seq) -> bool:
        """Reuse `seq`'s cached prefix, then allocate its prefill tokens + one step; False (and
        nothing held) when the pool cannot take it now."""
        tokens = seq.prompt + seq.output  # a preempted request resumes from every token it has
        seq.blocks = [[] for _ in self.pools]
        reused: list[int] = []
        if self.prefix_caching:
            # at least one token is recomputed: reusable blocks end before the last prefill token
            # (and the token after each block, part of its key, is then known)
            pool = self.pools[0]
            for key in self._keys(tokens, 0, (seq.prefill_len - 1) // self.kv.block_size):
                block = pool.by_hash.get(key)
                if block is None:
                    break
                reused.append(block)
        need = self.blocks_for(seq.prefill_len) - len(reused)
        idle_reused = sum(1 for b in reused if self.pools[0].refs[b] == 0)
        if need > self.pools[0].available - idle_reused:
            return False
        for b in reused:
            self.pools[0].take(b)
        seq.blocks[0] = reused
        seq.num_computed = seq.cur = len(reused) * self.kv.block_size
        if self.prefix_caching:
            self.stats.prefix_queried_tokens += seq.prefill_len
            self.stats.prefix_hit_tokens += seq.num_computed
        ok = self.reserve(seq, seq.num_computed, seq.num_computed, seq.prefill_len + self.lookahead)
        if not ok:  # cannot happen after the check above; keep the pool exact anyway
            self.release(seq)
        return ok

    def reserve(self, seq, low: int, target_upto: int, upto: int) -> bool:
        """Blocks for the next forward, whose target rows sit at `low` .. target_upto-1: group 0
        (full layers and the drafter) up to `upto`; a windowed group of window W first returns
        the blocks wholly before low - W + 1 (the oldest key a row at `low` sees), then takes
        blocks up to `target_upto` (so it holds at most KVLayout.window_blocks per request).
        False when group 0 has too few free blocks (nothing allocated then)."""
        bs, n = self.kv.block_size, self._entries(upto)
        missing = n - len(seq.blocks[0])
        if missing <= 0 and len(self.pools) == 1:  # the common step: its blocks are already held
            return True
        if missing > self.pools[0].available:
            return False
        for g, (pool, window) in enumerate(zip(self.pools, self.windows)):
            table = seq.blocks[g]
            if window:
                for j in range(min(max(low - window + 1, 0) // bs, len(table))):
                    if table[j] >= 0:
                        pool.release(table[j])
                        table[j] = -1
            while len(table) < (self._entries(target_upto) if window else n):
                table.append(pool.alloc())
        return True

    def commit(self, seq) -> None:
        """Enter `seq`'s full blocks whose KV is final into the prefix cache: block i is once
        positions < seq.cur are final in both caches ((i+1) * bs <= cur; the drafter's row at
        cur - 1 pairs the committed token at cur)."""
        if not self.prefix_caching or not seq.blocks:
            return
        done, parent = self._committed.get(seq, _NOTHING)
        full = seq.cur // self.kv.block_size
        if full <= done:
            return
        full = min(full, len(seq.blocks[0]))
        tokens, bs = seq.prompt + seq.output, self.kv.block_size
        keys = self._keys(tokens, done, full, parent)
        for i, (block, key) in enumerate(zip(seq.blocks[0][done:full], keys), start=done):
            self.pools[0].remember(block, key, (parent, tuple(tokens[i * bs:(i + 1) * bs])))
            parent = key
        self._committed[seq] = (full, keys[-1])

    def release(self, seq) -> None:
        for pool, table in zip(self.pools, seq.blocks):
            for block in table:
                if block >= 0:
                    pool.release(block)
        seq.blocks = []
        self._committed.pop(seq, None)

    def check(self, seqs) -> None:
        """The pools' invariants against the tables of `seqs` (every request holding blocks)."""
        for g, pool in enumerate(self.pools):
            held = collections.Counter(b for s in seqs if s.blocks for b in s.blocks[g] if b >= 0)
            pool.check(held)

    def metrics(self) -> dict:
        s = self.stats
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_used": self.used_blocks,
                "kv_blocks_free": self.free_blocks, "kv_block_size": self.kv.block_size,
                "kv_preemptions": s.preemptions, "prefix_caching": self.prefix_caching,
                "prefix_queried_tokens": s.prefix_queried_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
                "kv_evictions": sum(p.evictions for p in self.pools)}
