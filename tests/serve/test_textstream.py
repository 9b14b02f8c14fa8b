"""Streaming detokenization (`TextStream`): exact text, held-back incomplete characters and
stop-string prefixes, and a per-push cost that does not grow with the output (counted in decoded
tokens, not timed)."""

from __future__ import annotations

import random

import pytest

from peagle_trt.make_tiny import make_tokenizer
from peagle_trt.tokenizer import TextCodec, TextStream

TEXTS = ["héllo wörld 😀 ünïcode ∑ 中文字符 ok", "The quick brown fox jumps",
         "def f(x):\n    return x  # ✓"]


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    make_tokenizer(out)
    return TextCodec(out)


@pytest.fixture(scope="module")
def metaspace_codec(tmp_path_factory):
    """A Llama-2 style (SentencePiece) tokenizer: "▁" word marks, the decoder strips the text's
    leading space, so a window decoded alone differs from the same tokens mid-text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    out = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(out)
    return TextCodec(out)


class CharCodec:
    """One token per character (id = code point): exact control over the text; counts the
    tokens it decodes."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return "".join(map(chr, ids))


def feed(stream: TextStream, ids: list[int], rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(ids) and not stream.stopped:
        n = rng.choice([1, 1, 2, 4, 8])
        pieces.append(stream.push(ids[i:i + n]))
        i += n
    return pieces + [stream.finish()]


@pytest.mark.parametrize("kind", ["text", "random ids"])
def test_streamed_pieces_concatenate_to_one_decode_of_all_ids(codec, kind):
    rng = random.Random(3)
    for _ in range(150):
        if kind == "text":  # multi-byte characters split across byte-level tokens
            text = " ".join(rng.choice(TEXTS) for _ in range(4))
            ids = codec.tok(text, add_special_tokens=False)["input_ids"]
        else:  # invalid UTF-8 included
            ids = [rng.randrange(len(codec.tok)) for _ in range(rng.randint(1, 60))]
        stream = codec.stream()
        pieces = feed(stream, ids, rng)
        assert "".join(pieces) == codec.decode(ids) == stream.text
        assert all("\ufffd" not in p for p in pieces[:-1]) or kind == "random ids"


def test_word_boundary_spaces_survive_windowed_decoding(metaspace_codec):
    rng = random.Random(5)
    for _ in range(100):
        text = " ".join(rng.choice(TEXTS + ["  two  spaces", "x"]) for _ in range(4))
        ids = metaspace_codec.tok(text, add_special_tokens=False)["input_ids"]
        stream = metaspace_codec.stream()
        assert "".join(feed(stream, ids, rng)) == metaspace_codec.decode(ids)


def test_incomplete_characters_are_held_back(codec):
    ids = codec.tok("a😀b", add_special_tokens=False)["input_ids"]
    stream = codec.stream()
    shown = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert shown == "a😀b"
    emoji_bytes = [i for i in ids if codec.decode([i]) not in ("a", "b")]
    assert len(emoji_bytes) > 1  # the test exercises a split character
    stream = codec.stream()
    assert stream.push(ids[:1 + len(emoji_bytes) - 1]) == "a"  # the emoji is incomplete: held


def test_stop_string_prefixes_are_held_back_and_the_text_ends_before_the_stop():
    stream = TextStream(CharCodec(), ("world", "xyz"))
    out = [stream.push([ord(c)]) for c in "hello wor"]
    assert "".join(out) == "hello " and not stream.stopped  # "wor" may begin "world"
    assert stream.push([ord("k")]) == "work" and not stream.stopped  # it did not
    assert stream.push([ord(c) for c in "s world and more"]) == "s " and stream.stopped
    assert stream.push([ord("!")]) == "" and stream.finish() == "" and stream.text == "hello works "


def test_a_stop_string_split_across_many_pushes_is_found():
    rng = random.Random(0)
    for _ in range(200):
        stop = "".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 40)))
        stream = TextStream(CharCodec(), (stop, "zz"))
        got = "".join(feed(stream, [ord(c) for c in text], rng))
        cut = text.find(stop)
        assert got == (text[:cut] if cut >= 0 else text), (stop, text)
        assert stream.stopped == (cut >= 0)


def test_the_cost_of_a_push_does_not_grow_with_the_output():
    """2000 single-token pushes with stop strings: every push decodes a bounded window and
    holds back less than the longest stop string (the old stream re-decoded everything)."""
    codec = CharCodec()
    stream = TextStream(codec, ("never appears", "STOP"))
    costs = []
    for i in range(2000):
        before = codec.decoded
        stream.push([ord("abcdefghij"[i % 10])])
        costs.append(codec.decoded - before)
        assert len(stream._held) < len("never appears")
    bound = 2 * (TextStream.PREFIX_TOKENS + 1)
    assert max(costs) <= bound, max(costs)
    assert max(costs[-100:]) <= max(costs[:100])
    assert stream.finish() == "" and stream.text == "abcdefghij" * 200


def test_invalid_bytes_that_never_complete_do_not_grow_the_window(codec):
    """A model emitting bytes that never form a character: the window is let through after
    HOLD_TOKENS tokens, so the per-push cost stays bounded there too."""
    lone = [i for i in range(len(codec.tok)) if codec.decode([i]) == "\ufffd"]
    assert lone
    counting = CountingCodec(codec)
    stream = TextStream(counting, ())
    costs = []
    for i in range(400):
        before = counting.decoded
        stream.push([lone[i % len(lone)]])
        costs.append(counting.decoded - before)
    window = TextStream.PREFIX_TOKENS + TextStream.HOLD_TOKENS + 2
    assert max(costs[-100:]) <= max(costs[:100]) <= window ** 2


class CountingCodec:
    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.inner.decode(ids)
