"""The benchmark harness's parts that run anywhere: tables, atomic result files, the smoke timer, the
interleaving order, provenance and the CPU ceilings."""

import os

import pytest
import torch

from kiln.profile import timing
from kiln.profile.ceilings import fraction, measure_ceilings
from kiln.profile.harness import bench_parser, default_out
from kiln.profile.provenance import git_commit, provenance
from kiln.profile.report import format_table, read_json, write_json


def test_format_table():
    rows = [{"op": "rmsnorm", "ms": 0.13245, "ratio": 1.5}, {"op": "rope", "ms": None}]
    assert format_table(rows, [("op", "op"), ("ms", "kiln ms"), ("ratio", "ratio")]) == (
        "| op | kiln ms | ratio |\n|---|---|---|\n| rmsnorm | 0.1325 | 1.5 |\n| rope | - | - |"
    )


class Unwritable:
    def __str__(self):  # write_json stores unknown objects as str(obj): this one fails mid-write
        raise ValueError("cannot be written")


def test_write_json_is_atomic_and_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "sub" / "area.json"
    write_json(path, {"a": 1})
    assert read_json(path) == {"a": 1}
    with pytest.raises(ValueError, match="cannot be written"):
        write_json(path, {"a": 2, "b": Unwritable()})
    assert read_json(path) == {"a": 1}
    assert os.listdir(path.parent) == ["area.json"]  # no temporary file left behind


def test_smoke_timer_calls_each_candidate_once():
    calls = {"a": 0, "b": 0}

    def make(name):
        def f():
            calls[name] += 1

        return f

    t = timing.Timer(smoke=True)
    res = t.interleaved({"a": make("a"), "b": make("b")})
    assert calls == {"a": 1, "b": 1} and set(res) == {"a", "b"} and res["a"]["ms"] >= 0
    assert t.graph(make("a")) is None and t.host(make("a")) is None


def test_interleaved_visits_every_candidate_each_round_in_a_fresh_order(monkeypatch):
    seen = []
    t = timing.Timer(smoke=False, rounds=6)
    monkeypatch.setattr(t, "ms", lambda fn, rep_ms=None: fn() or 1.0)  # do_bench stand-in: one call
    res = t.interleaved({n: (lambda n=n: seen.append(n)) for n in "abcd"})
    warm, timed = seen[:4], seen[4:]
    assert warm == list("abcd") and len(timed) == 24
    rounds = [tuple(timed[i : i + 4]) for i in range(0, 24, 4)]
    assert all(sorted(r) == list("abcd") for r in rounds) and len(set(rounds)) > 1
    assert res["a"] == {"ms": 1.0, "rounds": [1.0] * 6}


def test_provenance_and_cpu_ceilings(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_COMMIT", "abc1234")
    monkeypatch.setenv("KILN_FP8_CAST", "one_pass")
    meta = provenance()
    assert meta["commit"] == "abc1234" and meta["dirty"] is None
    assert meta["switches"]["KILN_FP8_CAST"] == "one_pass" and "KILN_COMMIT" not in meta["switches"]
    assert meta["torch"] == torch.__version__ and meta["date"].endswith("Z")
    monkeypatch.delenv("KILN_COMMIT")
    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert git_commit() == "unknown"
    c = measure_ceilings(torch.device("cpu"))
    assert c["copy_TBps"] is None and c["bf16_matmul_TFLOPs"] is None
    assert fraction(2.0, None) is None and fraction(2.0, 4.0) == 0.5


def test_smoke_results_never_default_into_bench_results():
    args = bench_parser("norms", "doc").parse_args(["--smoke"])
    assert args.smoke and args.out is None
    assert "bench/results" not in str(default_out("norms", "/repo/bench/norms.py", smoke=True))
    assert str(default_out("norms", "/repo/bench/norms.py", smoke=False)) == "/repo/bench/results/norms.json"
