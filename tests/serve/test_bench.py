"""bench/serve.py --smoke: the benchmark end to end on the CPU (offline run, fixed rate, saturation)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_smoke(tmp_path, monkeypatch):
    out = tmp_path / "serve.json"
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling provenance.py
    monkeypatch.setattr(sys, "argv", ["serve.py", "--smoke", "--out", str(out)])
    runpy.run_path(str(BENCH / "serve.py"), run_name="__main__")
    result = json.loads(out.read_text())
    for key in ("fixed_rate", "saturation", "saturation_open_connections", "saturation_clients"):
        run = result[key]
        assert run["requests_ok"] == result["n"] and not run["errors"]
        assert run["output_tokens"] == result["offline"]["output_tokens"]  # every request ran to its length
        assert run["ttft_s"]["p50"] > 0 and run["itl_s"]["p99"] >= run["itl_s"]["p50"] > 0
        # admission: every request's headers came before its first token; the engine took them all in
        assert 0 < run["admit_s"]["p50"] <= run["ttft_s"]["p50"] and run["all_admitted_s"] > 0
        assert (
            0 < run["send_s"]["p50"] <= run["admit_s"]["p50"] and run["all_sent_s"] <= run["all_admitted_s"]
        )
        eng = run["server_engine"]
        assert eng["steps"] > 0 and 1 <= eng["intakes"] <= result["n"]
        assert round(eng["intakes"] * eng["requests_per_intake"]) == result["n"]
        assert run["server_mean_s"]["admission"] > 0
        # where admission went, per intake: every stage timed once per intake (batch and command once
        # per add command: at least one per intake), and every engine step timed
        stages = run["admission_stages_s"]
        assert stages["intake"]["n"] == eng["intakes"] == stages["event_loop"]["n"]
        assert stages["command"]["n"] >= eng["intakes"] and stages["batch"]["n"] >= eng["intakes"]
        assert all(v["max_le"] is not None for v in stages.values() if v["n"])
        assert eng["step_s"]["n"] == eng["steps"] and eng["steps_over_0.5s"] is not None
        assert all("slow engine step" in ln for ln in run["slow_steps"])  # the server log's lines, if any
    assert "overhead_at_saturation" in result and result["commit"]
    assert result["engine"]["enable_prefix_caching"] is False  # every pass and phase does the same work
    assert result["offline"]["engine_steps"] > 0 and "overhead_at_saturation_clients" in result
    assert result["saturation_clients"]["client_processes"] == 2
    assert len(result["offline"]["rounds_tok_s"]) == 2  # the offline workload twice, the best kept


def test_bench_phases_subset(tmp_path, monkeypatch):
    out = tmp_path / "serve.json"
    monkeypatch.syspath_prepend(str(BENCH))
    argv = ["serve.py", "--smoke", "--out", str(out), "--phases", "saturation", "--offline-rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(BENCH / "serve.py"), run_name="__main__")
    result = json.loads(out.read_text())
    assert "saturation" in result and "fixed_rate" not in result and "saturation_clients" not in result
    assert "overhead_at_saturation" in result and len(result["offline"]["rounds_tok_s"]) == 1


def test_slow_steps_reads_each_phase_s_new_lines(tmp_path, monkeypatch):
    """SlowSteps hands back the server log's "slow engine step" lines written since its last call."""
    monkeypatch.syspath_prepend(str(BENCH))
    slow_steps = runpy.run_path(str(BENCH / "serve.py"))["SlowSteps"]
    log = tmp_path / "server.log"
    slow = slow_steps(log)
    assert slow.new() == []  # no log yet
    log.write_text("kiln serve: ready\nkiln serve: slow engine step 3: 5.01 s; nothing scheduled\n")
    assert slow.new() == ["kiln serve: slow engine step 3: 5.01 s; nothing scheduled"]
    with log.open("a") as f:
        f.write("other\nkiln serve: slow engine step 9: 0.70 s; 1 sequences\n")
    assert slow.new() == ["kiln serve: slow engine step 9: 0.70 s; 1 sequences"] and slow.new() == []
