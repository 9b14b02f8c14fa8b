"""Calibration data for FP8 post-training quantization.

Two sources:
  * a small built-in set (chat prompts of several kinds plus raw text), used when no file is given;
  * `--calib-data FILE.jsonl`: one JSON object per line with a "prompt" key (a user message: the
    target's chat template is applied, as at serving time) or a "text" key (raw text, tokenized
    as is). Blank lines are skipped; anything else is a ConfigError naming the file and line.

Max calibration only needs activations of the kind the model will see, so a few dozen to a few
hundred samples of the serving distribution are enough (ModelOpt recommends 128-512).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ConfigError

KINDS = ("prompt", "text")


@dataclass(frozen=True)
class CalibSample:
    kind: str  # "prompt" (chat template applied) | "text" (raw)
    text: str


BUILTIN: tuple[CalibSample, ...] = tuple(
    [CalibSample("prompt", p) for p in (
        "Explain how speculative decoding keeps the output identical to the target model's.",
        "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
        "Summarize the causes of the French Revolution in five bullet points.",
        "What is 17 * 24? Show your reasoning step by step.",
        "Translate into French: 'The weather is nice today, let's go for a walk by the river.'",
        "Write a short poem about the sea, the wind and the long road home.",
        "Give me a SQL query that lists the ten customers with the highest total order value.",
        "Why is the sky blue? Answer for a ten-year-old.",
        "Compare TCP and UDP, and say when you would use each.",
        "Draft a polite email asking a colleague to review a pull request by Friday.",
        "Solve for x: 3x + 7 = 22. Then check the answer.",
        "List the planets of the solar system with one fact about each.",
    )]
    + [CalibSample("text", t) for t in (
        "The transformer architecture relies on self-attention: every token attends to the tokens "
        "before it through queries, keys and values, and a feed-forward block follows each layer.",
        "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot, *rest = xs\n"
        "    return quicksort([x for x in rest if x < pivot]) + [pivot] + "
        "quicksort([x for x in rest if x >= pivot])\n",
        "Once upon a time, in a village at the edge of a great forest, there lived an old "
        "clockmaker who could mend anything except his own heart.",
        "1 2 3 4 5 6 7 8 9 10; 2 4 8 16 32 64 128 256 512 1024; pi = 3.14159, e = 2.71828.",
    )])


def read_calib_file(path: str | Path, limit: int | None = None) -> list[CalibSample]:
    """Samples from a JSONL file (at most `limit`, in file order). ConfigError on any bad line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"calibration data {path}: no such file; pass a JSONL file with one "
                          '{"prompt": ...} or {"text": ...} object per line')
    samples: list[CalibSample] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit is not None and len(samples) >= limit:
                    break
                if not line.strip():
                    continue
                samples.append(_parse_line(line, f"calibration data {path}, line {lineno}"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"calibration data {path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                          "save the file as UTF-8 JSONL") from exc
    except OSError as exc:
        raise ConfigError(f"calibration data {path}: cannot read it ({exc.strerror})") from exc
    if not samples:
        raise ConfigError(f"calibration data {path}: the file holds no samples; expected one "
                          '{"prompt": ...} or {"text": ...} JSON object per line')
    return samples


def _parse_line(line: str, where: str) -> CalibSample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must "
                          'be one JSON object such as {"text": "..."}') from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with a \"prompt\" or \"text\" key, "
                          f"found a {type(obj).__name__}")
    keys = [k for k in KINDS if k in obj]
    if len(keys) != 1:
        found = sorted(obj)[:5]
        raise ConfigError(f"{where}: expected exactly one of the keys \"prompt\" (chat-formatted) or "
                          f"\"text\" (raw), found keys {found}")
    value = obj[keys[0]]
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: {keys[0]!r} must be a non-empty string, found {value!r:.60}")
    return CalibSample(keys[0], value)


def calibration_samples(calib_data: Path | None, num: int) -> tuple[list[CalibSample], str]:
    """(samples, source description): the first `num` of the file's samples, or of the built-in set."""
    if num < 1:
        raise ConfigError(f"num_calib must be >= 1, got {num}")
    if calib_data is None:
        return list(BUILTIN[:num]), "builtin"
    return read_calib_file(calib_data, num), str(calib_data)


def tokenize_samples(codec, samples: list[CalibSample], max_len: int) -> list[list[int]]:
    """Token ids of each sample, truncated to `max_len` (codec: peagle_trt.tokenizer.TextCodec)."""
    if max_len < 1:
        raise ConfigError(f"max_calib_len must be >= 1, got {max_len}")
    out = []
    for s in samples:
        ids = codec.encode_prompt(s.text, chat_template=s.kind == "prompt")[:max_len]
        if ids:
            out.append(ids)
    if not out:
        raise ConfigError("calibration: every sample tokenized to zero tokens")
    return out
