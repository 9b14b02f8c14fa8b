"""Training data for drafter heads: token sequences, the draft vocabulary, the target's features.

Sources:
  JSONL prompts  {"prompt": ...} (or "text"/"messages"; a .jsonl.gz file is read the same);
                 the target REGENERATES the response
                 (greedy, or sampled at a temperature), batched through the serving scheduler,
                 and only response tokens are supervised (as in the P-EAGLE paper, original responses
                 are discarded).
  plain text     files (or a file listing files); tokenized, joined with EOS, cut into windows;
                 every position supervised. Beside JSONL data the text is extra training data,
                 teacher-forced (the target's distributions over it: one prefill, no generation),
                 cut into pieces of TEXT_PIECE tokens (`joined`); only JSONL sequences are held out.
The draft vocabulary is the `draft_vocab` most frequent tokens of the training responses (ties
by prompt frequency, then id), sorted by id: d2t[i] = draft_ids[i] - i (offsets, target_id =
draft_id + d2t[draft_id]), t2d = membership mask over the target vocabulary.
Target features come from our reference target (`peagle_trt.models.target.TargetModel`): its
tap hidden states and its next-token distribution restricted to the draft vocabulary; kept per
sequence (`FeatureCache`, the CPU runs) or made per step for the whole batch in one padded pass
(`OnlineFeatures`, `batched_target_pass`: a GPU run).
Tests: tests/train/test_train_run.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.errors import ConfigError
from peagle_trt.train.forward import SeqFeatures

TEXT_PIECE = 1024  # tokens per piece of text trained beside JSONL data (about an answer's length)


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


def text_corpus(tokenizer, paths: list[Path], eos_id: int, piece: int | tuple | None = None) -> Corpus:
    """One stream of the files' tokens sampled in windows, or (`piece`) whole pieces of that many
    tokens (several sizes: taken in turn; the tail shorter than the next piece is dropped), each a
    sequence of its own."""
    ids: list[int] = []
    for text in read_text_files(paths):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
    stream = torch.tensor(ids, dtype=torch.long)
    if piece is None:
        return Corpus([stream], [torch.ones_like(stream, dtype=torch.bool)], windowed=True)
    sizes = (piece,) if isinstance(piece, int) else tuple(piece)
    pieces, a = [], 0
    while a + sizes[len(pieces) % len(sizes)] <= len(stream):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(stream[a:a + size])
        a += size
    if not pieces:
        raise ConfigError(f"the training text has {len(stream)} tokens, fewer than one piece of {sizes[0]}")
    return Corpus(pieces, [torch.ones_like(p, dtype=torch.bool) for p in pieces], windowed=False)


def joined(a: Corpus, b: Corpus) -> Corpus:
    """Both corpora's sequences (neither windowed)."""
    return Corpus(a.sequences + b.sequences, a.masks + b.masks, windowed=False)


