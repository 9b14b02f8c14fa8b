"""Structured output in the speculative step (xgrammar): grammars compiled off the step loop, one
matcher per request, the verify rows of constrained requests masked.

  Grammars        compiles a request's StructuredOutput on a worker thread, before the request is
                  admitted (it waits, the others run), with a cache keyed by the grammar text.
                  Limits: the grammar's size (`max_bytes`, refused at once) and its compile time
                  (`timeout_s`: past it the scheduler refuses the request; the compile finishes in
                  the background and stays cached). A bad grammar is a RequestError carrying the
                  library's reason.
  GrammarState    one request's matcher at its committed tokens: `fill` writes the bitmasks of
                  the verify rows [last, d_1..d_k] (row j: the state after the committed tokens and
                  d_1..d_j) and returns how many drafts stay (none past an invalid draft or past
                  the grammar's end: they could never be accepted); `advance` takes committed
                  tokens; `sync` puts the matcher back at a (restored) output.
  verify_masks / apply_masks  one verify step: the [B, k+1] bitmasks of a batch, then logits of disallowed
                  tokens -> -inf, so greedy argmax and the rejection sampler both read the target's
                  constrained distribution and speculation stays exact against constrained
                  target-only decoding (tests/speculative/test_grammar.py).
The grammar masks the TARGET vocabulary: drafts are target ids (a drafter's reduced vocabulary is
mapped back through d2t before they get here).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from peagle_trt.config import GRAMMAR_TIMEOUT_S, MAX_GRAMMAR_BYTES, StructuredOutput
from peagle_trt.errors import ConfigError, RequestError, RuntimeInvariantError
from peagle_trt.speculative.json_schema import check_schema

_LOCATION = re.compile(r"\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2.8 writes a string with minLength / maxLength as characters of this class, which lets
# raw control characters (U+0000..U+001F but CR, LF) into the JSON string: invalid JSON. Its own
# string rule excludes them; so does the class it is replaced with (no escapes, as before).
_LENGTH_CHARS, _JSON_CHARS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'
_WHAT = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "JSON"}


def _xgr():
    try:
        import xgrammar
    except ImportError as exc:
        raise ConfigError("structured output needs xgrammar: pip install -c constraints.txt "
                          "'peagle-trt[serving]'") from exc
    return xgrammar


class Grammars:
    """Compiles StructuredOutput for one tokenizer (`tokenizer`: a Hugging Face tokenizer, or an
    xgrammar TokenizerInfo) and a target vocabulary of `vocab_size` ids."""

    def __init__(self, tokenizer, vocab_size: int, max_bytes: int = MAX_GRAMMAR_BYTES,
                 timeout_s: float = GRAMMAR_TIMEOUT_S, threads: int = 1, cache_size: int = 256):
        if max_bytes < 1 or not timeout_s > 0:
            raise RequestError(f"grammar limits must be positive, got {max_bytes} bytes, {timeout_s} s")
        self.vocab_size, self.max_bytes, self.timeout_s, self.cache_size = vocab_size, max_bytes, timeout_s, cache_size
        self._tokenizer, self._compiler = tokenizer, None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="peagle-grammar")
        self._cache: collections.OrderedDict[tuple, Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compiles run (cache misses)

    def compile(self, structured: StructuredOutput) -> Future:
        """A future of the compiled grammar (cached by its text); RequestError at once when the
        grammar is over the size limit. The future raises RequestError for a bad grammar."""
        if structured.size > self.max_bytes:
            raise RequestError(f"the {_WHAT[structured.kind]} is {structured.size} bytes; this server compiles at "
                               f"most {self.max_bytes} bytes (max_grammar_bytes)")
        key = (structured.kind, structured.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is None:
                future = self._cache[key] = self._pool.submit(self._compile, structured)
                self.compiled += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return future

    def _compile(self, structured: StructuredOutput):
        xgr = _xgr()
        if self._compiler is None:  # the vocabulary's tables: once, on this thread
            info = self._tokenizer if isinstance(self._tokenizer, xgr.TokenizerInfo) else \
                xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        kind, spec, compiler = structured.kind, structured.spec, self._compiler
        try:
            if kind == "json":
                check_schema(json.loads(spec))
                text = str(xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True))
                return compiler.compile_grammar(text.replace(_LENGTH_CHARS, _JSON_CHARS))
            if kind == "json_object":  # OpenAI's JSON mode: an object (the builtin JSON grammar takes any value)
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":  # EBNF string literals take JSON's escapes
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
            return compiler.compile_grammar(spec) if "::=" in spec else compiler.compile_lark(spec)
        except RequestError:
            raise
        except Exception as exc:  # the library's reason, without its source location
            reason = _LOCATION.sub("", str(exc)).strip().splitlines()
            raise RequestError(f"invalid {_WHAT[kind]}: {reason[0] if reason else type(exc).__name__}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One request's matcher, at its committed tokens (`accepted` of them). The grammar ends with
    one of `stop_ids` (the request's end tokens)."""

    def __init__(self, compiled, stop_ids: frozenset):
        self.matcher = _xgr().GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids) or None)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.accepted = 0

    def fill(self, drafts: list[int], bitmask: torch.Tensor, row: int) -> int:
        """Bitmask rows row .. row+n for the verify rows [last, d_1..d_n]; returns n, the drafts
        kept: those before the first invalid one, up to the one that ends the grammar."""
        m, n = self.matcher, 0
        m.fill_next_token_bitmask(bitmask, row)
        for d in drafts:
            if not m.accept_token(d):
                break
            n += 1
            if m.is_terminated():  # the grammar's end token: later drafts are never verified
                break
            m.fill_next_token_bitmask(bitmask, row + n)
        if n:
            m.rollback(n)
        return n

    def advance(self, tokens: list[int]) -> int | None:
        """Take committed tokens; returns how many of them end the grammar (up to its end token),
        None when it has not ended."""
        for j, t in enumerate(tokens):
            if not self.matcher.accept_token(t):
                raise RuntimeInvariantError(f"the grammar refused committed token {t} (after {self.accepted} "
                                            "tokens): masks and commits disagree")
            self.accepted += 1
            if self.matcher.is_terminated():
                return j + 1
        return None

    def sync(self, output: list[int]) -> None:
        """Put the matcher at `output` (after a failed step was undone)."""
        self.matcher.reset()
        self.accepted = 0
        self.advance(output)


