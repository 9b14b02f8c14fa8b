"""A real tritonserver (bundled in nvidia-pytriton), loopback only, serving models built from the
tiny checkpoints: `peagle` (P-EAGLE, K=3), `peagle_eagle3` (sequential, K=3), `peagle_none` on the
torch backend, and `peagle_ort` (P-EAGLE, K=3) on the onnxruntime backend."""

from __future__ import annotations

import shutil
import socket

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SpecConfig

MODELS = {"peagle": SpecConfig("peagle", 3), "peagle_eagle3": SpecConfig("eagle3", 3),
          "peagle_none": SpecConfig("none", 1)}
BACKENDS = {"peagle_ort": "onnxruntime"}  # the others: torch
MAX_BATCH, MAX_SEQ_LEN = 8, 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def repo(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    for name, spec in {**MODELS, "peagle_ort": SpecConfig("peagle", 3)}.items():
        out = root / f"build-{name}"
        build_repository(tiny["llama"], tiny["aws"], out,
                         RepositoryOptions(spec, model_name=name, backend=BACKENDS.get(name, "torch"),
                                           max_batch=MAX_BATCH,
                                  max_seq_len=MAX_SEQ_LEN, prefill_chunk=32, deterministic=True))
        shutil.move(str(out / name), str(root / "models" / name) if (root / "models").exists()
                    else _mkdir(root / "models") / name)
    return root / "models"


def _mkdir(path):
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def server(repo):
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from peagle_trt.serve.server import ServeOptions, TritonServer

    spec = ServeOptions(repo, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=120)
    with TritonServer(spec) as srv:
        yield srv
