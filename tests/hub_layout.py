"""A Hugging Face hub cache laid out as huggingface_hub lays it, for tests that must not touch the
network: `models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
refs/<branch or tag>}`. `offline_hub(monkeypatch, cache)` points the environment at it with
HF_HUB_OFFLINE=1 and an endpoint nothing listens on, so a request, if any were made, would fail.
Used by tests/test_hub.py and tests/serve/test_vllm_serve.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing answers there


def put_model(cache: Path, repo_id: str, src: Path, refs: tuple[str, ...] = ("main",),
              files: list[str] | None = None) -> Path:
    """Copy the files of `src` (or `files` of it) into `cache` as the snapshot of `repo_id` at a
    commit derived from their contents, `refs` pointing at it; returns the snapshot folder."""
    names = sorted(files if files is not None else [p.name for p in Path(src).iterdir() if p.is_file()])
    commit = hashlib.sha1(repo_id.encode() + b"".join((Path(src) / n).read_bytes() for n in names)).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name in names:
        data = (Path(src) / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def offline_hub(monkeypatch, cache: Path) -> None:
    """The environment of a machine whose Hugging Face cache is `cache`, offline, with no token."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(cache.parent / "hf-home"))  # no stored token
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub read HF_HOME when imported: its stored-token path must not be this machine's
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(cache.parent / "hf-home" / "token"))
