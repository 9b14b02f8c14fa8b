"""Structured output under speculation (peagle_trt/speculative/grammar.py) on the tiny checkpoints.

The oracle is constrained target-only decoding written independently of the decoder: transformers'
model, one full forward per token, the grammar's mask applied to the last row, argmax, the token
fed to the matcher. Speculative constrained output must equal it token for token: P-EAGLE and
EAGLE-3 heads (the P-EAGLE head drafts in a reduced vocabulary, mapped back through d2t), a
scripted drafter that is right 70% of the time (so drafts are accepted, rejected, invalid under
the grammar and past its end), K in {1, 3, 7}, adaptive K, plain decoding (K = 0), batches that mix
constrained and free requests, KV preemption; outputs that end by the grammar validate against
their schema (jsonschema). Bad grammars fail alone with the library's reason. With T > 0 the
rejection sampler keeps the constrained distribution (a chi-square check over a Markov target).
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr

from peagle_trt.config import KVLayout, SamplingParams, SpecConfig, StructuredOutput
from peagle_trt.errors import ConfigError, RequestError
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.grammar import Grammars, GrammarState
from tests.helpers import MarkovExecutor, ScriptedDrafter, collect, hf_target, make_decoder

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "structured" / "schemas.json").read_text())
EOS = 0  # the tiny tokenizer's <|endoftext|>
PROMPT = [5, 17, 230, 41, 99, 7]
N = 24
OUTPUTS = {  # name -> StructuredOutput (tiny-model runs: a few of every kind)
    "tool_get_weather": StructuredOutput.from_dict({"json": SCHEMAS["tool_get_weather"]}),
    "array_of_objects": StructuredOutput.from_dict({"json": SCHEMAS["array_of_objects"]}),
    "recursive_tree": StructuredOutput.from_dict({"json": SCHEMAS["recursive_tree"]}),
    "regex": StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
    "choice": StructuredOutput("choice", ("alpha", "beta", "gamma delta")),
    "ebnf": StructuredOutput("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
    "lark": StructuredOutput("grammar", 'start: "x" NUM ("," NUM)*\nNUM: /[0-9]/'),
    "json_object": StructuredOutput("json_object"),
}


@pytest.fixture(scope="module")
def grammars(tiny):
    from transformers import AutoTokenizer

    g = Grammars(AutoTokenizer.from_pretrained(tiny["llama"]), 512)
    yield g
    g.close()


@pytest.fixture(scope="module")
def oracle(tiny, grammars):
    """name -> constrained target-only greedy output of PROMPT (transformers + the matcher)."""
    hf, cache = hf_target(tiny["llama"]), {}

    def run(name: str) -> list[int]:
        if name not in cache:
            m = xgr.GrammarMatcher(grammars.compile(OUTPUTS[name]).result(), override_stop_tokens=[EOS])
            bitmask, ids, out = xgr.allocate_token_bitmask(1, 512), list(PROMPT), []
            with torch.no_grad():
                while len(out) < N and not m.is_terminated():
                    logits = hf(torch.tensor([ids])).logits[0, -1:].float()  # [1, V]
                    m.fill_next_token_bitmask(bitmask)
                    xgr.apply_token_bitmask_inplace(logits, bitmask)
                    token = int(logits.argmax())
                    assert m.accept_token(token)
                    out.append(token)
                    ids.append(token)
            cache[name] = out
        return cache[name]

    return run


REFUSED = {"all_of_merge": "allOf of several", "string_length": "minLength"}  # not enforced by xgrammar: a 400


def constrained(name: str, n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, structured=OUTPUTS[name])


def decoder(tiny, mode: str, k: int, **kw) -> SpecDecoder:
    d = make_decoder(tiny, "llama", {"peagle": "aws", "eagle3": "eagle3", "none": None}[mode], mode, k, **kw)
    d.eos_ids = (EOS,)
    return d


def check_valid(name: str, ids: list[int], tok) -> None:
    """An output that ended by the grammar parses, and validates against its schema."""
    if not ids or ids[-1] != EOS or OUTPUTS[name].kind not in ("json", "json_object"):
        return
    value = json.loads(tok.decode(ids[:-1]))
    if OUTPUTS[name].kind == "json":
        jsonschema.validate(value, SCHEMAS[name])
    else:
        assert isinstance(value, dict)


@pytest.mark.parametrize("mode,k,candidates", [("none", 1, 8), ("peagle", 3, 8), ("peagle", 3, 1), ("eagle3", 3, 8)])
def test_constrained_speculation_equals_constrained_target_only(tiny, grammars, oracle, mode, k, candidates):
    """candidates: the drafter's top ones per depth a constrained request drafts from (1: its top-1
    chain, cut at the first draft the grammar refuses)."""
    d = decoder(tiny, mode, k)
    d.draft_candidates = candidates
    for name in OUTPUTS:
        seq = generate(d, PROMPT, constrained(name), grammars=grammars)
        assert seq.output == oracle(name), (name, mode, k)
        assert seq.finish_reason == ("stop" if seq.output[-1] == EOS else "length")


@pytest.mark.parametrize("k", [1, 3, 7])
def test_accepted_rejected_and_invalid_drafts_stay_exact(tiny, grammars, oracle, k):
    """A drafter right 70% of the time (wrong drafts are mostly invalid under the grammar; past
    the reference's end it drafts EOS again): the accept path runs, output stays exact."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    refs = {tuple(PROMPT): None}
    drafter = ScriptedDrafter(refs, 512, lambda i, rng: bool(torch.rand((), generator=rng) < 0.7), seed=k)
    d = decoder(tiny, "peagle", k, proposer=drafter)
    for name in OUTPUTS:
        refs[tuple(PROMPT)] = oracle(name)
        seq = generate(d, PROMPT, constrained(name), grammars=grammars)
        assert seq.output == oracle(name), (name, k)
        check_valid(name, seq.output, tok)
        if len(seq.output) > 4:
            assert seq.stats.accepted > 0, name  # drafts were accepted under the masks


def test_adaptive_k_and_a_k_schedule_stay_exact(tiny, grammars, oracle):
    """K chosen per step (adaptive: K = 0 plain steps and probes included; a schedule by batch)."""
    for spec in (SpecConfig("peagle", 3, (), True), SpecConfig("peagle", 3, ((1, 1, 2), (2, 8, 0)))):
        d = decoder(tiny, "peagle", 3, spec=spec)
        for name in ("tool_get_weather", "regex", "lark"):
            assert generate(d, PROMPT, constrained(name), grammars=grammars).output == oracle(name), (spec, name)


def test_batch_mix_of_constrained_and_free_requests_under_preemption(tiny, grammars, oracle):
    free = [[3, 4, 5, 6, 7], [200, 201, 202]]
    ref_free = [generate(decoder(tiny, "peagle", 3), p, SamplingParams(max_tokens=20, ignore_eos=True)).output
                for p in free]
    names = ["tool_get_weather", "regex", "choice", "ebnf"]
    kv = KVLayout(num_blocks=14, max_len=96, max_batch=6, block_size=8, max_rows=16)  # preempts
    sched = Scheduler(decoder(tiny, "peagle", 3, kv=kv), prefill_chunk=16, grammars=grammars)
    outputs: dict = {}
    for i, name in enumerate(names):
        sched.add(Request(name, PROMPT, constrained(name), collect(outputs)))
        if i < len(free):
            sched.add(Request(f"free{i}", free[i], SamplingParams(max_tokens=20, ignore_eos=True), collect(outputs)))
    sched.run_until_idle()
    for name in names:
        assert outputs[name]["ids"] == oracle(name) and outputs[name]["final"] == 1, name
    for i, ref in enumerate(ref_free):
        assert outputs[f"free{i}"]["ids"] == ref
    assert sched.blocks.stats.preemptions > 0


def test_constrained_requests_draft_chains_beside_free_trees(tiny, grammars, oracle):
    """A server verifying draft trees: constrained requests draft a chain (their masks follow one
    path) and stay equal to the constrained reference; free requests in the same batches keep
    their trees and equal the chain decoder's output."""
    free = [[3, 4, 5, 6, 7], [200, 201, 202]]
    ref_free = [generate(decoder(tiny, "peagle", 3), p, SamplingParams(max_tokens=20, ignore_eos=True)).output
                for p in free]
    spec = SpecConfig("peagle", 3, tree_budget=6)
    sched = Scheduler(decoder(tiny, "peagle", 3, spec=spec, slots=4), prefill_chunk=16, grammars=grammars)
    outputs: dict = {}
    names = ["tool_get_weather", "ebnf"]
    for i, name in enumerate(names):
        sched.add(Request(name, PROMPT, constrained(name), collect(outputs)))
        sched.add(Request(f"free{i}", free[i], SamplingParams(max_tokens=20, ignore_eos=True), collect(outputs)))
    sched.run_until_idle()
    for name in names:
        assert outputs[name]["ids"] == oracle(name), name
        st = outputs[name]["stats"]
        assert st.drafted <= 3 * st.steps  # chains of at most K = 3
    for i, ref in enumerate(ref_free):
        assert outputs[f"free{i}"]["ids"] == ref
        st = outputs[f"free{i}"]["stats"]
        assert st.drafted > 3 * st.steps  # trees of more nodes than K


def test_a_failed_batch_step_rolls_the_matchers_back(tiny, grammars, oracle):
    """A fault in drafting, after the verify committed tokens and advanced the matchers: the
    scheduler undoes the step and retries each request alone; the constrained ones end exact."""
    from tests.faults.test_requests import FaultyExecutor

    d = decoder(tiny, "peagle", 3, slots=3)
    sched = Scheduler(d, prefill_chunk=16, grammars=grammars)
    outputs: dict = {}
    victim = Request("victim", [7, 8, 9, 10], SamplingParams(max_tokens=20, ignore_eos=True), collect(outputs))
    faulty = FaultyExecutor(d.ex, ("draft_parallel", "draft_parallel_top"), 3,  # alone / beside constrained ones
                            lambda: victim.seq.blocks[0][0] if victim in sched.running else None)
    d.ex = d.proposer.ex = faulty
    for name in ("tool_get_weather", "regex"):
        sched.add(Request(name, PROMPT, constrained(name), collect(outputs)))
    sched.add(victim)
    sched.run_until_idle()
    assert outputs["victim"]["reason"] == "error" and faulty.calls >= 3
    for name in ("tool_get_weather", "regex"):
        assert outputs[name]["ids"] == oracle(name), name


def test_onnxruntime_backend_constrained_speculation_equals_target_only(tiny, grammars):
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.executors.onnxruntime import OrtExecutor

    spec, none = SpecConfig("peagle", 3), SpecConfig("none", 3)
    target, drafter = load_pair(tiny["llama"], tiny["aws"], spec).build()
    spec_d = SpecDecoder(OrtExecutor.from_models(target, drafter, spec, 1, 96), spec, (EOS,))
    plain = SpecDecoder(OrtExecutor.from_models(target, None, None, 1, 96), none, (EOS,))
    for name in ("tool_get_weather", "regex", "lark"):
        want = generate(plain, PROMPT, constrained(name), grammars=grammars).output
        assert generate(spec_d, PROMPT, constrained(name), grammars=grammars).output == want, name


def test_every_fixture_schema_compiles_and_its_output_validates(tiny, grammars):
    """Every fixture schema compiles, or is refused with the reason when the grammar would not
    enforce it (REFUSED); the tiny target's constrained output (random weights: any byte the
    grammar allows, control characters included) parses and validates when it ends by the grammar."""
    from transformers import AutoTokenizer

    tok, d, ended = AutoTokenizer.from_pretrained(tiny["llama"]), decoder(tiny, "none", 1), 0
    assert len(SCHEMAS) >= 30
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        structured = StructuredOutput.from_dict({"json": schema})
        if name in REFUSED:
            with pytest.raises(RequestError, match=REFUSED[name]):
                grammars.compile(structured).result()
            continue
        seq = generate(d, PROMPT, SamplingParams(max_tokens=96, structured=structured), grammars=grammars)
        if seq.finish_reason == "stop":
            ended += 1
            jsonschema.validate(json.loads(tok.decode(seq.output[:-1])), schema)
    assert ended >= 20, ended


def test_a_length_limited_string_takes_no_raw_control_character(tiny, grammars):
    """xgrammar 0.2.8 writes a string with maxLength as characters that include raw U+0000..U+001F
    (invalid JSON: seen through Dynamo's frontend); grammar.py's class excludes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    m = xgr.GrammarMatcher(grammars.compile(OUTPUTS["tool_get_weather"]).result())
    assert all(m.accept_token(t) for t in tok.encode('{"city": "P', add_special_tokens=False))
    for c in ("\x00", "\x1c", "\t"):
        assert not m.accept_token(tok.convert_tokens_to_ids(tok.tokenize(c)[0])), repr(c)
    assert all(m.accept_token(t) for t in tok.encode('aris", "unit": "celsius"}', add_special_tokens=False))
    assert m.accept_token(EOS) and m.is_terminated()


def test_fill_drops_drafts_past_an_invalid_one_and_past_the_end(grammars, tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    ids = tok.encode("beta", add_special_tokens=False)
    state = GrammarState(grammars.compile(OUTPUTS["choice"]).result(), frozenset({EOS}))
    bitmask = xgr.allocate_token_bitmask(12, 512)
    assert state.fill(ids + [EOS, 7, 8], bitmask, 0) == len(ids) + 1  # through EOS, not past it
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    assert state.fill([ids[0], bad, ids[-1]], bitmask, 0) == 1  # nothing past an invalid draft
    assert state.accepted == 0 and state.advance(ids) is None and state.advance([EOS]) == 1
    state.sync(ids[:1])  # a failed step undone: the matcher follows the output back
    assert state.accepted == 1 and state.fill(ids[1:], bitmask, 0) == len(ids) - 1


def test_drafts_follow_the_grammar_and_stop_at_its_end(grammars, tiny):
    """GrammarState.draft: per depth the first candidate the grammar allows after the drafts before
    it; a depth with none allowed, or the end token, ends the chain; the matcher stays put."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    ids = tok.encode("beta", add_special_tokens=False)
    bad = tok.encode("zzz", add_special_tokens=False)[0]
    state = GrammarState(grammars.compile(OUTPUTS["choice"]).result(), frozenset({EOS}))
    assert state.draft([[bad, t] for t in ids] + [[EOS], [7], [8]]) == ids + [EOS]  # masked, up to the end
    assert state.draft([[ids[0]], [bad], [ids[-1]]]) == ids[:1]  # no allowed candidate: the chain ends
    assert state.accepted == 0 and state.draft([[bad, 7]]) == []
    assert state.advance(ids[:1]) is None and state.draft([[t] for t in ids[1:]]) == ids[1:]


BAD = {
    "invalid schema": ({"json": {"type": "objekt"}}, "invalid JSON schema: Unsupported type \"objekt\""),
    "unsupported feature": ({"json": {"type": "array", "uniqueItems": True}}, "does not enforce"),
    "self-referential $ref": ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
                              "no finite JSON value"),
    "required recursion": ({"json": {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}},
                           "no finite JSON value"),
    "external $ref": ({"json": {"type": "object", "properties": {"a": {"$ref": "http://x.test/a"}}}},
                      "only references inside the schema"),
    "dangling $ref": ({"json": {"$ref": "#/$defs/none"}}, "points to nothing"),
    "invalid regex": ({"regex": "[a-"}, "invalid regex: Regex parsing error at position 4"),
    "invalid EBNF": ({"grammar": "root ::= foo"}, "invalid grammar: EBNF parser error"),
    "invalid Lark": ({"grammar": "start: ("}, "invalid grammar"),
}


