"""`peagle-trt train --device cuda`: a P-EAGLE and an EAGLE-3 head train and evaluate on the GPU
(the feature cache, COD elements and held-out evaluation on the device the features are on), and
a CUDA run's first loss is the CPU run's, with the target's features cached or made per step in one
batched pass (`online`, the GPU training run's). Marked gpu (skipped without CUDA); run by
scripts/gpu_validate.sh. The first CUDA run (H200, 2026-11-27) found two tensors made on the CPU
beside CUDA ones (cod.segment_rows, curve.evaluate)."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.train import TrainConfig, train
from peagle_trt.train.distill import distill

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

@pytest.mark.parametrize("method,layout,online", [("peagle", "aws", False), ("eagle3", "speculators", False),
                                                  ("peagle", "aws", True), ("eagle3", "speculators", True)])
def test_train_on_cuda_matches_the_cpu_run(tiny, tmp_path, method, layout, online):
    data = tmp_path / "answers.jsonl"
    rows = [{"id": f"r{i}", "kind": "write", "prompt": f"def f{i}(x):\n    return x + {i}", "max_tokens": 10}
            for i in range(8)]
    distill(tiny["llama"], rows, data, backend="torch", batch=4, max_len=256)
    base = dict(target=tiny["llama"], data=data, method=method, layout=layout, steps=2, batch=2, seq_len=64,
                depths=3, draft_vocab=200, taps=(1, 3, 5), log_every=100, max_context=16, held_out_every=4,
                eval_every=1, lr=1e-12, warmup=1, feature_cache=tmp_path / "f.pt", layers=2)
    cpu = train(TrainConfig(output=tmp_path / "cpu", device="cpu", **base), lambda *a, **k: None)
    # online (the GPU recipe's, peagle_trt/train/gpu_recipe.py): the target's pass per step, batched, on the GPU
    over = {"online": True, "feature_cache": None} if online else {}
    gpu = train(TrainConfig(output=tmp_path / "gpu", device="cuda", **{**base, **over}), lambda *a, **k: None)
    assert gpu["steps"] == 2 and (tmp_path / "gpu" / "model.safetensors").is_file()
    # the same batches and the same head: the same loss and held-out agreement
    assert gpu["final_loss"] == pytest.approx(cpu["final_loss"], rel=1e-3)
    assert gpu["held_out_top1"] == pytest.approx(cpu["held_out_top1"], abs=0.02)
