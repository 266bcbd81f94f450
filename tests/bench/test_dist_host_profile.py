"""bench/dist_host_profile.py on the CPU (gloo, world size 1, the tiny model): it profiles plain, FSDP2 and
plain again, and writes one report per case with the measured step time and cProfile's tables."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SRC = BENCH.parent / "src"


@pytest.mark.slow
def test_host_profile_writes_a_report_per_case(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    env["MASTER_PORT"] = "29541"
    proc = subprocess.run([sys.executable, str(BENCH / "dist_host_profile.py"), "tiny", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("tiny ")]
    assert [line.split(":")[0] for line in lines] == ["tiny plain", "tiny fsdp1", "tiny plain"], proc.stdout
    for kind in ("plain", "fsdp1"):
        text = (tmp_path / f"fsdp_prof_tiny_{kind}.txt").read_text()
        assert text.startswith(f"tiny {kind}: step ") and "Ordered by: cumulative time" in text, text[:500]
    # FSDP2's hooks show up in its profile, and not in plain training's
    assert "_fsdp_param_group" in (tmp_path / "fsdp_prof_tiny_fsdp1.txt").read_text()
    assert "_fsdp_param_group" not in (tmp_path / "fsdp_prof_tiny_plain.txt").read_text()


def test_the_script_names_unknown_models(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, str(BENCH / "dist_host_profile.py"), "huge", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "unknown model 'huge'" in proc.stderr