def test_bad_grammars_fail_alone_with_the_library_reason(tiny, grammars):
    free = [3, 4, 5, 6, 7]
    ref = generate(decoder(tiny, "peagle", 3), free, SamplingParams(max_tokens=12, ignore_eos=True)).output
    sched = Scheduler(decoder(tiny, "peagle", 3, slots=2), grammars=grammars)
    outputs: dict = {}
    sched.add(Request("free", free, SamplingParams(max_tokens=12, ignore_eos=True), collect(outputs)))
    for name, (value, _) in BAD.items():
        sched.add(Request(name, PROMPT, SamplingParams(structured=StructuredOutput.from_dict(value)),
                          collect(outputs)))
    sched.run_until_idle()
    assert outputs["free"]["ids"] == ref
    for name, (_, reason) in BAD.items():
        out = outputs[name]
        assert out["reason"] == "error" and out["ids"] == [] and reason in out["error"], (name, out["error"])
        assert out["error"].startswith("RequestError: "), out["error"]


def test_request_shape_errors_and_limits(tiny):
    for value, reason in [({"choice": ["", ""]}, "non-empty strings"), ({"choice": []}, "non-empty"),
                          ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"guided_json": {}}, "not supported"),
                          ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "must be an object"),
                          ({"json_object": "yes"}, "must be true"), ({"grammar": " "}, "non-empty")]:
        with pytest.raises(RequestError, match=reason):
            StructuredOutput.from_dict(value)
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured=OUTPUTS["regex"])
    small = Grammars(xgr.TokenizerInfo([str(i) for i in range(8)]), 8, max_bytes=16)
    with pytest.raises(RequestError, match="max_grammar_bytes"):
        small.compile(StructuredOutput("regex", "a" * 17))
    with pytest.raises(RequestError, match="no grammar compiler"):  # a scheduler without a tokenizer
        Scheduler(decoder(tiny, "none", 1)).add(Request("r", PROMPT, constrained("regex"), lambda out: None))


