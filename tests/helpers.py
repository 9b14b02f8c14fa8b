"""Test helpers: build decoders from the tiny checkpoints, structural drafters, a Markov target."""

from __future__ import annotations

import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import KVLayout, SamplingParams, SpecConfig
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder

PAIRS = {"llama": "aws", "qwen3": "speculators"}  # target -> its P-EAGLE drafter
# prefill chunks of a 45-token prompt that start and end inside and across a sliding window of 8
CHUNKS_ACROSS_WINDOW = ((0, 11), (11, 12), (12, 20), (20, 21), (21, 33), (33, 45))


def our_target(path, taps):
    """Our TargetModel (fp32) for the checkpoint at `path`, tapping `taps`."""
    from peagle_trt.checkpoint.target import load_target
    from peagle_trt.models.target import TargetModel

    ckpt = load_target(path)
    return TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)


def hf_target(path):
    """transformers' own model for the checkpoint at `path` (fp32, eval): the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def chunked_forward(model, ids: torch.Tensor, cache, chunks=CHUNKS_ACROSS_WINDOW):
    """ids [1, T] run chunk by chunk through `model`'s KV cache (sequence 0) -> (logits, aux) of all rows."""
    outs, taps = zip(*[model(ids[:, a:b], torch.arange(a, b)[None], torch.tensor([0]), cache) for a, b in chunks])
    return torch.cat(outs, 1), torch.cat(taps, 1)


def make_decoder(tiny, target: str, drafter: str | None, mode: str, k: int, max_len: int = 512,
                 proposer=None, slots: int = 1, kv: KVLayout | None = None, spec: SpecConfig | None = None,
                 deterministic: bool = True) -> SpecDecoder:
    """A decoder over the torch executor; KV room for `slots` requests of `max_len`, or `kv`;
    `spec` (else SpecConfig(mode, k)) for a K schedule, adaptive K or synthetic acceptance.
    Deterministic by default: the tests that compare outputs token for token (speculative with
    target-only, batched with alone) are then exact by construction on any CPU, idle or loaded."""
    spec = spec or SpecConfig(mode, k)
    pair = load_pair(tiny[target], tiny[drafter] if drafter else None, spec)
    t, d = pair.build()
    return SpecDecoder(TorchExecutor(t, d, kv or slots, max_len, deterministic=deterministic), spec, proposer=proposer)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


class CountingExecutor:
    """Wraps an executor and counts the forwards it runs."""

    def __init__(self, inner):
        self.inner, self.target_calls, self.drafter_calls = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, *args, **kwargs):
        self.target_calls += 1
        return self.inner.target(*args, **kwargs)

    def drafter(self, *args, **kwargs):
        self.drafter_calls += 1
        return self.inner.drafter(*args, **kwargs)

    def draft_parallel(self, *args, **kwargs):  # one drafter forward (assembly + pass + sample)
        self.drafter_calls += 1
        return self.inner.draft_parallel(*args, **kwargs)


class ScriptedDrafter:
    """A structural drafter that knows the target's greedy continuation of each prompt.

    `correct(i, rng)` decides whether the draft at depth i is the target's own token (oracle:
    always; always-wrong: never; Bernoulli(alpha): with probability alpha)."""

    def __init__(self, references: dict[tuple, list[int]], vocab: int, correct, seed: int = 0):
        self.refs, self.vocab, self.correct = references, vocab, correct
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, batch, k):
        out = []
        for s in batch.seqs:
            ref, at = self.refs[tuple(s.prompt)], len(s.output)
            drafts = []
            for i in range(k):
                truth = ref[at + i] if at + i < len(ref) else 0
                drafts.append(truth if self.correct(i, self.rng) else (truth + 1) % self.vocab)
            s.stats.drafter_forwards += 1
            out.append(drafts)
        return torch.tensor(out, dtype=torch.long).reshape(len(out), k)

    def propose_top(self, batch, k, width):
        """Its drafts as each position's best candidate, then the ids after them (log-probs falling):
        a grammar then drafts the first of them it allows."""
        drafts = self.propose(batch, k)  # [B, k]
        ids = (drafts[..., None] + torch.arange(width)) % self.vocab  # [B, k, W]
        return ids, -torch.arange(width, dtype=torch.float32).expand(ids.shape)


