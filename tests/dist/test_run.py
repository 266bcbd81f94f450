"""`kiln run` under torchrun with tensor + sequence parallel: the loop's strategy path end to end.

Two processes (tp=2, sequence parallel, gloo) stop at step 2 with a checkpoint gathered from the
shards, resume to step 4, and must log the losses of one uninterrupted process on the same batches;
validation (through the vocab-parallel loss) and samples (from the gathered weights) run too.
"""

import json
import subprocess
import sys

import pytest

from kiln.cli import main

COMMON = [
    "run",
    "--preset",
    "tiny",
    "--no-progress",
    "--device",
    "cpu",
    "--train.steps=4",
    "--train.log_interval=1",
    "--train.eval_interval=2",
    "--train.ckpt_interval=2",
    "--train.grad_accum=2",
    "--sample.max_new_tokens=4",
    "--train.batch_size=4",
]
TP = ["--parallel.dp_replicate=1", "--parallel.tp=2", "--parallel.sequence_parallel=true"]


def _records(run_dir, kind, key):
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in recs if r["kind"] == kind]


@pytest.mark.slow
def test_tensor_parallel_run_stops_resumes_and_matches_one_process(tmp_path):
    single, tp = tmp_path / "single", tmp_path / "tp"
    assert main([*COMMON, "--out", str(single)]) == 0
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "kiln.cli",
    ]
    # the tensor-parallel ranks read the same rows: the global batch is 4 sequences, as in one process
    for extra in (["--stop-at", "2"], ["--resume"]):
        r = subprocess.run(
            [*launch, *COMMON, *TP, "--out", str(tp), *extra], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-3000:]
    assert "tensor parallel + sequence parallel" in r.stdout
    a, b = _records(single, "train", "loss"), _records(tp, "train", "loss")
    assert len(a) == len(b) == 4
    assert b == pytest.approx(a, abs=1e-5, rel=0)
    assert _records(tp, "val", "val_loss") == pytest.approx(
        _records(single, "val", "val_loss"), abs=1e-5, rel=0
    )
    assert "--- prompt" in r.stdout  # rank 0 sampled from the gathered weights