def test_a_grammar_slow_to_compile_is_refused_and_others_run(tiny, grammars, monkeypatch):
    release = threading.Event()
    slow = Grammars(grammars._tokenizer, 512, timeout_s=0.3)
    real = slow._compile
    monkeypatch.setattr(slow, "_compile", lambda s: (release.wait(10), real(s))[1])
    free = [3, 4, 5, 6, 7]
    ref = generate(decoder(tiny, "none", 1), free, SamplingParams(max_tokens=6, ignore_eos=True)).output
    sched = Scheduler(decoder(tiny, "none", 1, slots=2), grammars=slow)
    outputs: dict = {}
    sched.add(Request("slow", PROMPT, constrained("regex"), collect(outputs)))
    sched.add(Request("free", free, SamplingParams(max_tokens=6, ignore_eos=True), collect(outputs)))
    sched.run_until_idle()
    release.set()
    assert outputs["free"]["ids"] == ref  # it ran while the grammar compiled, and was not held up
    assert outputs["slow"]["reason"] == "error" and "did not compile within 0.3 s" in outputs["slow"]["error"]
    slow.close()


# -- T > 0: the rejection sampler keeps the constrained distribution -----------------------------

V = 4
T = torch.tensor([[0.50, 0.20, 0.20, 0.10],
                  [0.10, 0.60, 0.25, 0.05],
                  [0.30, 0.30, 0.10, 0.30],
                  [0.05, 0.15, 0.40, 0.40]])
