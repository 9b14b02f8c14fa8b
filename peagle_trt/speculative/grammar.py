"""Structured output in the speculative step (xgrammar): grammars compiled off the step loop, one
matcher per request; a constrained request's drafts and its verify rows follow the grammar.

  Grammars        compiles a request's StructuredOutput on a worker thread, before the request is
                  admitted (it waits, the others run), with a cache keyed by the grammar text.
                  Limits: the grammar's size (`max_bytes`, refused at once) and its compile time
                  (`timeout_s`: past it the scheduler refuses the request; the compile finishes in
                  the background and stays cached). A bad grammar is a RequestError carrying the
                  library's reason.
  GrammarState    one request's matcher at its committed tokens.
                  `draft`: the drafter's proposals masked by the grammar: at each depth the best of
                  the drafter's candidates the grammar allows after the drafts before it; the chain
                  ends at a depth with none, or after the grammar's end token (so no draft past an
                  invalid one or past the end is ever verified).
                  `pick`: the target's token at one verify row, the row under the grammar after the
                  committed tokens and the drafts before it: greedy takes the row's own argmax when
                  the grammar allows it (then it IS the constrained argmax: no mask is built), else
                  the row gets its bitmask (disallowed tokens -> -inf) and is argmaxed or sampled.
                  Only the rows the verify walk reads are masked. `advance` takes the committed
                  tokens (the walk's picks, taken already, and the first token of a prefill); `sync`
                  puts the matcher back at a (restored) output.
  apply_masks     logits of disallowed tokens -> -inf, in place (numpy on CPU, xgrammar's kernel elsewhere).
  fill            the bitmasks of every verify row at once (peagle_trt/bench/structured.py's per-step cost of
                  masking all K + 1 rows, the way the step did before `pick`).
Greedy argmax and the rejection sampler both read the target's constrained distribution, so
speculation stays exact against constrained target-only decoding (tests/speculative/test_grammar.py).
The grammar masks the TARGET vocabulary: drafts are target ids (a drafter's reduced vocabulary is
mapped back through d2t before they get here).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from peagle_trt.config import GRAMMAR_TIMEOUT_S, MAX_GRAMMAR_BYTES, StructuredOutput
from peagle_trt.errors import ConfigError, RequestError, RuntimeInvariantError
from peagle_trt.speculative.accept import argmax
from peagle_trt.speculative.json_schema import check_schema
from peagle_trt.speculative.sampling import probabilities, sample
from peagle_trt.speculative.tree import chain, walk

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
        self.walked = 0  # tokens the verify walk's picks took, not yet committed (advance() commits them)
        self._row_mask = _xgr().allocate_token_bitmask(1, self.vocab_size)  # [1, W], refilled per masked row

    def draft(self, candidates) -> list[int]:
        """Drafts from the drafter's candidates per depth ([k, W] target ids, best first; lists or an
        array): at each depth the first one the grammar allows after the drafts before it (the best
        is tried at once; past it, one bitmask of the state tells which of the others are allowed);
        none allowed, or the grammar's end token drafted, ends the chain. The matcher stays at the
        committed tokens."""
        m, drafts = self.matcher, []
        for row in candidates:
            token = int(row[0]) if m.accept_token(int(row[0])) else self._first_allowed(row[1:])
            if token is None:
                break
            drafts.append(token)
            if m.is_terminated():
                break
        if drafts:
            m.rollback(len(drafts))
        return drafts

    def _first_allowed(self, ids) -> int | None:
        """The first of `ids` the grammar allows now, taken by the matcher; None when none is."""
        if len(ids) == 0:
            return None
        self.matcher.fill_next_token_bitmask(self._row_mask, 0)
        words, at = self._row_mask.numpy()[0], np.asarray(ids)  # [W] int32, [n]
        allowed = (words[at >> 5] >> (at & 31)) & 1  # bit j of word w: token 32 w + j
        if not allowed.any():
            return None
        token = int(ids[int(allowed.argmax())])
        if not self.matcher.accept_token(token):
            raise RuntimeInvariantError(f"the grammar refused token {token}, which its bitmask allows")
        return token

    def pick(self, row: torch.Tensor, argmax_id: int | None, choose: Callable[[torch.Tensor], int]) -> int:
        """The target's token at one verify row (logits [1, V]) under the grammar after the committed
        tokens and the picks before it (a chain's walk: the drafts it accepted), taken by the matcher.
        `argmax_id`: the row's own argmax (greedy), taken when the grammar allows it (the constrained
        argmax then); otherwise `choose` (argmax or a sample) of the row with disallowed tokens at -inf."""
        m = self.matcher
        if m.is_terminated():  # the row after the grammar's end token: its token is cut at commit
            return choose(row) if argmax_id is None else argmax_id
        if argmax_id is not None and m.accept_token(argmax_id):
            self.walked += 1
            return argmax_id
        m.fill_next_token_bitmask(self._row_mask, 0)
        row = row.clone()
        apply_masks(row[None], self._row_mask[None])
        token = choose(row)
        if not m.accept_token(token):
            raise RuntimeInvariantError(f"the grammar refused token {token}, chosen from its own mask")
        self.walked += 1
        return token

    def take(self, drafts: list[int]) -> None:
        """The walk takes accepted drafts without picking their rows (synthetic acceptance)."""
        for t in drafts:
            if not self.matcher.accept_token(t):
                raise RuntimeInvariantError(f"the grammar refused draft {t}, which it had allowed")
            self.walked += 1

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
        """Take committed tokens: the verify walk's, which the matcher took already (picks past them,
        cut at commit, are taken back), then any others; returns how many of them end the grammar
        (up to its end token), None when it has not ended."""
        m, walked, self.walked = self.matcher, self.walked, 0
        if walked > len(tokens):
            m.rollback(walked - len(tokens))
            walked = len(tokens)
        for j, t in enumerate(tokens):
            if j >= walked and not m.accept_token(t):
                raise RuntimeInvariantError(f"the grammar refused committed token {t} (after {self.accepted} "
                                            "tokens): masks and commits disagree")
            self.accepted += 1
            if j + 1 >= walked and m.is_terminated():  # a walked end token is the last walked token
                return j + 1
        return None

    def sync(self, output: list[int]) -> None:
        """Put the matcher at `output` (after a failed step was undone)."""
        self.matcher.reset()
        self.accepted = self.walked = 0
        self.advance(output)


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, S, V] (S <= the rows R of bitmask [B, R, W]): disallowed tokens -> -inf, in place,
    on the rows the bitmask constrains. On CPU the inverted bits are unpacked by numpy and written
    by np.copyto (xgrammar's CPU kernel writes token by token: measured ~10x slower when most of a
    49K vocabulary is masked, as in JSON); elsewhere xgrammar's kernel.
    tests/speculative/test_grammar.py holds them equal."""
    b, s, v = logits.shape
    if not logits.is_contiguous():
        raise RuntimeInvariantError("the logits are not contiguous: masks would not reach them")
    mask = bitmask[:, :s].reshape(b * s, -1)  # [B*S, W]
    rows = (mask != -1).any(dim=-1).nonzero().flatten()  # the constrained rows
    if not len(rows):
        return
    flat = logits.view(b * s, v)
    if logits.device.type == "cpu":  # bit j of int32 word w is token 32 w + j (little-endian bytes)
        banned = np.unpackbits(np.invert(mask[rows].numpy()).view(np.uint8), axis=-1, count=v,
                               bitorder="little").view(np.bool_)  # [r, V]
        if logits.dtype == torch.float32:
            out = flat.detach().numpy()
            for j, r in enumerate(rows.tolist()):
                np.copyto(out[r], -np.inf, where=banned[j])
            return
        with torch.inference_mode():  # the executors' logits may be inference tensors
            flat.index_copy_(0, rows, flat[rows].masked_fill_(torch.from_numpy(banned), float("-inf")))
        return
    _xgr().apply_token_bitmask_inplace(flat, mask.to(logits.device), vocab_size=v, indices=rows.tolist())


