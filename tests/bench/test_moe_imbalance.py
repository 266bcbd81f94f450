"""bench/moe_imbalance.py end to end on the CPU: `--smoke` (the interpreter, a dozen tokens) writes the JSON
with tokens and time per expert for every shape and routing and the PNG beside it; `--replot` redraws the
PNG from the JSON alone."""

import json
import subprocess
import sys

import pytest

from tests.bench.test_smoke import BENCH, run_smoke

SCRIPT = BENCH / "moe_imbalance.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_imbalance") / "moe_imbalance.json"
    proc = run_smoke("moe_imbalance", out)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_smoke_result(smoke):
    doc = json.loads(smoke.read_text())
    assert doc["area"] == "moe_imbalance" and doc["smoke"] is True and doc["commit"] == "smoke-test"
    cases = doc["cases"]
    assert not [c for c in cases if "error" in c], [c["error"] for c in cases if "error" in c]
    assert {(c["shape"], c["routing"]) for c in cases} == {
        (s, r) for s in ("tiny+shared", "tiny-16e") for r in ("balanced", "zipf")
    }
    for c in cases:
        n, us = c["tokens_per_expert"], c["time_per_expert_us"]
        assert len(n) == len(us) == len(c["TFLOPs_per_expert"]) == c["E"], c
        assert sum(n) == c["tokens"] * c["k"] == 12 * c["k"], c  # every (token, slot) pair once
        assert all(t == 0.0 if count == 0 else t > 0 for count, t in zip(n, us)), c  # empty: not launched
        assert c["empty_experts"] == n.count(0)
        assert c["sum_per_expert_us"] == pytest.approx(sum(us), abs=0.01)
        assert c["grouped_gemms_us"] > 0 and c["grouped_layer_us"] > 0
    assert any(c["empty_experts"] for c in cases), "no case has an empty expert: the 0 rule went untested"
    assert all("zipf_vs_balanced_layer" in c for c in cases if c["routing"] == "zipf")
    png = smoke.with_suffix(".png")
    assert doc["png"] == png.name and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_replot(smoke, tmp_path):
    """--replot redraws the PNG beside a copy of the JSON; a file that is not a result is refused."""
    copy = tmp_path / "again.json"
    copy.write_text(smoke.read_text())
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--replot", str(copy)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert copy.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"area": "moe", "cases": []}))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--replot", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "not a bench/moe_imbalance.py result" in proc.stderr
    assert not bad.with_suffix(".png").exists()