def verify_masks(seqs: list) -> torch.Tensor | None:
    """Bitmasks [B, k+1, W] int32 of a verify step (-1: every token allowed; free requests and
    padding rows), after dropping the drafts of constrained requests that can never be accepted;
    None when no request is constrained."""
    constrained = [s for s in seqs if s.grammar is not None]
    if not constrained:
        return None
    k = max(len(s.drafts) for s in seqs)
    vocab = constrained[0].grammar.vocab_size
    bitmask = _xgr().allocate_token_bitmask(len(seqs) * (k + 1), vocab)  # [B * (k+1), W], all -1
    for i, s in enumerate(seqs):
        if s.grammar is not None:
            n = s.grammar.fill(s.drafts, bitmask, i * (k + 1))
            if n < len(s.drafts):
                s.drafts = s.drafts[:n]
    return bitmask.view(len(seqs), k + 1, -1)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, S, V] (S <= the rows R of bitmask [B, R, W]): disallowed tokens -> -inf, in place.
    On CPU the bits are unpacked by numpy and applied by one masked_fill (xgrammar's CPU kernel
    writes token by token: measured ~10x slower when most of a 49K vocabulary is masked, as in
    JSON); elsewhere xgrammar's kernel. tests/speculative/test_grammar.py holds them equal."""
    b, s, v = logits.shape
    if not logits.is_contiguous():
        raise RuntimeInvariantError("the logits are not contiguous: masks would not reach them")
    mask = bitmask[:, :s].reshape(b * s, -1)  # [B*S, W]
    constrained = (mask != -1).any(dim=-1)  # [B*S]
    if not bool(constrained.any()):
        return
    if logits.device.type == "cpu":  # bit j of int32 word w is token 32 w + j (little-endian bytes)
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :v]  # [B*S, V] 0/1
        with torch.inference_mode():  # the executors' logits may be inference tensors
            logits.view(b * s, v).masked_fill_(torch.from_numpy(bits.view(np.bool_)).logical_not_(), float("-inf"))
        return
    rows = constrained.nonzero().flatten().tolist()
    _xgr().apply_token_bitmask_inplace(logits.view(b * s, v), mask.to(logits.device), vocab_size=v, indices=rows)


def first_token_mask(s, logits: torch.Tensor) -> None:
    """Mask the row [1, V] a prefill samples the first token from (`s.grammar` at its tokens)."""
    bitmask = _xgr().allocate_token_bitmask(1, s.grammar.vocab_size)
    s.grammar.matcher.fill_next_token_bitmask(bitmask, 0)
    apply_masks(logits[None], bitmask[None])
