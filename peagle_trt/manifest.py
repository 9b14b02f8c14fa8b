"""manifest.json: what an artifact directory holds (sha256 of every file) and how it was made.

Writers call `write_manifest(root, files, info)` last; loaders call `verify_manifest(root)` first
and refuse a directory whose files were edited, truncated, added to or removed. `foreign_files(dir)`
says whether a directory is a previous peagle-trt output, the only kind `--force` may replace
(peagle_trt/atomic.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from peagle_trt import __version__
from peagle_trt.errors import ManifestError

MANIFEST = "manifest.json"


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(root: Path, info: dict) -> dict:
    # every file but this manifest itself: a nested one (an export's, inside a model) is listed too
    files = {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*"))
             if p.is_file() and p != root / MANIFEST and "__pycache__" not in p.parts}
    manifest = {"format": 1, "peagle_trt_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verify_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{root}: no {MANIFEST}; this is not a directory written by "
                            "`peagle-trt build` (rebuild it)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ManifestError(f"{path}: unreadable manifest ({exc}); rebuild the repository") from exc
    for rel, digest in files.items():
        f = root / rel
        if not f.is_file():
            raise ManifestError(f"{root}: {rel} is listed in {MANIFEST} but missing; rebuild the repository")
        if sha256(f) != digest:
            raise ManifestError(f"{root}: {rel} does not match its hash in {MANIFEST} (edited or "
                                "corrupted after the build); rebuild the repository")
    return manifest


def _read_own_manifest(path: Path) -> dict | None:
    """The parsed manifest at `path` if it is one peagle-trt wrote, else None."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    ours = isinstance(manifest, dict) and "peagle_trt_version" in manifest
    return manifest if ours and isinstance(manifest.get("files"), dict) else None


def foreign_files(root: Path, limit: int = 5) -> list[str]:
    """Why `root` is not a previous peagle-trt output: up to `limit` reasons; [] when it is one.

    An output is a directory whose every file is listed in a peagle-trt manifest.json at its top or
    one level down (a model repository keeps it in the model directory), or is such a manifest.
    __pycache__ folders (written when Triton imports model.py) are ignored. Reads the manifests and
    file names, never file contents."""
    root = Path(root)
    owned: set[Path] = set()
    subdirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.is_symlink())
    for path in [root / MANIFEST] + [d / MANIFEST for d in subdirs]:
        manifest = _read_own_manifest(path) if path.is_file() else None
        if manifest is not None:
            owned.add(path)
            owned.update(path.parent / rel for rel in manifest["files"])
    if not owned:
        return [f"it holds no {MANIFEST} written by peagle-trt"]
    foreign = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]  # not walked: listed or foreign
        for name in sorted(filenames) + sorted(links):
            path = Path(dirpath) / name
            if path not in owned:
                foreign.append(f"{path.relative_to(root)} is not listed in its {MANIFEST}")
                if len(foreign) >= limit:
                    return foreign
    return foreign
