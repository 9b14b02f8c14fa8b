"""`bench gpu`'s peers: the batch-1 decode of two PyTorch stacks timed beside ours in the same run, at
the same shapes (the target's config, random weights, bf16 on a GPU, the same context), contenders
alternated round by round (peagle_trt/bench/harness.py `alternate`); each one's step time, tokens/s
and MBU (the same bytes per step as ours over the run's copy bandwidth) and its ratio to ours.

- `gpt-fast` (github.com/pytorch-labs/gpt-fast, from a checkout the user names: `bench gpu
  --gpt-fast DIR`, never copied into this project): its own model file (`model.py`: Transformer,
  ModelArgs; `llama-3.1-8b` from its config registry, checked against our shape) and its own decode
  loop (`generate.py`: `decode_n_tokens` over `decode_one_token`, compiled as its `main` compiles it,
  `torch.compile(mode="reduce-overhead", fullgraph=True)`, under the inductor settings generate.py
  sets on import, which apply to its compile only). Its sampler at temperature 0 (its greedy).
  generate.py imports its tokenizer module, so sentencepiece and tiktoken must be importable.
- `transformers`: `LlamaForCausalLM.generate(cache_implementation="static", do_sample=False)`, which
  compiles the forward itself on CUDA (its CompileConfig: mode "reduce-overhead"): what a PyTorch user
  tries first. Its decode time per token is the difference of two generate calls (N2 and N1 new
  tokens after the same prompt: the prefill and set-up cancel) over N2 - N1.

`compile`: "auto" (on a GPU: as above; on a CPU: off, eager, the label says so), "reduce-overhead",
"default" (inductor without CUDA graphs: the CPU-friendly mode that checks the graphs compile
whole), or "off". A peer that cannot run (no checkout, an import, a compile, an out-of-memory error)
is a row with its error, never left out. Tested: tests/bench/test_bench_gpu_smoke.py (the
transformers peer and a missing checkout, on the CPU); the gpt-fast rehearsal on the CPU is in
docs/BENCHMARKS.md, "gpu".
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from peagle_trt.architecture import TargetConfig
from peagle_trt.bench.harness import alternate, device_clock, progress, summary
from peagle_trt.errors import ConfigError

COMPILE_MODES = ("auto", "reduce-overhead", "default", "off")
GPT_FAST_NAMES = {"llama-3.1-8b": "llama-3.1-8b"}  # our target shape -> gpt-fast's config name


def resolve_compile(mode: str, device: torch.device) -> str:
    """The compile mode a peer runs: "auto" is "reduce-overhead" on CUDA, "off" elsewhere."""
    if mode not in COMPILE_MODES:
        raise ConfigError(f"--peer-compile {mode!r}: expected one of {COMPILE_MODES}")
    return ("reduce-overhead" if device.type == "cuda" else "off") if mode == "auto" else mode


def new_generation() -> None:
    """A new step for torch.compile's CUDA-graph trees (two compiled peers alternate in one process)."""
    if torch.cuda.is_available():
        torch.compiler.cudagraph_mark_step_begin()


def randomize_params(model: torch.nn.Module) -> torch.nn.Module:
    """N(0, 0.02) matrices, unit vectors (norms): the distribution of our own random targets."""
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
    return model.eval().requires_grad_(False)


# -- gpt-fast -----------------------------------------------------------------------------------------

def load_gpt_fast(checkout: Path | None) -> tuple:
    """(model module, generate module, the inductor settings generate.py sets) from a gpt-fast
    checkout. The settings are undone for the rest of the process (they apply to gpt-fast's compile)."""
    if checkout is None:
        raise ConfigError("no gpt-fast checkout given: pass --gpt-fast DIR, a clone of "
                          "https://github.com/pytorch-labs/gpt-fast (never copied into this project)")
    root = Path(checkout).resolve()
    missing = [f for f in ("model.py", "generate.py") if not (root / f).is_file()]
    if missing:
        raise ConfigError(f"--gpt-fast {checkout}: expected a gpt-fast checkout holding model.py and generate.py, "
                          f"{'found no such folder' if not root.is_dir() else 'missing ' + ', '.join(missing)}")
    for name in ("model", "tokenizer"):  # generate.py imports them by these top-level names
        have = sys.modules.get(name)
        if have is not None and Path(getattr(have, "__file__", "") or "").resolve().parent != root:
            raise ConfigError(f"a module named {name!r} from {getattr(have, '__file__', '?')} is already imported; "
                              "gpt-fast's generate.py imports its own under that name: run the peer in a fresh process")
    import torch._inductor.config as inductor

    before = inductor.get_config_copy()
    sys.path.insert(0, str(root))
    try:
        spec = importlib.util.spec_from_file_location("gpt_fast_generate", root / "generate.py")
        generate = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generate)
    finally:
        sys.path.remove(str(root))
    after = inductor.get_config_copy()
    settings = {k: v for k, v in after.items() if before.get(k) != v}
    inductor.load_config({k: before[k] for k in settings})
    return sys.modules["model"], generate, settings


