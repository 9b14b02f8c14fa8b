"""Text in, text out: the target directory's tokenizer, its chat template, streaming detokenization.

The tokenizer is read from local files only (tokenizer.json / tokenizer_config.json); no hub
access and no remote code.
"""

from __future__ import annotations

import json
from pathlib import Path

from peagle_trt.errors import ConfigError


class TextCodec:
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        try:
            self.tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False,
                                                     local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{model_dir}: cannot load its tokenizer ({exc}); the target directory "
                              "must hold tokenizer.json / tokenizer_config.json") from exc
        self.eos_ids = self._eos_ids(model_dir)

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids = set()
        for name in ("generation_config.json", "config.json"):
            path = model_dir / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tok.eos_token_id is not None:
            ids.add(self.tok.eos_token_id)
        return tuple(sorted(ids))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def encode_prompt(self, text: str, chat_template: bool = True) -> list[int]:
        if chat_template and self.has_chat_template:
            ids = self.tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stream(self, stop: tuple[str, ...] = ()) -> TextStream:
        return TextStream(self, stop)


class TextStream:
    """Incremental text of a growing list of token ids.

    `push(ids)` returns only text that is final: an incomplete UTF-8 sequence (decoded as U+FFFD)
    and a tail that could still become a stop string are held back. Once a stop string appears,
    the text ends right before it and `stopped` turns true. `finish()` returns the rest.

    Per push the cost is bounded, whatever the output length (no re-decoding, no re-scanning):
      decode  only a window: the tokens since the last clean point (text not ending in U+FFFD)
              plus PREFIX_TOKENS before it for context (word-boundary spaces); the new text is
              decode(prefix + new) minus decode(prefix) (the vLLM / TGI scheme); text before a
              trailing U+FFFD is returned at once, and the window moves past it (an incomplete
              character spans at most 3 tokens). A window still ending in U+FFFD after
              HOLD_TOKENS tokens (bytes that will never complete) is committed but for its last 3
              tokens (then, and only then, a run of invalid bytes may show a different number of
              U+FFFD than one decode of all ids);
      stops   only the held tail (shorter than the longest stop string) plus the new text is
              searched: a stop string ending in the new text starts inside that tail.
    """

    PREFIX_TOKENS = 4
    HOLD_TOKENS = 8

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        self.codec, self.stop = codec, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self._prefix = 0  # window start: context tokens already turned into text
        self._read = 0  # tokens whose text is in `_pieces` / `_held`
        self._shown = 0  # characters of the text of ids[_read:] already returned (before a U+FFFD)
        self._pieces: list[str] = []  # text returned so far
        self._held = ""  # decoded text not returned yet (it may begin a stop string)
        self.final: str | None = None  # the text cut at a stop string, once one appeared

    @property
    def stopped(self) -> bool:
        return self.final is not None

    @property
    def text(self) -> str:
        """The text so far (for a finished stream: all of it)."""
        return self.final if self.final is not None else "".join(self._pieces) + self._held + self._pending()

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        if self.final is not None:
            return ""
        new = self._decode_new()
        return self._release(self._held + new, final=False)

    def finish(self) -> str:
        """The rest of the text once generation is over."""
        if self.final is not None:
            return ""
        rest = self._held + self._pending()
        self._read, self._shown = len(self.ids), 0
        return self._release(rest, final=True)

    # -- decoding ------------------------------------------------------------------------------
    def _pending(self) -> str:
        """Text of the tokens past `_read` not returned yet (it may end in an incomplete character)."""
        if self._read == len(self.ids):
            return ""
        before = self.codec.decode(self.ids[self._prefix:self._read])
        return self.codec.decode(self.ids[self._prefix:])[len(before) + self._shown:]

    def _decode_new(self) -> str:
        """Newly final text of the tokens past `_read`; advances the window at clean points."""
        n = len(self.ids)
        if n == self._read:
            return ""
        before = self.codec.decode(self.ids[self._prefix:self._read])
        new = self.codec.decode(self.ids[self._prefix:])[len(before):]  # text of ids[_read:]
        if not new.endswith("\ufffd"):
            return self._advance(n, new)
        # an incomplete character (<= 3 bytes, so <= 3 tokens): commit up to the token before it
        for end in range(n - 1, max(self._read, n - 4), -1):
            head = self.codec.decode(self.ids[self._prefix:end])[len(before):]
            if head and not head.endswith("\ufffd"):
                out, new = self._advance(end, head), new[len(head):]
                break
        else:
            out = ""
            if n - self._read > self.HOLD_TOKENS:  # bytes that never complete: commit all but 3 tokens
                head = self.codec.decode(self.ids[self._prefix:n - 3])[len(before):]
                out, new = self._advance(n - 3, head), new[len(head):]
        visible = new.rstrip("\ufffd")  # what precedes the incomplete character is final
        out += visible[self._shown:]
        self._shown = max(self._shown, len(visible))
        return out

    def _advance(self, end: int, text: str) -> str:
        """Commit tokens up to `end` (a clean point), whose text past `_read` is `text`."""
        out = text[self._shown:]
        self._shown = max(0, self._shown - len(text))
        self._prefix, self._read = max(self._read, end - self.PREFIX_TOKENS), end
        return out

    # -- stop strings --------------------------------------------------------------------------
    def _release(self, text: str, final: bool) -> str:
        """`text` = held tail + new text: return what is final, hold back what may begin a stop."""
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if cuts:
            out, self._held = text[:min(cuts)], ""
            self._pieces.append(out)
            self.final = "".join(self._pieces)
            return out
        hold = 0 if final else self._stop_prefix_len(text)
        out, self._held = text[:len(text) - hold], text[len(text) - hold:]
        self._pieces.append(out)
        return out

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            start = max(0, len(text) - len(s) + 1)
            i = text.find(s[0], start)
            while i >= 0:  # the first candidate that fits is the longest
                if len(text) - i > best and s.startswith(text[i:]):
                    best = len(text) - i
                    break
                i = text.find(s[0], i + 1)
        return best