def first_token_mask(s, logits: torch.Tensor) -> None:
    """Mask the row [1, V] a prefill samples the first token from (`s.grammar` at its tokens)."""
    s.grammar.matcher.fill_next_token_bitmask(s.grammar._row_mask, 0)
    apply_masks(logits[None], s.grammar._row_mask[None])


class GrammarHook:
    """The speculative step's one hook for constrained requests (decoder.py): their drafts, and
    their verify walk on the host (each row the walk reads masked under the grammar after the
    committed tokens and the picks before it: `GrammarState.pick`). Committed tokens advance the
    matcher in the decoder's commit (`GrammarState.advance`)."""

    @staticmethod
    def draft(s, candidates) -> list[int]:
        """A chain of the best candidates ([k, W] target ids per depth) the grammar allows."""
        return s.grammar.draft(candidates)

    @staticmethod
    def walk(s, logits: torch.Tensor, drafts: list[int], parents: tuple, forced: int | None
             ) -> tuple[list[int], list[int]]:
        """(accepted node indices, emitted tokens) of constrained request `s` over its verify rows
        (logits [n+1, V]); `forced`: a synthetic acceptor's accepted count (a chain's first drafts)."""
        ids = argmax(logits).tolist() if s.params.greedy else None  # [n+1]

        def of(row: torch.Tensor) -> int:  # a row [1, V]: its argmax, or a sample of its distribution
            return int(argmax(row)[0]) if s.params.greedy else int(sample(probabilities(row, s.params), s.generator))

        def token_at(r: int) -> int:
            return s.grammar.pick(logits[r:r + 1], None if ids is None else ids[r], of)

        if forced is not None:  # the walk takes the accepted drafts without picking their rows
            s.grammar.take(drafts[:forced])
            return list(range(forced)), drafts[:forced] + [token_at(forced)]
        return walk(drafts, parents or chain(len(drafts)), token_at)