def checkout_commit(root: Path) -> str | None:
    """The checkout's git commit, when it is a git clone."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:  # no git on this machine
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def gpt_fast_args(model_mod, c: TargetConfig, name: str, max_seq: int):
    """gpt-fast's ModelArgs for our target `c`: its registry's config for a real shape (checked equal
    to ours), else one built from ours (the CPU smoke's tiny shape)."""
    real = GPT_FAST_NAMES.get(name)
    if real is None:
        return model_mod.ModelArgs(block_size=max_seq, vocab_size=c.vocab_size, n_layer=c.num_layers,
                                   n_head=c.num_heads, dim=c.hidden_size, intermediate_size=c.intermediate_size,
                                   n_local_heads=c.num_kv_heads, rope_base=c.rope.theta, norm_eps=c.rms_norm_eps)
    args = model_mod.ModelArgs.from_name(real)
    theirs = (args.vocab_size, args.n_layer, args.n_head, args.n_local_heads, args.dim, args.head_dim,
              args.intermediate_size, float(args.rope_base))
    ours = (c.vocab_size, c.num_layers, c.num_heads, c.num_kv_heads, c.hidden_size, c.head_dim,
            c.intermediate_size, c.rope.theta)
    if theirs != ours:
        raise ConfigError(f"gpt-fast's {real!r} config {theirs} is not our {name} shape {ours} "
                          "(vocab, layers, heads, KV heads, hidden, head dim, intermediate, rope theta)")
    return args


def gpt_fast_peer(checkout: Path | None, c: TargetConfig, name: str, device: torch.device, dtype: torch.dtype,
                  context: int, n: int, compile_mode: str) -> tuple[dict, Callable, Callable]:
    """(info, one timed call: n tokens decoded from position `context` by gpt-fast's decode loop, its
    first call: the compile under generate.py's inductor settings)."""
    model_mod, gen, settings = load_gpt_fast(checkout)
    info = {"checkout_commit": checkout_commit(Path(checkout)), "inductor_settings": settings,
            "compile": compile_mode, "sampling": "temperature 0 (its greedy), top_k None"}
    max_seq = context + n + 8
    with torch.device("meta"):
        model = model_mod.Transformer(gpt_fast_args(model_mod, c, name, max_seq))
    model = randomize_params(model.to(dtype=dtype).to_empty(device=device))
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq)
    if compile_mode != "off":  # as generate.py's main: the module's decode_one_token replaced by its compiled self
        gen.decode_one_token = torch.compile(gen.decode_one_token, mode=compile_mode, fullgraph=True)
    token = torch.zeros(1, 1, dtype=torch.int, device=device)

    def call():
        new_generation()
        with torch.no_grad():
            pos = torch.tensor([context], device=device, dtype=torch.int)
            return gen.decode_n_tokens(model, token, pos, n, temperature=0.0, top_k=None)

    import torch._inductor.config as inductor

    def first_call():  # the compile, under generate.py's inductor settings
        with inductor.patch(settings) if compile_mode != "off" else nullcontext():
            return call()
    return info, call, first_call


# -- transformers -------------------------------------------------------------------------------------

def hf_config(c: TargetConfig, max_positions: int):
    from transformers import LlamaConfig

    rope = {"rope_type": c.rope.rope_type, "rope_theta": c.rope.theta, **c.rope.params}
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                       num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                       max_position_embeddings=max(max_positions, c.rope.max_position_embeddings),
                       rope_parameters=rope, tie_word_embeddings=c.tie_word_embeddings, pad_token_id=0,
                       bos_token_id=None, eos_token_id=None)


def transformers_peer(c: TargetConfig, device: torch.device, dtype: torch.dtype, context: int, n: int,
                      compile_mode: str) -> tuple[dict, dict]:
    """(info, {"short": generate N1 tokens, "long": generate N2 = N1 + n tokens}) after one prompt."""
    import transformers
    from transformers import CompileConfig, LlamaForCausalLM

    n1 = max(4, n // 4)
    with torch.device(device):
        model = randomize_params(LlamaForCausalLM._from_config(hf_config(c, context + n1 + n + 8), dtype=dtype))
    ids = torch.randint(0, c.vocab_size, (1, context), device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, cache_implementation="static", eos_token_id=None,
              pad_token_id=0)
    if compile_mode == "off":
        kw["disable_compile"] = True
    elif compile_mode != "reduce-overhead" or device.type != "cuda":  # explicit: another mode, or not on CUDA
        cc = CompileConfig(mode=None if compile_mode == "default" else compile_mode)
        cc._compile_all_devices = True  # transformers' own switch to compile off CUDA
        kw["compile_config"] = cc

    def gen(tokens: int) -> Callable[[], object]:
        def call():
            new_generation()
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        return call
    info = {"transformers": transformers.__version__, "compile": compile_mode, "tokens": [n1, n1 + n],
            "method": "generate(cache_implementation='static', do_sample=False); per token = (t(N2) - t(N1)) / "
                      "(N2 - N1)", "model": model}
    return info, {"long": gen(n1 + n), "short": gen(n1)}  # long first: its static cache serves both


# -- the comparison -----------------------------------------------------------------------------------

def compare(ours: Callable[[], object], n: int, c: TargetConfig, name: str, device: torch.device,
            dtype: torch.dtype, context: int, step_bytes: float, copy_gbs: float | None, gpt_fast: Path | None,
            compile_mode: str, rounds: int, label: str, deadline: float | None = None) -> list[dict]:
    """Rows: ours (`ours()` decodes n tokens, one step each) and each peer, alternated; a peer that
    failed to set up, to warm up or in the timed rounds, or that would start after `deadline`
    (time.monotonic()), is a row with its error. transformers is set up first: gpt-fast's compile (with
    its coordinate-descent tuning) is the longer."""
    mode = resolve_compile(compile_mode, device)
    contenders: dict[str, Callable[[], object]] = {"ours": ours}
    rows = {"ours": {"contender": "peagle-trt", "how": label, "compiled": False,
                     "compile": "none (CUDA graphs of its own)" if "graphs" in label else "none"}}

    def guarded(peer: str, fn: Callable[[], object]) -> Callable[[], object]:
        def call():  # a peer failing in the timed rounds: its row says why, the others' rounds go on
            if rows[peer].get("error"):
                return None
            try:
                return fn()
            except Exception as exc:
                rows[peer]["error"] = f"in the timed rounds: {type(exc).__name__}: {str(exc)[:400]}"
                progress(f"[bench gpu] peer {peer}: {rows[peer]['error']}")
        return call

    def setup(peer: str, make: Callable[[], tuple]) -> None:
        t0 = time.perf_counter()
        if deadline is not None and time.monotonic() > deadline:
            rows[peer] = {"contender": peer, "compile": mode, "error": "not run: the run's --budget-s was spent"}
            return progress(f"[bench gpu] peer {peer}: {rows[peer]['error']}")
        progress(f"[bench gpu] peer {peer}: set-up and warm-up ({mode}) ...")
        try:
            info, calls, first = make()
            first()  # the compile (and capture) happens here, timed apart
            first()  # and whatever a second call still sets up (a cache sized by the first, re-recorded graphs)
            rows[peer] = {"contender": peer, **{k: v for k, v in info.items() if k != "model"},
                          "compiled": mode != "off", "warm_s": round(time.perf_counter() - t0, 1)}
            if "model" in info:  # transformers compiles inside generate, or not: what it did
                rows[peer]["compiled"] = hasattr(info["model"], "_compiled_call")
            contenders.update({key: guarded(peer, call) for key, call in calls.items()})
        except Exception as exc:  # a peer that cannot run is reported with its error, the others still run
            rows[peer] = {"contender": peer, "compile": mode, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            progress(f"[bench gpu] peer {peer}: cannot run: {rows[peer]['error']}")

    def hf():
        info, calls = transformers_peer(c, device, dtype, context, n, mode)
        return info, {f"transformers:{k}": v for k, v in calls.items()}, lambda: [f() for f in calls.values()]

    def gpt():
        info, call, first = gpt_fast_peer(gpt_fast, c, name, device, dtype, context, n, mode)
        return info, {"gpt-fast": call}, first

    setup("transformers", hf)
    setup("gpt-fast", gpt)
    t = alternate(contenders, rounds, 1, clock=device_clock)
    steps = per_token({k: summary(v, 1e3)["median"] for k, v in t.items()}, rows, n)
    floor = step_bytes / (copy_gbs * 1e6) if copy_gbs else None
    return [{**row, "context": context, "step_ms": steps.get(peer), "error": row.get("error"),
             "tokens_per_s": 1e3 / steps[peer] if peer in steps else None,
             "mbu": floor / steps[peer] if peer in steps and floor else None,
             "over_ours": steps[peer] / steps["ours"] if peer in steps else None} for peer, row in rows.items()]


def per_token(med: dict, rows: dict, n: int) -> dict:
    """ms per decoded token of each contender that ran clean, from its median ms per call: ours and
    gpt-fast decode n tokens a call; transformers' is the difference of its two generate calls."""
    med = {k: v for k, v in med.items() if not rows[k.split(":")[0]].get("error")}
    steps = {k: med[k] / n for k in ("ours", "gpt-fast") if k in med}
    if "transformers:long" in med:
        n1, n2 = rows["transformers"]["tokens"]
        long, short = med["transformers:long"], med["transformers:short"]
        if long > short:
            steps["transformers"] = (long - short) / (n2 - n1)
        else:  # no time per token to report: say so, not a negative figure
            rows["transformers"]["error"] = (f"generate of {n2} tokens took no longer than of {n1} (medians "
                                             f"{long:.1f} / {short:.1f} ms): noise or a recompile in the timed "
                                             "rounds; more --peer-rounds")
    return steps
