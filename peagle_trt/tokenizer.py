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

    def stream(self, stop: tuple[str, ...] = ()) -> "TextStream":
        return TextStream(self, stop)


class TextStream:
    """Incremental text of a growing list of token ids.

    `push(ids)` returns only text that is final: an incomplete UTF-8 sequence (decoded as U+FFFD)
    and a tail that could still become a stop string are held back. Once a stop string appears,
    the text ends right before it and `stopped` turns true.
    """

    def __init__(self, codec: TextCodec, stop: tuple[str, ...] = ()):
        self.codec, self.stop = codec, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.shown = 0  # characters already returned
        self.final: str | None = None  # the text cut at a stop string

    @property
    def stopped(self) -> bool:
        return self.final is not None

    @property
    def text(self) -> str:
        return self.final if self.final is not None else self.codec.decode(self.ids)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.codec.decode(self.ids)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts and self.final is None:
            self.final = text[:min(cuts)]
        if self.final is not None:
            visible = self.final
        else:
            visible = text.rstrip("\ufffd")
            hold = max((n for s in self.stop for n in range(1, len(s)) if visible.endswith(s[:n])),
                       default=0)
            visible = visible[:len(visible) - hold]
        new = visible[self.shown:]
        self.shown = max(self.shown, len(visible))
        return new

    def finish(self) -> str:
        """The rest of the text once generation is over."""
        text = self.text
        new, self.shown = text[self.shown:], len(text)
        return new