def jsonl_lines(path: Path) -> list[str]:
    """The lines of a JSONL file, gzip-compressed when its name ends in .gz."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    return path.read_text(encoding="utf-8").splitlines()


def read_prompts(path: Path) -> list:
    if not path.is_file():
        raise ConfigError(f"--data {path} does not exist; pass a JSONL file of prompts")
    prompts = []
    for n, line in enumerate(jsonl_lines(path), start=1):
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
                  chat_template: bool, progress, max_context: int | None = None) -> Corpus:
    """Sequences prompt + response with only the response supervised. Rows already answered by
    the target (`prompt_ids` + `response_ids`, train/distill.py) are used as they are; plain
    prompts are answered now. `max_context` keeps only the last N prompt tokens."""
    distilled = read_distilled(path)
    if distilled is not None:
        pairs = distilled
    else:
        prompts = []
        for prompt in read_prompts(path):
            text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
            prompts.append(codec.encode_prompt(text, chat_template))
        responses = regenerate_all(target, prompts, max_tokens, temperature, codec.eos_ids, seed, progress=progress)
        pairs = list(zip(prompts, responses))
    if max_context is not None:
        pairs = [(ids[-max_context:], resp) for ids, resp in pairs]
    pairs = [(ids, resp) for ids, resp in pairs if resp]
    seqs = [torch.tensor(ids + resp, dtype=torch.long) for ids, resp in pairs]
    masks = [torch.tensor([False] * len(ids) + [True] * len(resp)) for ids, resp in pairs]
    return Corpus(seqs, masks, windowed=False)


def read_distilled(path: Path) -> list | None:
    """[(prompt_ids, response_ids)] of a distilled JSONL (train/distill.py), or None when its
    rows are plain prompts."""
    if not path.is_file():
        raise ConfigError(f"--data {path} does not exist; pass a JSONL file of prompts or of distilled answers")
    lines = jsonl_lines(path)
    first = next((line for line in lines if line.strip()), "")
    try:
        if "response_ids" not in json.loads(first or "{}"):
            return None
    except json.JSONDecodeError:
        return None  # read_prompts reports it with its line number
    pairs = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pairs.append((list(row["prompt_ids"]), list(row["response_ids"])))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{n}: expected a distilled row with 'prompt_ids' and 'response_ids' "
                              f"({exc})") from exc
    return pairs


def draft_vocabulary(corpus: Corpus, vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """The `draft_vocab` most frequent supervised token ids, sorted by id: draft_ids [V_d].
    Ties (e.g. tokens never answered) go to the more frequent in the prompts, then the lower id."""
    if not 0 < draft_vocab <= vocab_size:
        raise ConfigError(f"--draft-vocab {draft_vocab} must be in [1, {vocab_size}] (the target vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    context = torch.zeros(vocab_size, dtype=torch.float64)
    for seq, mask in zip(corpus.sequences, corpus.masks):
        counts += torch.bincount(seq[mask], minlength=vocab_size).double()
        context += torch.bincount(seq[~mask], minlength=vocab_size).double()
    score = counts + context / (context.sum() + 1)  # the prompt counts only order the ties
    order = torch.sort(-score, stable=True).indices[:draft_vocab]  # then: lower id first
    return order.sort().values


def sample_batch(corpus: Corpus, batch: int, seq_len: int, generator: torch.Generator) -> list:
    """`batch` (key, ids [T], supervised [T]) triples: random windows of the stream (key None), or
    whole sequences cut to `seq_len` (key: the sequence's index, for FeatureCache)."""
    if corpus.windowed:
        stream = corpus.sequences[0]
        if len(stream) <= seq_len:
            raise ConfigError(f"the training text has {len(stream)} tokens, fewer than --seq-len {seq_len}")
        starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator).tolist()
        return [(None, stream[s:s + seq_len], corpus.masks[0][s:s + seq_len]) for s in starts]
    picks = torch.randint(0, len(corpus.sequences), (batch,), generator=generator).tolist()
    return [(i, corpus.sequences[i][:seq_len], corpus.masks[i][:seq_len]) for i in picks]


@torch.no_grad()
def target_pass(target, ids: torch.Tensor, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T] -> (final-normed hidden [T, H], taps [T, A]): the target over the sequence in
    chunks of `chunk` tokens through its KV cache (bounded memory on long sequences)."""
    dev = target.lm_head.weight.device
    t = ids.numel()
    cache = target.new_cache(1, t)
    seq0 = torch.zeros(1, dtype=torch.long, device=dev)  # sequence 0 of the static layout (models/kv_cache.py)
    normed, aux = [], []
    # the last layer's output is the final residual stream of every row (forward gathers the logits rows after it)
    hook = target.layers[-1].register_forward_hook(lambda mod, inp, out: normed.append(target.norm(out)[0]))
    try:
        for a in range(0, t, chunk):
            b = min(t, a + chunk)
            last = torch.tensor([[b - a - 1]], device=dev)  # one logits row: the hook keeps every row's hidden
            _, taps = target(ids[None, a:b].to(dev), torch.arange(a, b, device=dev)[None], seq0, cache, last)
            aux.append(taps[0])
    finally:
        hook.remove()
    return torch.cat(normed), torch.cat(aux)


def features(target, ids: torch.Tensor, supervised: torch.Tensor, normed: torch.Tensor, aux: torch.Tensor,
             draft_ids: torch.Tensor) -> SeqFeatures:
    """The drafter's view of a sequence (N = T - 1 positions, EAGLE shift) from the target's pass:
    the draft vocabulary's probabilities are made per partition (`SeqFeatures.probs_at`)."""
    dev = target.lm_head.weight.device
    t = ids.numel()
    nxt = torch.arange(2, t + 1).clamp(max=t - 1)  # position i is supervised iff token i+2 is
    return SeqFeatures(ids[1:].to(dev), aux[:-1].to(dev), normed[1:].to(dev), lm_rows(target, draft_ids),
                       supervised[nxt].to(dev), target.config.logit_softcap)


