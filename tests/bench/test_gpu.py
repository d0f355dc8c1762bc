"""bench.gpu: the figures it prints, on this CPU (MFU null with its reason) and by device name."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.gpu import flops_per_token, peak_flops_of
from node.model import build_model, model_config
from tests.conftest import REPO


def test_peak_flops_are_looked_up_by_device_name() -> None:
    assert peak_flops_of("NVIDIA H200")[0] == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe")[0] == 756e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB")[0] == 312e12
    flops, reason = peak_flops_of("Some Future GPU")
    assert flops is None and "not in bench.gpu's peak FLOP/s table" in reason


def test_flops_per_token_counts_weights_and_attention() -> None:
    model = build_model(model_config("tiny"), seed=0)
    num_params = sum(p.numel() for p in model.parameters())
    assert flops_per_token(model, 2, 128, 64) == 6 * num_params + 12 * 2 * 128 * 64


def test_the_cpu_run_prints_throughput_and_mfu_null_with_the_reason() -> None:
    command = [sys.executable, "-m", "bench.gpu", "--models", "tiny"]
    command += ["--steps", "1", "--warmup", "0", "--seq-len", "32", "--device", "cpu"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["mfu_reason"] == "no peak FLOP/s table for CPUs: MFU is a GPU figure"
    assert [r["model"] for r in figures["results"]] == ["tiny"]
    for row in figures["results"]:
        assert row["mfu"] is None and row["tokens_per_s"] > 0 and row["peak_memory_gb"] > 0
