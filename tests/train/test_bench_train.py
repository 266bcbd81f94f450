"""bench/train.py runs end to end on the CPU (--smoke: tiny shapes). The compiled contenders take a minute
each to compile on 2 cores, so this test runs the eager one and the FP8 curve case (eager too); the GPU run
takes the same code path with the full shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _smoke(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "train.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--smoke", "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["area"] == "train" and doc["smoke"] is True and doc["commit"] == "smoke-test"
    return doc


@pytest.mark.slow
def test_throughput_smoke(tmp_path):
    doc = _smoke(tmp_path, "--contenders", "kiln-eager")
    (case,) = doc["cases"]
    assert case["contender"] == "kiln-eager" and case["tokens_per_s"] > 0 and "error" not in case
    assert case["kernels"]["attention"] == "kiln" and "auto on cpu" in case["attention_choice"]
    assert 5.0 < case["first_step_loss"] < 6.0  # about ln(256) = 5.55 for a fresh model


@pytest.mark.slow
def test_fp8_curve_smoke(tmp_path):
    doc = _smoke(tmp_path, "--case", "fp8-curve")
    runs = {r["run"]: r for r in doc["runs"]}
    assert set(runs) == {"bf16", "bf16-seed1", "fp8", "fp8-rowwise"}
    assert all(len(r["curve_every_10"]) == 1 and r["val_loss"] > 0 for r in runs.values())
    assert runs["fp8"]["mean_abs_diff_vs_bf16"] < 0.1  # 4 steps: the curves have barely moved apart
    assert all(r["params_without_grad_step1"] == [] for r in runs.values())  # every parameter learns
    assert (tmp_path / "train.png").read_bytes()[:4] == b"\x89PNG"  # the curves drawn beside the JSON


def test_curve_runs_refuses_an_unknown_run(tmp_path):
    """--curve-runs names runs of the fp8-curve case; a name that is none of them is one clear error."""
    cmd = [sys.executable, str(ROOT / "bench" / "train.py"), "--smoke", "--case", "fp8-curve",
           "--curve-runs", "bf16,fp8-colwise", "--out", str(tmp_path / "t.json")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown run(s) fp8-colwise" in proc.stderr
    assert not (tmp_path / "t.json").exists()
