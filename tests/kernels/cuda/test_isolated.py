"""The benchmark's child-process runner for risky kernel variants (kiln.profile.cuda_isolated), with fake
workers: one that crashes on a variant, one that hangs, one that dies before any variant, one that fails
while timing."""

import sys

from kiln.profile.cuda_isolated import parse_events, run_isolated

# A fake worker: argv[1] = behaviour per variant ("ok", "crash", "hang"), comma-separated in variant
# order; argv[2] = the variants to run; argv[3] = "fail-timing" to die after checking.
WORKER = r"""
import json, sys, time
plan = sys.argv[1].split(",")
variants = [int(v) for v in sys.argv[2].split(",")]
print("building...", flush=True)
for v in variants:
    print(json.dumps({"event": "start", "variant": v}), flush=True)
    if plan[v] == "crash":
        sys.exit(3)
    if plan[v] == "hang":
        time.sleep(60)
    print(json.dumps({"event": "checked", "variant": v, "max_rel_err": 0.001 * v}), flush=True)
if len(sys.argv) > 3:
    sys.exit(4)
print(json.dumps({"event": "timed", "ms": {**{f"v{v}": 1.0 + v for v in variants}, "peer": 1.0}}), flush=True)
"""


def command(plan: str, *extra: str):
    return lambda vs: [sys.executable, "-c", WORKER, plan, ",".join(map(str, vs)), *extra]


def test_all_variants_pass():
    r = run_isolated([0, 1, 2], command("ok,ok,ok"), timeout_s=30)
    assert sorted(r["checked"]) == [0, 1, 2] and r["failed"] == {} and r["timing_error"] is None
    assert r["ms"] == {"v0": 1.0, "v1": 2.0, "v2": 3.0, "peer": 1.0}


def test_a_crash_and_a_hang_are_recorded_and_skipped():
    r = run_isolated([0, 1, 2, 3, 4], command("ok,crash,ok,hang,ok"), timeout_s=5)
    assert sorted(r["checked"]) == [0, 2, 4]
    assert sorted(r["failed"]) == [1, 3]
    assert "status 3" in r["failed"][1] and "timed out" in r["failed"][3]
    # one more worker times every variant that passed, together
    assert r["ms"] == {"v0": 1.0, "v2": 3.0, "v4": 5.0, "peer": 1.0}


def test_a_worker_that_fails_while_timing_keeps_the_checks():
    r = run_isolated([0, 1], command("ok,ok", "fail-timing"), timeout_s=30)
    assert sorted(r["checked"]) == [0, 1] and r["ms"] == {} and "status 4" in r["timing_error"]


def test_a_worker_that_dies_before_any_variant_fails_them_all():
    r = run_isolated([0, 1], lambda vs: [sys.executable, "-c", "import sys; sys.exit(5)"], timeout_s=30)
    assert r["checked"] == {} and sorted(r["failed"]) == [0, 1] and "before running it" in r["failed"][0]
    assert r["timing_error"] is None and r["ms"] == {}


def test_parse_events_skips_other_output():
    out = 'log line\n{"event": "start", "variant": 2}\n{"broken\n{"no_event": 1}\n'
    assert parse_events(out) == [{"event": "start", "variant": 2}]


def test_bench_wgmma_runs_its_real_worker_and_records_every_failure():
    # on a machine without the GPU the worker dies before its first configuration: every row says so and
    # the benchmark goes on (with a GPU the same path records a faulting configuration)
    import torch

    if torch.cuda.is_available():
        return  # the GPU run measures for real (bench/cuda_ladder.py)
    from kiln.kernels.cuda.ladder import WGMMA_CONFIGS
    from kiln.profile.cuda_ladder import bench_wgmma

    rows = bench_wgmma(None, "bf16", (64, 64, 64), skip={0: "worker timed out"})
    assert [r["config"] for r in rows] == list(range(len(WGMMA_CONFIGS)))
    assert rows[0]["error"].startswith("skipped: failed on an earlier shape (worker timed out")
    assert all(r["ms"] is None and "before running it" in r["error"] for r in rows[1:])


def test_bench_skewed_records_every_configuration_that_did_not_run():
    # without a GPU the worker dies before its first configuration: the row says so for each configuration
    # and carries no figure (the benchmark goes on; with a GPU the same path records a faulting one)
    import torch

    if torch.cuda.is_available():
        return  # the GPU run measures for real (bench/cuda_ladder.py)
    from kiln.kernels.cuda.ladder import SKEWED_CONFIGS
    from kiln.profile.cuda_ladder import bench_skewed

    row = bench_skewed((64, 64, 64))
    assert row["name"] == "skewed_autotuned" and row["ms"] is None and row["vs_cublas"] is None
    assert sorted(row["failed_configs"], key=int) == [str(i) for i in range(len(SKEWED_CONFIGS))]
    assert all("before running it" in why for why in row["failed_configs"].values())
