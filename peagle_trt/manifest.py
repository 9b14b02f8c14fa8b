"""manifest.json: what an artifact directory holds (sha256 of every file) and how it was made.

Writers call `write_manifest(root, files, info)` last; loaders call `verify_manifest(root)` first
and refuse a directory whose files were edited, truncated, added to or removed.
"""

from __future__ import annotations

import hashlib
import json
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
    files = {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*"))
             if p.is_file() and p.name != MANIFEST and "__pycache__" not in p.parts}
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