ALLOWED = [(0, 1), (1, 2), (0, 2)]  # the regex below: the tokens allowed at positions 1, 2, 3
MARKOV_INFO = xgr.TokenizerInfo(["a", "b", "c", "d"], stop_token_ids=[3])  # "d": the end token


class RandomDrafter:
    def __init__(self, seed: int):
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, batch, k):
        return torch.randint(0, V, (len(batch.seqs), k), generator=self.rng)

    def propose_top(self, batch, k, width):  # random candidates: the grammar drafts the first it allows
        ids = torch.randint(0, V, (len(batch.seqs), k, width), generator=self.rng)
        return ids, -torch.arange(width, dtype=torch.float32).expand(ids.shape)


def constrained_chi_square(k: int, runs: int) -> tuple[float, float, int]:
    """Chi-square of the first three tokens' counts against the constrained chain probabilities
    (the target's renormalized over the allowed tokens), and against the unmasked ones."""
    g = Grammars(MARKOV_INFO, V)
    params = dict(max_tokens=3, temperature=1.0, structured=StructuredOutput("regex", "[ab][bc][ac]"))
    decoder = SpecDecoder(MarkovExecutor(T), SpecConfig("peagle", k), proposer=RandomDrafter(k))
    decoder.num_spec_tokens = k
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        out = tuple(generate(decoder, [0], SamplingParams(seed=seed, **params), grammars=g).output)
        counts[out] = counts.get(out, 0) + 1
    g.close()
    assert sum(counts.get(s, 0) for s in itertools.product(*ALLOWED)) == runs  # never outside the grammar
    stats = [0.0, 0.0]
    for seq in itertools.product(*ALLOWED):
        p, q, prev = 1.0, 1.0, 0
        for pos, tok in enumerate(seq):
            p *= float(T[prev, tok] / T[prev, list(ALLOWED[pos])].sum())
            q *= float(T[prev, tok])
            prev = tok
        for j, expected in enumerate((runs * p, runs * q)):
            stats[j] += (counts.get(seq, 0) - expected) ** 2 / expected
    return stats[0], stats[1], len(list(itertools.product(*ALLOWED))) - 1


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_keeps_the_constrained_distribution(k):
    """The check passes against the constrained distribution and fails against the unmasked one
    (a sampler that ignored the renormalization, or the masks, would be caught)."""
    constrained, unmasked, df = constrained_chi_square(k, runs=1200)
    limit = df + 4 * (2 * df) ** 0.5  # ~4 sigma above the chi-square mean
    assert constrained < limit < unmasked, (constrained, unmasked, df)


def test_cpu_mask_application_equals_xgrammars_kernel():
    """apply_masks unpacks the bitmask itself on CPU: the same -inf entries as xgrammar's kernel,
    for random masks (rows all allowed included), a vocabulary not a multiple of 32, and rows
    past S left alone."""
    from peagle_trt.speculative.grammar import apply_masks

    gen = torch.Generator().manual_seed(0)
    v = 1000
    bitmask = xgr.allocate_token_bitmask(6 * 4, v).view(6, 4, -1)  # [B, R, W]
    bitmask[:, :3] = torch.randint(-2 ** 31, 2 ** 31 - 1, bitmask[:, :3].shape, generator=gen, dtype=torch.int32)
    bitmask[1] = -1  # a free request
    logits = torch.randn(6, 3, v, generator=gen)  # S = 3 < R
    want = logits.clone().view(18, v)
    xgr.apply_token_bitmask_inplace(want, bitmask[:, :3].reshape(18, -1).contiguous(), vocab_size=v)
    apply_masks(logits, bitmask)
    assert torch.equal(logits.view(18, v), want)
    assert torch.isinf(logits).any() and not torch.isinf(logits[1]).any()