def reference_outputs(decoder_none: SpecDecoder, prompts: list[list[int]], n: int) -> dict:
    return {tuple(p): generate(decoder_none, p, greedy(n)).output for p in prompts}


class MarkovExecutor:
    """A target whose next-token distribution depends only on the current token:
    p(next | token) = T[token]. No drafter; aux is empty. For exact distribution tests."""

    def __init__(self, transition: torch.Tensor, max_len: int = 64):
        self.logT = transition.log()
        self.device, self.kv, self.windows = torch.device("cpu"), KVLayout.for_sequences(1, max_len), (0,)
        self.mask_token_id = self.h_mask = None

    def target(self, tokens, positions, tables, logit_rows=None, tree_mask=None):
        logits = self.logT[tokens]  # [B, S, V] (each row's own token: trees need no mask)
        if logit_rows is not None:
            logits = torch.gather(logits, 1, logit_rows[..., None].expand(-1, -1, logits.shape[-1]))
        return logits, torch.zeros(*tokens.shape, 0)

    def move_kv(self, tables, src, dst):  # no KV
        pass


def collect(outputs: dict):
    """A scheduler `on_output` that gathers each request's ids, final count, reason, stats, error."""
    def on_output(out):
        entry = outputs.setdefault(out.request_id, {"ids": [], "final": 0})
        entry["ids"] += out.new_token_ids
        if out.finished:
            entry["final"] += 1
            entry["reason"], entry["stats"], entry["error"] = out.finish_reason, out.stats, out.error
    return on_output


def static_tables(ex, seqs: list[int]) -> torch.Tensor:
    """Block tables [G, B, M] for executor `ex` giving request b the blocks seqs[b] * M .. + M - 1
    (the static layout of peagle_trt/models/kv_cache.py: sequence indices as slots); a windowed group, sized
    for its window, gives each of `max_batch` requests its share of blocks, then -1 (positions
    there must stay within that share)."""
    m, groups = ex.kv.max_blocks, ex.kv.group_blocks(ex.windows)
    out = torch.full((len(groups), len(seqs), m), -1)
    for g, n in enumerate(groups):
        share = min(m, n // ex.kv.max_batch)
        for b, seq in enumerate(seqs):
            out[g, b, :share] = seq * share + torch.arange(share)
    return out


def new_sequence(decoder, prompt: list[int], params: SamplingParams, index: int = 0):
    """A sequence driven by hand (no scheduler), holding the static layout's blocks of `index`."""
    seq = decoder.new_sequence(prompt, params)
    seq.blocks = static_tables(decoder.ex, [index])[:, 0].tolist()
    return seq


@torch.no_grad()
def paged_forward(model, ids: torch.Tensor, chunks=CHUNKS_ACROSS_WINDOW, block_size: int = 4, max_len: int = 64):
    """ids [1, T] chunk by chunk through a paged cache whose blocks the runtime's BlockManager
    hands out (windowed groups give back what slid out of their window) -> (logits, aux, cache,
    block tables per group at the end)."""
    from types import SimpleNamespace

    from peagle_trt.runtime.blocks import BlockManager

    rows = max(b - a for a, b in chunks)
    kv = KVLayout(-(-max_len // block_size), max_len, 1, block_size, rows)
    cache = model.new_cache(kv)
    manager = BlockManager(kv, model.kv_windows, lookahead=1, drafter=False, prefix_caching=False)
    seq = SimpleNamespace(blocks=[[] for _ in model.kv_windows])
    outs, taps = [], []
    for a, b in chunks:
        assert manager.reserve(seq, a, b, b)
        tables = torch.full((len(seq.blocks), 1, kv.max_blocks), -1)
        for g, blocks in enumerate(seq.blocks):
            tables[g, 0, :len(blocks)] = torch.tensor(blocks)
        logits, aux = model(ids[:, a:b], torch.arange(a, b)[None], tables, cache)
        outs.append(logits)
        taps.append(aux)
    return torch.cat(outs, 1), torch.cat(taps, 1), cache, seq.blocks
