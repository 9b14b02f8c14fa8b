"""Self-distillation: the target answers prompts through the serving scheduler; its answers are
the training data of its drafter heads (the P-EAGLE and EAGLE-3 recipes discard original
responses and train on the target's own).

    answer_all(executor, prompts, params, eos_ids, batch, on_done)   the one code path: in-flight
        batched decode (target only) with the scheduler the server runs; `regenerate_all` of
        train/data.py and `distill` both call it
    distill(target_dir, rows, out, backend="onnxruntime", budget_s=3600)   a JSONL of answers,
        appended as requests finish (resumable: ids already in `out` are skipped), stopping
        cleanly when the time budget is spent (finished answers are kept, running ones dropped)

Rows in: {"id", "prompt" (one user turn), "max_tokens"} (train/instructions.py makes them).
Rows out: {"id", "kind", "prompt_ids", "response_ids", "finish_reason"}; `peagle-trt train --data`
reads them without regenerating (train/data.py).
Tests: tests/train/test_distill.py.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError


def answer_all(executor, prompts: list[list[int]], params: list[SamplingParams], eos_ids: tuple,
               batch: int, on_done: Callable[[int, list[int], str], None], deadline: float | None = None,
               progress=None) -> int:
    """Answer every prompt (greedy or sampled per its params), `batch` at a time; `on_done(i,
    response_ids, finish_reason)` as each finishes. Stops admitting at `deadline` (monotonic time)
    and returns the number answered. Raises ConfigError when a request fails."""
    from peagle_trt.runtime.scheduler import Request, Scheduler
    from peagle_trt.speculative.decoder import SpecDecoder

    decoder = SpecDecoder(executor, SpecConfig("none", 0), eos_ids)
    scheduler = Scheduler(decoder, max_batch=batch)
    partial: dict[int, list[int]] = {}
    errors: list[str] = []
    done = [0]

    def collect(i: int):
        def on_output(out) -> None:
            partial.setdefault(i, []).extend(out.new_token_ids)
            if out.error:
                errors.append(f"prompt {i}: {out.error}")
            elif out.finished:
                on_done(i, partial.pop(i), out.finish_reason)
                done[0] += 1
                if progress:
                    progress(done[0])
        return on_output

    todo = iter(enumerate(zip(prompts, params)))
    while not errors:  # keep the queue topped up to a few batches, step until all are done
        if deadline is None or time.monotonic() < deadline:
            for i, (ids, p) in itertools.islice(todo, max(0, 4 * batch - len(scheduler.waiting))):
                scheduler.add(Request(f"answer-{i}", list(ids), p, collect(i)))
        elif scheduler.waiting:  # budget spent: finish what runs, drop what waits
            scheduler.waiting.clear()
        if not scheduler.has_work:
            break
        scheduler.step()
    if errors:
        raise ConfigError(f"answering the prompts failed: {errors[0]}")
    return done[0]


def target_executor(target_dir: Path, backend: str, num_seqs: int, max_len: int, threads: int | None = None):
    """The target alone on CPU: onnxruntime (graphs in memory; the fast one at SmolLM2's size) or torch,
    its KV cache room for `num_seqs` requests of `max_len` positions."""
    import torch

    from peagle_trt.checkpoint import load_pair

    if backend not in ("onnxruntime", "torch"):
        raise ConfigError(f"--backend {backend!r}: expected 'onnxruntime' or 'torch'")
    spec = SpecConfig("none", 0)
    target, _ = load_pair(target_dir, None, spec).build("cpu", torch.float32)
    if backend == "torch":
        from peagle_trt.executors.torch import TorchExecutor

        return TorchExecutor(target, None, num_seqs, max_len)
    from peagle_trt.executors.onnxruntime import OrtExecutor

    return OrtExecutor.from_models(target, None, spec, num_seqs, max_len, threads)


def read_done(out: Path) -> set[str]:
    if not out.is_file():
        return set()
    done = set()
    for line in out.read_text(encoding="utf-8").splitlines():
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut by an interrupted run: answered again
    return done


def distill(target_dir: Path, rows: list[dict], out: Path, backend: str = "onnxruntime", batch: int = 16,
            max_len: int = 3072, budget_s: float | None = None, temperature: float = 0.0, seed: int = 0,
            progress=None, threads: int | None = None) -> dict:
    """Append the target's answers to `rows` to the JSONL file `out` (see the module docstring)."""
    from peagle_trt.tokenizer import TextCodec

    codec = TextCodec(target_dir)
    done = read_done(out)
    todo, skipped = [], 0
    for row in rows:
        if row["id"] in done:
            continue
        ids = codec.encode_prompt(row["prompt"], chat_template=True)
        if len(ids) + row["max_tokens"] > max_len:
            skipped += 1
            continue
        todo.append((row, ids))
    t0 = time.monotonic()
    deadline = t0 + budget_s if budget_s else None
    executor = target_executor(target_dir, backend, batch, max_len, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = [0]
    with out.open("a", encoding="utf-8") as f:
        def on_done(i: int, response: list[int], reason: str) -> None:
            row, ids = todo[i]
            f.write(json.dumps({"id": row["id"], "kind": row.get("kind"), "prompt_ids": ids,
                                "response_ids": response, "finish_reason": reason}) + "\n")
            f.flush()
            tokens[0] += len(response)

        def show(n: int) -> None:
            if progress:
                dt = time.monotonic() - t0
                progress(f"answered {n}/{len(todo)} ({tokens[0]} tokens, {tokens[0] / dt:.0f} tok/s, {dt:.0f} s)")

        params = [SamplingParams(max_tokens=row["max_tokens"], temperature=temperature, seed=seed + n)
                  for n, (row, _) in enumerate(todo)]
        n = answer_all(executor, [ids for _, ids in todo], params, codec.eos_ids, batch, on_done, deadline, show)
    dt = time.monotonic() - t0
    return {"output": str(out), "answered": n, "already_done": len(done), "skipped_too_long": skipped,
            "response_tokens": tokens[0], "seconds": round(dt, 1), "tokens_per_s": round(tokens[0] / max(dt, 1e-9), 1),
            "backend": backend, "batch": batch}
