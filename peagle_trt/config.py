"""Run-time configuration as frozen dataclasses: what to speculate (`SpecConfig`), how to sample
one request (`SamplingParams`, with its `StructuredOutput`), how the KV cache is paged
(`KVLayout`). Each validates itself on construction. Also the run-time constants several floors
share: the custom-op implementations (`KERNELS`), what a KV cache may store (`KV_CACHE_DTYPES`), the
KV block size and the default input byte limits of a served model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from peagle_trt.errors import ConfigError, RequestError

SPEC_MODES = ("none", "eagle3", "peagle")
# Temperatures below this sample greedily (as vLLM's 1e-5 sampling epsilon). At T = 1e-5 a
# runner-up token 1e-3 below the top logit already has probability e^-100 relative to it, so
# greedy is the distribution's limit; below it, `logits / T` in float32 overflows (1e-38) or T
# itself rounds to 0 (5e-324, and 1e-45 after a float32 round trip), giving NaN.
TEMPERATURE_FLOOR = 1e-5
PREFILL_CHUNK = 256  # prompt tokens per prefill forward: the default of `build` and `generate`
KERNELS = ("reference", "cuda")  # the custom ops: torch references | Triton kernels on the GPU
# What the KV cache stores (vLLM's --kv-cache-dtype): "auto" the model's dtype, "fp8" E4M3 codes
# (float8_e4m3fn) with a per-layer scale for K and one for V: stored = fp8(clamp(value / scale, +-448)),
# read = code * scale (peagle_trt/ops/reference.py kv_attention). The scales are the checkpoint's
# calibrated k_scale / v_scale where it has them (ModelOpt), else 1.0 (vLLM's default).
KV_CACHE_DTYPES = ("auto", "fp8")
# Default input limits, in UTF-8 bytes: a token averages ~4 bytes of text, so 16 bytes per
# position of max_seq_len leaves 4x room; stop strings are matched on every streamed piece.
PROMPT_BYTES_PER_TOKEN = 16
MAX_STOP_BYTES = 1024
# Structured output (peagle_trt/speculative/grammar.py): the largest grammar a request may send (schema, regex
# or EBNF text, UTF-8 bytes) and the longest its compile may take before the request is refused.
MAX_GRAMMAR_BYTES = 65536
GRAMMAR_TIMEOUT_S = 10.0
# Positions per KV block. 32, as TensorRT-LLM's tokens_per_block: a verify of K + 1 <= 16 rows and
# the drafter's K - 1 lookahead rows fit in one or two blocks, a request wastes at most 31
# positions (0.7% of a 4K context), attention gathers 32-row tiles (the kernels' key tile) and a
# 4K table has 128 entries. 16 (vLLM's GPU default) halves the waste and doubles prefix-reuse
# granularity at twice the table entries; it is a build option (--block-size).
BLOCK_SIZE = 32
# Why `deterministic` is refused on TensorRT (RepositoryOptions, TensorRTExecutor), and what it would take.
TENSORRT_NOT_DETERMINISTIC = (
    "deterministic mode is not available on the tensorrt backend: TensorRT picks GEMM and attention tactics by "
    "shape (batch, rows), so a row's result depends on what shares its step; it would take engines built with "
    "one fixed tactic per layer for every profile (a timing cache pinned per shape) and the plugins' own "
    "batch-invariant GEMM and attention kernels. Use --backend onnxruntime or torch for deterministic serving "
    "(docs/SERVING.md, \"Deterministic mode\")")


@dataclass(frozen=True)
class KVLayout:
    """How the paged KV cache is laid out: `num_blocks` blocks of `block_size` positions (for the
    full-attention layers and the drafter; windowed layers get their window's worth per request,
    peagle_trt/models/kv_cache.py), at most `max_len` positions per request, `max_batch` requests per step,
    `max_rows` rows of one request per forward (max(prefill chunk, K + 1)), elements stored as
    `cache_dtype` (KV_CACHE_DTYPES: "auto" the model's dtype, "fp8" E4M3 codes; target and drafter alike)."""
    num_blocks: int
    max_len: int = 2048
    max_batch: int = 1
    block_size: int = BLOCK_SIZE
    max_rows: int = PREFILL_CHUNK
    cache_dtype: str = "auto"

    def __post_init__(self):
        for name in ("num_blocks", "max_len", "max_batch", "block_size", "max_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"KV layout: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"KV cache dtype {self.cache_dtype!r} is not one of {KV_CACHE_DTYPES}: auto stores "
                              "the model's dtype, fp8 E4M3 codes with per-layer scales")

    @property
    def max_blocks(self) -> int:
        """Block-table entries per request."""
        return math.ceil(self.max_len / self.block_size)

    def window_blocks(self, window: int) -> int:
        """Blocks one request can hold at once in a group of `window` positions: the window behind
        the first row of a forward plus that forward's rows (`max_rows`), block-aligned."""
        return math.ceil((window + self.max_rows) / self.block_size) + 1

    def group_blocks(self, windows: tuple[int, ...]) -> tuple[int, ...]:
        """Blocks per KV group (`windows`: per group its window, group 0 full attention):
        `num_blocks` for group 0; a windowed group gets enough for `max_batch` requests each
        holding its window (it never runs dry, so admission only counts group 0)."""
        return (self.num_blocks,) + tuple(min(self.num_blocks, self.max_batch * self.window_blocks(w))
                                          for w in windows[1:])

    @classmethod
    def for_sequences(cls, num_seqs: int, max_len: int, block_size: int = BLOCK_SIZE, **kw) -> KVLayout:
        """Blocks for `num_seqs` requests of `max_len` positions each (the memory contiguous slots
        would take); `max_batch` defaults to `num_seqs`."""
        kw.setdefault("max_batch", num_seqs)
        return cls(num_seqs * math.ceil(max_len / block_size), max_len, block_size=block_size, **kw)


def _by_batch(default: int, schedule: tuple, batch: int) -> int:
    """A (first, last, value) schedule's value at `batch` (sorted from 1; a gap or the tail keeps the
    previous entry's value); `default` below the first entry or without a schedule."""
    value = default
    for lo, _, entry in schedule:
        if lo > batch:
            break
        value = entry
    return value


@dataclass(frozen=True)
class SpecConfig:
    """What to speculate. `num_spec_tokens` is K, the most drafts per step (the graphs and KV
    headroom are built for it); __post_init__ sets it to 0 when `mode` is "none", whatever was passed
    (a target-only step emits exactly one token; SpecConfig("none", 7) == SpecConfig("none", 0)).
    A step may verify fewer: `k_schedule` caps K by the running batch
    size (vLLM's num_speculative_tokens_per_batch_size: (first, last, K) inclusive ranges from batch
    size 1; a gap or a batch past the last range keeps the previous range's K; K = 0 decodes
    plainly), and `adaptive` picks each request's k per step (peagle_trt/speculative/draft_length.py).
    `synthetic_rates` is for benchmarks only: draft i is accepted with unconditional probability
    synthetic_rates[i-1] whatever its token, so the output is NOT the target's
    (speculative_config.py refuses it outside benchmarks unless forced). Draft trees
    (peagle_trt/speculative/tree.py): `tree_budget` B > 0 verifies the B most probable prefixes of depth <= k
    instead of a chain of k, `tree_schedule` sets B by batch size like `k_schedule` (0: the chain),
    `static_tree` the rank paths of vLLM's speculative_token_tree (K = its depth); `adaptive_tree`
    picks each step's budget up to those, or the chain (peagle_trt/speculative/tree_size.py). Parsed from
    vLLM's JSON by peagle_trt/speculative_config.py."""
    mode: str = "peagle"  # none: target only | eagle3: K sequential drafter passes | peagle: one pass
    num_spec_tokens: int = 7  # K, the most draft tokens per step (0 when mode is none)
    k_schedule: tuple[tuple[int, int, int], ...] = ()  # (first batch size, last batch size, K)
    adaptive: bool = False  # per request and step, the k of the most expected tokens per second
    synthetic_rates: tuple[float, ...] = ()  # benchmarks: P(first i drafts accepted), i = 1..K
    tree_budget: int = 0  # nodes of a draft tree per request and step (0: a chain of k)
    tree_schedule: tuple[tuple[int, int, int], ...] = ()  # (first batch size, last batch size, budget)
    static_tree: tuple[tuple[int, ...], ...] = ()  # rank paths, parents first (vLLM speculative_token_tree)
    adaptive_tree: bool = False  # per step, the budget (<= the configured one) or chain of the most tokens per second

    def __post_init__(self):
        if self.mode not in SPEC_MODES:
            raise ConfigError(f"spec mode {self.mode!r} is unknown; expected one of {SPEC_MODES}")
        if self.mode == "none":  # no drafts: K is 0 whatever was passed (frozen, hence object.__setattr__)
            object.__setattr__(self, "num_spec_tokens", 0)
        if self.mode != "none" and not 1 <= self.num_spec_tokens <= 64:
            raise ConfigError(f"num_spec_tokens must be in [1, 64], got {self.num_spec_tokens}")
        if self.mode == "none" and (self.k_schedule or self.adaptive or self.synthetic_rates):
            raise ConfigError("a K schedule, adaptive K or synthetic acceptance needs speculation (a drafter)")
        last = 0
        for entry in self.k_schedule:
            if len(entry) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry):
                raise ConfigError(f"K schedule entry {entry!r} must be [first batch size, last batch size, K] integers")
            lo, hi, k = entry
            if (last == 0 and lo != 1) or lo <= last:
                raise ConfigError(f"K schedule: batch-size ranges must start at 1 and be sorted without "
                                  f"overlap; [{lo}, {hi}, {k}] follows a range ending at {last}")
            if not 1 <= lo <= hi or not 0 <= k <= self.num_spec_tokens:
                raise ConfigError(f"K schedule entry [{lo}, {hi}, {k}]: need 1 <= first <= last and "
                                  f"0 <= K <= num_speculative_tokens ({self.num_spec_tokens})")
            last = hi
        self._check_tree()
        rates = self.synthetic_rates
        if rates and (len(rates) != self.num_spec_tokens or any(not 0 <= r <= 1 for r in rates)
                      or any(b > a for a, b in zip(rates, rates[1:]))):
            raise ConfigError(f"synthetic acceptance rates must be {self.num_spec_tokens} non-increasing "
                              f"probabilities (one per draft position), got {list(rates)}")

    def _check_tree(self) -> None:
        if self.adaptive_tree and (self.static_tree or not self.tree):
            raise ConfigError("adaptive tree sizing picks each step's budget up to draft_tree_budget (or its "
                              "per-batch-size schedule): give one of those, not a static tree")
        if self.adaptive_tree and self.adaptive:
            raise ConfigError("adaptive tree sizing and adaptive K both pick a step's verify rows: use one (the "
                              "tree rule chooses between the K chain and trees; adaptive K between chains of 0..K; "
                              "a K schedule caps the depth under either)")
        if not self.tree:
            return
        if self.mode == "none" or self.adaptive or self.synthetic_rates:
            raise ConfigError("a draft tree needs speculation with a fixed K (not adaptive K, not synthetic "
                              "acceptance)")
        if self.static_tree and (self.tree_budget or self.tree_schedule):
            raise ConfigError("pass a static tree (speculative_token_tree) or a tree budget, not both")
        if self.static_tree and max(len(p) for p in self.static_tree) != self.num_spec_tokens:
            raise ConfigError(f"a static tree of depth {max(len(p) for p in self.static_tree)} needs "
                              f"num_spec_tokens = its depth, got {self.num_spec_tokens}")
        if not 0 <= self.tree_budget <= 64:
            raise ConfigError(f"the tree budget must be in [1, 64] nodes, got {self.tree_budget}")
        last = 0
        for entry in self.tree_schedule:
            if len(entry) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry):
                raise ConfigError(f"tree budget schedule entry {entry!r} must be [first batch size, last batch "
                                  "size, budget] integers")
            lo, hi, budget = entry
            if (last == 0 and lo != 1) or lo <= last or not lo <= hi or not 0 <= budget <= 64:
                raise ConfigError(f"tree budget schedule entry [{lo}, {hi}, {budget}]: ranges must start at 1, "
                                  "be sorted without overlap, and budgets be in [0, 64] (0: the chain)")
            last = hi

    @property
    def tree(self) -> bool:
        """Whether steps may verify draft trees (else chains)."""
        return bool(self.tree_budget or self.tree_schedule or self.static_tree)

    def tree_budget_for_batch(self, batch: int) -> int:
        """The tree budget at `batch` running requests (the schedule's, else tree_budget); 0: the chain."""
        return _by_batch(self.tree_budget, self.tree_schedule, batch)

    @property
    def tree_width(self) -> int:
        """The most candidates per draft position a step reads (a static tree's highest rank + 1, or
        the largest budget: all of it may hang below the root); 1 without trees."""
        if self.static_tree:
            return max(max(p) for p in self.static_tree) + 1
        return max([1, self.tree_budget] + [e[2] for e in self.tree_schedule])

    @property
    def max_nodes(self) -> int:
        """The most draft tokens one verify checks (rows past the root): K, or a tree's nodes."""
        return max([self.num_spec_tokens, self.tree_budget, len(self.static_tree)] + [e[2] for e in self.tree_schedule])

    def k_for_batch(self, batch: int) -> int:
        """The K cap at `batch` running requests (the schedule's, else K)."""
        return _by_batch(self.num_spec_tokens, self.k_schedule, batch)


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutput:
    """Output that must follow a grammar: vLLM's `structured_outputs`, exactly one kind.
      json         a JSON schema (`spec`: its JSON text; key order kept, properties come out in it)
      regex        a regular expression the whole output matches
      choice       exactly one of the strings of `spec` (a tuple)
      grammar      an EBNF grammar (xgrammar's dialect, `root ::= ...`), or a Lark grammar
                   (`start: ...`; told apart by `::=`)
      json_object  any JSON object (`spec` empty)
    Compiled and enforced by peagle_trt/speculative/grammar.py."""
    kind: str
    spec: str | tuple[str, ...] = ""

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise RequestError(f"structured output kind {self.kind!r} is not one of {STRUCTURED_KINDS}")
        if self.kind == "choice":
            if not isinstance(self.spec, tuple) or not self.spec or \
                    not all(isinstance(c, str) and c for c in self.spec):
                raise RequestError(f"structured output `choice` must be a non-empty list of non-empty strings, "
                                   f"got {list(self.spec) if isinstance(self.spec, tuple) else self.spec!r}")
        elif self.kind == "json_object":
            if self.spec:
                raise RequestError("structured output `json_object` takes no value but true")
        elif not isinstance(self.spec, str) or not self.spec.strip():
            raise RequestError(f"structured output `{self.kind}` must be a non-empty string")

    @classmethod
    def from_dict(cls, value: dict) -> StructuredOutput:
        """vLLM's `structured_outputs` object ({"json": schema} | {"regex": str} | {"choice": [str]}
        | {"grammar": str} | {"json_object": true}); RequestError names what is wrong."""
        if not isinstance(value, dict):
            raise RequestError(f"structured outputs must be an object with one of {STRUCTURED_KINDS}, "
                               f"got {type(value).__name__}")
        given = {k: v for k, v in value.items() if v is not None and v is not False}
        unknown = sorted(set(given) - set(STRUCTURED_KINDS))
        if unknown:
            raise RequestError(f"structured outputs: {unknown} not supported; send exactly one of {STRUCTURED_KINDS}")
        if len(given) != 1:
            raise RequestError(f"structured outputs: send exactly one of {STRUCTURED_KINDS}, got {sorted(given)}")
        (kind, spec), = given.items()
        if kind == "json":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as exc:
                    raise RequestError(f"structured outputs: the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(spec, (dict, bool)):
                raise RequestError(f"structured outputs: a JSON schema must be an object, got {type(spec).__name__}")
            spec = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
        elif kind == "choice":
            spec = tuple(spec) if isinstance(spec, (list, tuple)) else spec
        elif kind == "json_object":
            if spec is not True:
                raise RequestError(f"structured outputs: json_object must be true, got {spec!r}")
            spec = ""
        return cls(kind, spec)

    @classmethod
    def from_json(cls, text: str) -> StructuredOutput:
        """The wire form (`to_json`), e.g. the Triton input `structured_output`."""
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise RequestError(f"structured_output is not valid JSON ({exc})") from None
        return cls.from_dict(value)

    def to_dict(self) -> dict:
        if self.kind == "json":
            return {"json": json.loads(self.spec)}
        if self.kind == "choice":
            return {"choice": list(self.spec)}
        return {self.kind: self.spec if self.kind != "json_object" else True}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":"))

    @property
    def size(self) -> int:
        """UTF-8 bytes of the grammar as sent (the compile limit's measure)."""
        return sum(len(s.encode()) for s in (self.spec if isinstance(self.spec, tuple) else (self.spec,)))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature` 0 (or any value below TEMPERATURE_FLOOR, 1e-5)
    means greedy: the argmax token, no random draws, token-identical to temperature 0."""
    max_tokens: int = 64
    temperature: float = 0.0  # < TEMPERATURE_FLOOR: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    end_ids: tuple[int, ...] = ()  # extra end ids besides the tokenizer's EOS
    structured: StructuredOutput | None = None  # the output must follow this grammar

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or not math.isfinite(self.top_p):
            raise ConfigError(f"temperature and top_p must be finite numbers, got "
                              f"{self.temperature}, {self.top_p}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.structured is not None and self.ignore_eos:
            raise ConfigError("ignore_eos cannot be combined with structured output: the grammar ends the output "
                              "with an end token; leave ignore_eos out")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR
