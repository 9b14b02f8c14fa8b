"""Suite `train-memory` (docs/BENCHMARKS.md, "train-memory"): the peak memory of one training step of a
P-EAGLE head against the tokens per sequence, with sequence partitions (`--segment-tokens`, default
1024) and without (the whole sequence in one forward+backward).

Each setting runs in a child process of its own (`python -m peagle_trt.bench.train_memory --worker
JSON`): the target's checkpoint (default the cached SmolLM2-135M-Instruct: its real shapes, its
lm_head rows over a draft vocabulary of --draft-vocab ids) and a head built as
`peagle-trt train` builds it (peagle_trt/train/loop.py `build_head`: --depths 5, fc norms, frozen
embeddings); the sequence's target features are random (the target's pass is not measured: it is
made once per sequence and cached, peagle_trt/train/data.py `FeatureCache`), kept as the cache
keeps them (float16 normed hidden state and taps); then one `train_step` (features, COD, every
partition's forward+backward) and one AdamW step. Measured: the process's peak resident set during
the step over its resident set before it (Linux VmHWM, reset through /proc/self/clear_refs), and the
step's CPU seconds (one thread; not a speed figure; --smoke runs the settings in this process). The
flat (unpartitioned) setting is run only up to --flat-max tokens: its deep group attends N x 2.8N
under an explicit mask (gigabytes at 8K).

    peagle-trt bench train-memory [--target smollm2] [--lengths 1024,2048,4096,8192] [--segment-tokens 1024]
                                  [--flat-max 4096] [--plot docs/img/bench_train_memory.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, int_list, machine, options, progress, records

SMOKE = {"lengths": "48,96", "segment_tokens": 32, "flat_max": 48, "draft_vocab": 64}


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="tokens per sequence (default: %(default)s)")
    p.add_argument("--segment-tokens", type=int, default=1024, help="partition size (default: %(default)s)")
    p.add_argument("--flat-max", type=int, default=4096,
                   help="run the unpartitioned step up to this many tokens (default: %(default)s)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary (default: %(default)s)")
    p.add_argument("--plot", type=Path, default=None, help="also save the plot here (e.g. docs/img/...)")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (the suite measures on Linux)")


def worker(spec: dict) -> dict:
    """One training step at spec's length and partitioning, in this (fresh) process: its peak memory."""
    import time

    import torch

    from peagle_trt.checkpoint import load_target
    from peagle_trt.models.target import TargetModel
    from peagle_trt.train import data as D
    from peagle_trt.train.config import TrainConfig
    from peagle_trt.train.loop import build_head, train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ckpt = load_target(Path(spec["target"]))
    tc = ckpt.config
    taps = tuple(tc.default_taps)
    target = TargetModel.from_tensors(tc, ckpt.tensors, taps, torch.device("cpu"), torch.float32, "target")
    n = spec["length"]
    cfg = TrainConfig(target=Path(spec["target"]), output=Path("."), text=("x",), depths=5, fc_norm=True,
                      freeze_embeddings=True, draft_vocab=spec["draft_vocab"], batch=1, seq_len=n,
                      segment_tokens=spec["segment_tokens"], mask_token_id=0)
    draft_ids = torch.randperm(tc.vocab_size)[:spec["draft_vocab"]].sort().values
    head, _ = build_head(cfg, ckpt, taps, 0, draft_ids)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, tc.vocab_size, (n,))
    normed = (torch.randn(n, tc.hidden_size) * 2).half()  # as FeatureCache keeps a pass: float16
    aux = (torch.randn(n, len(taps) * tc.hidden_size) * 3).half()

    class Cache:  # FeatureCache's interface over the one random pass
        def batch(self, batch: list) -> list:
            return [D.features(target, b_ids, sup, normed, aux, draft_ids) for _, b_ids, sup in batch]

    corpus = D.Corpus([ids], [torch.ones(n, dtype=torch.bool)], windowed=False)
    gen = torch.Generator().manual_seed(1)
    del ckpt
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    before = _rss_kib("VmRSS")
    c0, w0 = time.process_time(), time.perf_counter()
    loss, _, _, supervised = train_step(head, Cache(), corpus, cfg, gen, 0, cfg.depths)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    peak = _rss_kib("VmHWM")
    return {"length": n, "segment_tokens": spec["segment_tokens"], "rss_before_mib": round(before / 1024, 1),
            "step_peak_mib": round((peak - before) / 1024, 1), "elements": supervised, "loss": round(loss, 4),
            "cpu_s": round(time.process_time() - c0, 2), "wall_s": round(time.perf_counter() - w0, 2)}


def measure(spec: dict, inline: bool = False) -> dict:
    """The worker's result, from a child process (in this one when `inline`: --smoke)."""
    if inline:
        return worker(spec)
    done = subprocess.run([sys.executable, "-m", "peagle_trt.bench.train_memory", "--worker", json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"train-memory worker {spec} failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label in dict.fromkeys(r["partitions"] for r in rows):
        mine = [r for r in rows if r["partitions"] == label]
        ax.plot([r["tokens"] for r in mine], [r["step_peak_mib"] for r in mine], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("peak RSS of one training step over before (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    target = args.target  # resolved by run_suite (harness.model_dir)
    lengths, seg = int_list(args.lengths), args.segment_tokens
    mach = machine(args.smoke)
    rows = []
    for n in lengths:
        for segment_tokens in (seg, None):
            if segment_tokens is None and n > args.flat_max:
                continue
            label = f"partitions of {seg}" if segment_tokens else "none (flat)"
            progress(f"[train-memory] {n} tokens, partitions: {label}")
            got = measure({"target": str(target), "length": n, "segment_tokens": segment_tokens,
                           "draft_vocab": args.draft_vocab}, inline=args.smoke)
            rows.append({"tokens": n, "partitions": label, **{k: got[k] for k in (
                "step_peak_mib", "rss_before_mib", "elements", "cpu_s")}})
    part = [r for r in rows if r["partitions"].startswith("partitions")]
    for r in rows:
        first = next(x for x in rows if x["partitions"] == r["partitions"])
        r["over_shortest"] = round(r["step_peak_mib"] / max(first["step_peak_mib"], 1e-9), 2)
    spread = round(max(r["step_peak_mib"] for r in part) / max(min(r["step_peak_mib"] for r in part), 1e-9), 2)
    title = f"one training step's peak memory (P-EAGLE head, depth 5, draft vocab {args.draft_vocab})"
    sections = [f"Target {Path(target).name} (its shapes and lm_head rows; random float16 features, the target's "
                "pass excluded), one child process per setting, one thread. step_peak_mib: peak RSS during "
                "`train_step` + AdamW over the RSS before it.\n\n"
                + records(rows, ["tokens", "partitions", "step_peak_mib", "over_shortest", "rss_before_mib",
                                 "elements", "cpu_s"], 2)]
    out_dir = getattr(args, "output_dir", None)
    for path in [p for p in (args.plot, Path(out_dir) / "bench_train_memory.png" if out_dir else None) if p]:
        plot(rows, Path(path), title)
    if out_dir:
        sections.append("bench_train_memory.png")
    return finish(args, "train-memory: one training step's peak memory against tokens per sequence", sections,
                  {"rows": rows, "partitioned_spread": spread, "segment_tokens": seg, "target": str(target)},
                  [Figure(f"training step peak memory with partitions of {seg}, longest over shortest "
                          f"({lengths[0]}-{lengths[-1]} tokens)", spread, "x", "<= 1.3x", 2)], mach)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(worker(json.loads(sys.argv[2]))))
