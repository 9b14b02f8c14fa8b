"""Training data for drafter heads: token sequences, the draft vocabulary, the target's features.

Sources:
  JSONL prompts  {"prompt": ...} (or "text"/"messages"); the target REGENERATES the response
                 (greedy, or sampled at a temperature), batched through the serving scheduler,
                 and only response tokens are supervised (as in the P-EAGLE paper, original responses
                 are discarded).
  plain text     files (or a file listing files); tokenized, joined with EOS, cut into windows;
                 every position supervised.
The draft vocabulary is the `draft_vocab` most frequent tokens of the training sequences (ties
by id), sorted by id: d2t[i] = draft_ids[i] - i (offsets, target_id = draft_id + d2t[draft_id]),
t2d = membership mask over the target vocabulary.
Target features come from our reference target (`peagle_trt.models.target.TargetModel`): its
tap hidden states and its next-token distribution restricted to the draft vocabulary.
Tests: tests/train/test_train_run.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.errors import ConfigError
from peagle_trt.train.forward import SeqFeatures


@dataclass(frozen=True)
class Corpus:
    """Token sequences and their supervision masks (mask[j]: token j may be a training target)."""
    sequences: list  # list[torch.Tensor [T_i] int64]
    masks: list  # list[torch.Tensor [T_i] bool]
    windowed: bool  # plain text: sample windows of one long stream


def read_text_files(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        if not p.is_file():
            raise ConfigError(f"training text file {p} does not exist; pass existing files with --text "
                              "or a listing with --text-list")
        texts.append(p.read_text(encoding="utf-8", errors="replace"))
    return texts


def text_corpus(tokenizer, paths: list[Path], eos_id: int) -> Corpus:
    ids: list[int] = []
    for text in read_text_files(paths):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
    stream = torch.tensor(ids, dtype=torch.long)
    return Corpus([stream], [torch.ones_like(stream, dtype=torch.bool)], windowed=True)


def read_prompts(path: Path) -> list:
    if not path.is_file():
        raise ConfigError(f"--data {path} does not exist; pass a JSONL file of prompts")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg}); one object per line") from exc
        prompt = row.get("prompt") or row.get("text") or row.get("messages") if isinstance(row, dict) else None
        if not prompt:
            raise ConfigError(f"{path}:{n}: expected an object with a 'prompt', 'text' or 'messages' key, "
                              f"got {str(row)[:80]!r}")
        prompts.append(prompt)
    if not prompts:
        raise ConfigError(f"{path}: no prompts found")
    return prompts


@torch.no_grad()
def regenerate_all(target, prompts: list[list[int]], max_tokens: int, temperature: float, eos_ids: tuple,
                   seed: int, batch: int = 16, progress=None) -> list[list[int]]:
    """The target's own responses to `prompts` (greedy, or sampled at `temperature` with seed
    seed + i for prompt i), `batch` at a time through the serving scheduler (target only,
    train/distill.py `answer_all`): the same in-flight batched decode the server runs."""
    from peagle_trt.config import SamplingParams
    from peagle_trt.executors.torch import TorchExecutor
    from peagle_trt.train.distill import answer_all

    max_len = max(len(p) for p in prompts) + max_tokens + 2
    responses: list[list[int]] = [[] for _ in prompts]

    def on_done(i: int, response: list[int], reason: str) -> None:
        responses[i] = response

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
              for i in range(len(prompts))]
    answer_all(TorchExecutor(target, None, batch, max_len), prompts, params, eos_ids, batch, on_done,
               progress=(lambda n: progress(f"regenerated {n}/{len(prompts)} responses")) if progress else None)
    return responses


def prompt_corpus(target, codec, path: Path, max_tokens: int, temperature: float, seed: int,
                  chat_template: bool, progress) -> Corpus:
    prompts = []
    for prompt in read_prompts(path):
        text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
        prompts.append(codec.encode_prompt(text, chat_template))
    responses = regenerate_all(target, prompts, max_tokens, temperature, codec.eos_ids, seed, progress=progress)
    seqs = [torch.tensor(ids + resp, dtype=torch.long) for ids, resp in zip(prompts, responses)]
    masks = [torch.tensor([False] * len(ids) + [True] * len(resp)) for ids, resp in zip(prompts, responses)]
    return Corpus(seqs, masks, windowed=False)


def draft_vocabulary(corpus: Corpus, vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """The `draft_vocab` most frequent supervised token ids, sorted by id: draft_ids [V_d]."""
    if not 0 < draft_vocab <= vocab_size:
        raise ConfigError(f"--draft-vocab {draft_vocab} must be in [1, {vocab_size}] (the target vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq, mask in zip(corpus.sequences, corpus.masks):
        counts += torch.bincount(seq[mask], minlength=vocab_size).double()
    order = torch.sort(-counts, stable=True).indices[:draft_vocab]  # ties: lower id first
    return order.sort().values


def sample_batch(corpus: Corpus, batch: int, seq_len: int, generator: torch.Generator) -> list:
    """`batch` (ids [T], supervised [T]) pairs: random windows of the stream, or whole sequences."""
    if corpus.windowed:
        stream = corpus.sequences[0]
        if len(stream) <= seq_len:
            raise ConfigError(f"the training text has {len(stream)} tokens, fewer than --seq-len {seq_len}")
        starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator).tolist()
        return [(stream[s:s + seq_len], corpus.masks[0][s:s + seq_len]) for s in starts]
    picks = torch.randint(0, len(corpus.sequences), (batch,), generator=generator).tolist()
    return [(corpus.sequences[i][:seq_len], corpus.masks[i][:seq_len]) for i in picks]


@torch.no_grad()
def target_features(target, ids: torch.Tensor, supervised: torch.Tensor, draft_ids: torch.Tensor,
                    chunk: int = 512) -> SeqFeatures:
    """ids, supervised [T] -> the drafter's view of the sequence (N = T - 1 positions). The target
    runs over the sequence in chunks of `chunk` tokens through its KV cache (bounded memory on
    long sequences); only draft-vocabulary probabilities are kept."""
    dev = target.lm_head.weight.device
    t = ids.numel()
    cache = target.new_cache(1, t)
    slots = torch.zeros(1, dtype=torch.long, device=dev)
    probs, aux = [], []
    for a in range(0, t, chunk):
        b = min(t, a + chunk)
        logits, taps = target(ids[None, a:b].to(dev), torch.arange(a, b, device=dev)[None], slots, cache)
        probs.append(torch.softmax(logits[0, :, draft_ids.to(dev)].float(), dim=-1))  # [C, V_d]
        aux.append(taps[0].float())  # [C, A]
    probs, aux = torch.cat(probs)[1:], torch.cat(aux)[:-1]  # EAGLE shift: [N, V_d], [N, A]
    nxt = torch.arange(2, t + 1).clamp(max=t - 1)  # position i is supervised iff token i+2 is
    return SeqFeatures(ids[1:].to(dev), aux, probs, supervised[nxt].to(dev))