def lm_rows(target, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary [V_d, H], gathered once per target and
    vocabulary (kept on the target: every sequence's features share them)."""
    kept = getattr(target, "_draft_lm_rows", None)
    if kept is None or not torch.equal(kept[0], draft_ids.cpu()):
        w = target.lm_head.weight
        kept = (draft_ids.cpu().clone(), w[draft_ids.to(w.device)].detach())
        target._draft_lm_rows = kept
    return kept[1]




@torch.no_grad()
def target_features(target, ids: torch.Tensor, supervised: torch.Tensor, draft_ids: torch.Tensor,
                    chunk: int = 512) -> SeqFeatures:
    """ids, supervised [T] -> the drafter's view of the sequence (N = T - 1 positions)."""
    normed, aux = target_pass(target, ids, chunk)
    return features(target, ids, supervised, normed, aux, draft_ids)


@torch.no_grad()
def batched_target_pass(target, seqs: list, chunk: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`target_pass` of several sequences at once: [(normed [T_i, H], taps [T_i, A])], one forward
    per chunk of `chunk` positions over the whole batch (right-padded; padding rows at position -1
    write the cache's trash block and are dropped): the GPU's batched prefill."""
    dev = target.lm_head.weight.device
    b, t = len(seqs), max(int(s.numel()) for s in seqs)
    tokens = torch.zeros(b, t, dtype=torch.long, device=dev)
    positions = torch.full((b, t), -1, dtype=torch.long, device=dev)
    for i, ids in enumerate(seqs):
        tokens[i, :ids.numel()] = ids.to(dev)
        positions[i, :ids.numel()] = torch.arange(ids.numel(), device=dev)
    cache = target.new_cache(b, t)
    tables = torch.arange(b, device=dev)  # sequence i of the static layout (models/kv_cache.py)
    normed, aux = [], []
    hook = target.layers[-1].register_forward_hook(lambda mod, inp, out: normed.append(target.norm(out)))
    try:
        for a in range(0, t, chunk):
            e = min(t, a + chunk)
            last = torch.zeros(b, 1, dtype=torch.long, device=dev)  # one logits row each: the hook keeps them all
            _, taps = target(tokens[:, a:e], positions[:, a:e], tables, cache, last)
            aux.append(taps)
    finally:
        hook.remove()
    normed_all, aux_all = torch.cat(normed, dim=1), torch.cat(aux, dim=1)
    return [(normed_all[i, :ids.numel()], aux_all[i, :ids.numel()]) for i, ids in enumerate(seqs)]


class OnlineFeatures:
    """The target's features of each training batch, made when the step asks (`batch`: one batched
    pass, `batched_target_pass`), never kept: for a GPU run, where the target's pass costs less
    than reading a cache, and no cache file has to travel. Same interface as FeatureCache."""

    loaded = 0

    def __init__(self, target, draft_ids: torch.Tensor, chunk: int = 512):
        self.target, self.draft_ids, self.chunk = target, draft_ids, chunk

    @torch.no_grad()
    def batch(self, batch: list) -> list[SeqFeatures]:
        passes = batched_target_pass(self.target, [ids for _, ids, _ in batch], self.chunk)
        return [features(self.target, ids, sup, normed, aux, self.draft_ids)
                for (_, ids, sup), (normed, aux) in zip(batch, passes)]

    def save(self) -> None:
        pass


class FeatureCache:
    """The target's pass over whole corpus sequences, made on first use and kept in float16
    (normed hidden + taps: 2 bytes x (H + A) per token), so the frozen target runs once per
    sequence, not once per epoch; kept by the sequence's content (`seq_key`). Windows of a text
    stream (key None) are not kept. With a `path`, the cache is read from and saved to that file
    and its parts beside it (`save`: each save appends only the new passes, as `PATH.part-NNNN`),
    so several heads trained on the same target share one pass, and a run on more data passes only
    the new sequences; files are memory-mapped, so the cache may be larger than RAM; a file made
    with another target is not used."""

    def __init__(self, target, draft_ids: torch.Tensor, path: Path | None = None, fingerprint: str = ""):
        self.target, self.draft_ids, self.path, self.fingerprint = target, draft_ids, path, fingerprint
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for f in self._files():
            state = torch.load(f, weights_only=True, mmap=True)  # pages are read as steps touch them
            if state.get("fingerprint") == fingerprint:
                self.kept.update(state["kept"])
        self.saved: set[str] = set(self.kept)  # keys already on disk
        self.loaded = len(self.kept)

    def _files(self) -> list[Path]:
        if self.path is None or not self.path.is_file():
            return []
        return [self.path, *sorted(self.path.parent.glob(self.path.name + ".part-[0-9][0-9][0-9][0-9]"))]

    @torch.no_grad()
    def get(self, key: int | None, ids: torch.Tensor, supervised: torch.Tensor) -> SeqFeatures:
        if key is None:
            return target_features(self.target, ids, supervised, self.draft_ids)
        normed, aux = self.passes(ids)
        return features(self.target, ids, supervised, normed, aux, self.draft_ids)

    @torch.no_grad()
    def passes(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's (normed, taps) over `ids` (float16), made once and kept by content."""
        content = seq_key(ids)
        if content not in self.kept:
            normed, aux = target_pass(self.target, ids)
            self.kept[content] = (normed.half(), aux.half())
        return self.kept[content]

    def batch(self, batch: list) -> list[SeqFeatures]:
        """The features of sample_batch's (key, ids, supervised) triples, one sequence at a time."""
        return [self.get(key, ids, sup) for key, ids, sup in batch]

    def fill(self, corpus: Corpus, seq_len: int, progress, save_every: int = 400, save_s: float = 300) -> None:
        """Make every sequence's pass now (saved every `save_every` sequences or `save_s` seconds,
        so an interrupted fill resumes), so training steps and concurrent runs sharing the file only read it."""
        if corpus.windowed:
            return
        cut = {seq_key(seq[:seq_len]): seq[:seq_len] for seq in corpus.sequences}  # equal sequences pass once
        todo = [(key, ids) for key, ids in cut.items() if key not in self.kept]
        saved_at = time.perf_counter()
        for n, (key, ids) in enumerate(todo, start=1):
            normed, aux = target_pass(self.target, ids)
            self.kept[key] = (normed.half(), aux.half())
            progress(f"target features: {len(cut) - len(todo) + n}/{len(cut)} sequences", final=n == len(todo))
            if n % save_every == 0 or time.perf_counter() - saved_at > save_s:
                self.save()
                saved_at = time.perf_counter()
        self.save()

    def save(self) -> None:
        """Write the passes made since the last save to a new file (the first save: `path`, then
        `path.part-NNNN`), atomically, and map them back from it (RAM holds only unsaved passes)."""
        new = {key: value for key, value in self.kept.items() if key not in self.saved}
        if self.path is None or not new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        files = self._files()
        number = 1 + max((int(f.name[-4:]) for f in files[1:]), default=0)
        out = self.path if not files else self.path.with_name(f"{self.path.name}.part-{number:04d}")
        tmp = out.with_name(out.name + ".tmp")
        torch.save({"fingerprint": self.fingerprint, "kept": new}, tmp)
        tmp.replace(out)  # atomic: a reader sees the file whole or not at all
        self.kept.update(torch.load(out, weights_only=True, mmap=True)["kept"])
        self.saved.update(new)
        self.loaded = len(self.kept)


def seq_key(ids: torch.Tensor) -> str:
    """A sequence's key in the feature cache: a hash of its token ids."""
    return hashlib.sha1(ids.cpu().numpy().astype("int64").tobytes()).hexdigest()[:20]


def target_fingerprint(target_dir: Path) -> str:
    """What every cached pass depends on besides its tokens: the target's weights files."""
    h = hashlib.sha256(b"features by content v2|")
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()
