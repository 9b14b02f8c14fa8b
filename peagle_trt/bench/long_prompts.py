"""Long prompts of about N tokens for `peagle-trt bench long-context` (peagle_trt/bench/long_context.py),
built offline and deterministically from what is installed, disjoint from what the heads trained on:

    prompts = long_prompts(codec, 4096, count=1, kinds=("source", "chat"), seed=0)   # [LongPrompt, ...]

Kinds:
  source  whole source files of HELD-OUT modules (peagle_trt/train/instructions.py: `split_of(name) ==
          "heldout"`, stdlib then the installed packages, `source_modules`), in a seeded order, each with a
          "# file: NAME" header, as many as fit the budget, then a request about a function defined in
          the LAST file ("Explain what ...", "Write a docstring for ..."): the answer depends on the
          context. The training helper reads `source_files(...)`, the train split: no file in common.
  chat    a multi-turn conversation: user and assistant turns from the held-out rows of the shipped
          self-distillation answers (data/smollm2-135m-instruct/answers.jsonl.gz; held out = every
          HELD_OUT_EVERY-th non-empty row, as `peagle-trt train --held-out-every 50` splits it, never
          trained on), ending with a new user request (another held-out row's). The answers are token
          ids of SmolLM2's tokenizer: a target with another tokenizer (the smoke's code pair) gets
          stand-in turns instead (a question about a held-out module, its first lines as the answer).
Tokens are counted by the target's tokenizer with its chat template (the ids are what the benchmark
submits); a prompt never exceeds its budget and stops within SLACK of it when the material allows.
The same seed gives the same prompts on every machine with the same installed packages.
Tests: tests/bench/test_long_context.py.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ConfigError

ANSWERS = Path(__file__).resolve().parents[2] / "data" / "smollm2-135m-instruct" / "answers.jsonl.gz"
HELD_OUT_EVERY = 50  # peagle-trt train's default --held-out-every (peagle_trt/train/config.py)
KINDS = ("source", "chat")
SLACK = 0.03  # a prompt stops once within this share of its budget
SOURCE_REQUESTS = ("Explain what the function `{fn}` in `{mod}` does, step by step.",
                   "Write a docstring for the function `{fn}` in `{mod}` and show the function with it.")
MODULE_TURN_CHARS = 600  # chat turns of a target that cannot read the answers: a module's first characters
CHAT_CLOSE = "Thanks. Now a new question:\n\n{request}"


@dataclass(frozen=True)
class LongPrompt:
    kind: str  # "source" | "chat"
    budget: int  # the tokens asked for
    ids: tuple[int, ...]  # the prompt's token ids, chat template included: what is submitted
    parts: tuple[str, ...]  # source: the module names; chat: "answers:ROW" (or "module:NAME") of its turns
    request: str  # the closing user request

    @property
    def tokens(self) -> int:
        return len(self.ids)


def long_prompts(codec, budget: int, count: int = 1, kinds: tuple[str, ...] = KINDS, seed: int = 0) -> list[LongPrompt]:
    """`count` prompts of each kind of at most `budget` tokens, kind by kind (`codec`: the target's
    TextCodec)."""
    bad = set(kinds) - set(KINDS)
    if bad:
        raise ConfigError(f"prompt kinds {sorted(bad)}: expected some of {KINDS}")
    turns = chat_turns(codec, seed) if "chat" in kinds else None
    return [source_prompt(codec, budget, i, seed) if kind == "source" else chat_prompt(codec, budget, i, seed, turns)
            for kind in kinds for i in range(count)]


def encode(codec, messages: list[dict]) -> list[int]:
    """The ids of a conversation as the target receives it: its chat template with the generation
    prompt, else the turns as plain "Role: text" paragraphs (a tokenizer without a template)."""
    if codec.has_chat_template:
        ids = codec.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    return list(codec.tok(text, add_special_tokens=True)["input_ids"])


def _start(n: int, key: str, index: int) -> int:
    """Where prompt `index` starts in a list of n: distinct for distinct indexes below n."""
    perm = list(range(n))
    random.Random(key).shuffle(perm)
    return perm[index % n]


# -- source ------------------------------------------------------------------------------------------------
def heldout_modules(seed: int) -> list[tuple[str, Path]]:
    """The held-out modules of every source (stdlib, then packages), shuffled with `seed`."""
    mods = list(_heldout_modules())
    random.Random(f"{seed}:modules").shuffle(mods)
    return mods


@functools.lru_cache(maxsize=1)
def _heldout_modules() -> tuple[tuple[str, Path], ...]:  # seconds: every installed package walked
    from peagle_trt.train.instructions import SOURCES, source_modules, split_of

    return tuple(sorted({(n, p) for s in SOURCES for n, p in source_modules(s) if split_of(n) == "heldout"}))


def _functions(source: str) -> list[str]:
    """Public functions of a module: top-level ones, else methods (Class.method)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    top = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    methods = [f"{c.name}.{n.name}" for c in tree.body if isinstance(c, ast.ClassDef)
               for n in c.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
    return top or methods


def source_prompt(codec, budget: int, index: int = 0, seed: int = 0) -> LongPrompt:
    """Held-out module files (whole) up to `budget` tokens, then a request about a function of the
    last one. Prompt `index` starts at another place of the seeded module order."""
    rng = random.Random(f"{seed}:source:{budget}:{index}")
    mods = heldout_modules(seed)
    start = _start(len(mods), f"{seed}:source:{budget}", index)
    overhead = len(encode(codec, [{"role": "user", "content": "```python\n\n```\n\n" + SOURCE_REQUESTS[1].format(
        fn="x" * 24, mod="x" * 24)}])) + 8
    room = budget - overhead
    last, chosen = None, []  # (name, text, tokens): the last file has a function to ask about
    for name, path in mods[start:] + mods[:start]:
        if room <= SLACK * budget:
            break
        try:
            text = f"# file: {name}\n{path.read_text(encoding='utf-8').strip()}\n"
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 6 * room:  # certainly too long: skip before tokenizing
            continue
        n = len(codec.tok(text, add_special_tokens=False)["input_ids"])
        if n > room or (last is None and not _functions(text)):
            continue  # until the last file is found, only files with a function
        if last is None:
            last = (name, text, n)
        else:
            chosen.append((name, text, n))
        room -= n
    if last is None:
        raise ConfigError(f"no held-out module with a public function fits {budget} tokens; raise the budget")
    chosen.append(last)
    request = rng.choice(SOURCE_REQUESTS).format(fn=rng.choice(_functions(last[1])), mod=last[0])
    while True:
        content = "```python\n" + "\n".join(t for _, t, _ in chosen) + "```\n\n" + request
        ids = encode(codec, [{"role": "user", "content": content}])
        if len(ids) <= budget or len(chosen) == 1:
            break
        chosen.pop(0)  # the estimate ran over (tokens merged across files): drop the first file
    if len(ids) > budget:
        raise ConfigError(f"no held-out module fits {budget} tokens with its request; raise the budget")
    return LongPrompt("source", budget, tuple(ids), tuple(n for n, _, _ in chosen), request)


# -- chat -------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def heldout_answers(path: Path = ANSWERS, every: int = HELD_OUT_EVERY) -> tuple[tuple[int, list[int], list[int]], ...]:
    """(row, prompt_ids, response_ids) of the held-out rows of the distilled answers: row i of the
    non-empty answers is held out iff i % every == every - 1 (peagle_trt/train/curve.py `split`, after
    train/data.py `prompt_corpus` drops empty answers)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r["response_ids"]]
    return tuple((i, r["prompt_ids"], r["response_ids"]) for i, r in enumerate(rows) if i % every == every - 1)


def _user_text(codec, prompt_ids: list[int]) -> str | None:
    """The user turn of a distilled prompt (SmolLM2's template), or None when it is not found."""
    text = codec.tok.decode(prompt_ids, skip_special_tokens=False)
    start = text.rfind("<|im_start|>user\n")
    end = text.find("<|im_end|>", start)
    return text[start + len("<|im_start|>user\n"):end] if start >= 0 and end > start else None


def chat_turns(codec, seed: int) -> list[tuple[str, str, str]]:
    """(source, user, assistant) turns, seeded order: the held-out answers decoded when the target's
    tokenizer is theirs (SmolLM2's), else stand-ins made of held-out modules (`_module_turns`)."""
    turns = []
    answers = heldout_answers() if ANSWERS.is_file() else []
    vocab = len(codec.tok)
    if answers and all(max(p + r) < vocab for _, p, r in answers[:8]) \
            and _user_text(codec, answers[0][1]) is not None:
        for row, p, r in answers:
            user = _user_text(codec, p)
            if user is not None:
                turns.append((f"answers:{row}", user.strip(), codec.decode(r).strip()))
    else:
        turns = _module_turns()
    random.Random(f"{seed}:chat").shuffle(turns)
    return turns


def _module_turns() -> list[tuple[str, str, str]]:
    """Stand-in turns for a target that cannot read the answers: a question about a held-out module,
    its first lines as the answer."""
    turns = []
    for name, path in _heldout_modules():
        with contextlib.suppress(OSError, UnicodeDecodeError):
            head = path.read_text(encoding="utf-8")[:MODULE_TURN_CHARS].strip()
            if head:
                turns.append((f"module:{name}", f"How does the Python module `{name}` begin?", head))
    return turns


def chat_prompt(codec, budget: int, index: int = 0, seed: int = 0, turns: list | None = None) -> LongPrompt:
    """Held-out (user, assistant) turns up to `budget` tokens, then a new user request (another
    held-out row's question). Prompt `index` starts at another place of the seeded turn order."""
    turns = turns if turns is not None else chat_turns(codec, seed)
    start = _start(len(turns), f"{seed}:chat:{budget}", index)
    order = turns[start:] + turns[:start]
    close_src, close_user, _ = order[-1]
    close = [{"role": "user", "content": CHAT_CLOSE.format(request=close_user)}]
    messages: list[dict] = []
    parts: list[str] = []
    ids = encode(codec, close)
    if len(ids) > budget:
        raise ConfigError(f"a chat prompt's closing request alone exceeds {budget} tokens; raise the budget")
    for src, user, answer in order[:-1]:
        if len(ids) >= (1 - SLACK) * budget:
            break
        guess = sum(len(codec.tok(t, add_special_tokens=False)["input_ids"]) for t in (user, answer))
        if len(ids) + guess > budget:  # a turn's text alone does not fit: skip the template's render
            continue
        trial = messages + [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        trial_ids = encode(codec, trial + close)
        if len(trial_ids) <= budget:
            messages, ids = trial, trial_ids
            parts.append(src)
    return LongPrompt("chat", budget, tuple(ids), tuple(parts + [close_src]), close[0]["content"])
