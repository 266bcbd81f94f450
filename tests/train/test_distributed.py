"""The loop under real torchrun (2 CPU processes, gloo): per-step losses match one process,
with gradient accumulation."""

import json
import shutil
import subprocess
import sys

import pytest

from kiln.cli import main
from kiln.io.checkpoint import latest_pointer, load_checkpoint

COMMON = [
    "run",
    "--preset",
    "tiny",
    "--no-progress",
    "--device",
    "cpu",
    "--train.steps=6",
    "--train.log_interval=1",
    "--train.eval_interval=3",
    "--sample.max_new_tokens=0",
    "--train.grad_accum=2",  # accumulation: DDP's no_sync on the first micro-batch of each step
]


def _losses(run_dir):
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"], [
        r["val_loss"] for r in recs if r["kind"] == "val"
    ]


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path, capsys):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert main([*COMMON, "--out", str(single), "--train.batch_size=8"]) == 0
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "kiln.cli",
        *COMMON,
        "--out",
        str(ddp),
        "--train.batch_size=4",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (a_train, a_val), (b_train, b_val) = _losses(single), _losses(ddp)
    assert len(a_train) == len(b_train) == 6
    # the same global batches; DDP averages the two ranks' gradients, which equals the 8-sequence mean
    # up to float32 summation order
    assert b_train == pytest.approx(a_train, rel=1e-5, abs=1e-6)
    assert b_val == pytest.approx(a_val, rel=1e-5, abs=1e-6)
    assert "2 process(es)" in r.stdout

    # a checkpoint before the first log line (ckpt_interval < log_interval): rank 0 alone takes the run's
    # lock and writes, and the empty metrics file must not take both ranks down; the single run's
    # tokenizer and shards are reused, so only two steps run
    early = tmp_path / "early"
    early.mkdir()
    for name in ("tokenizer", "data"):
        shutil.copytree(single / name, early / name)
    shutil.copy(single / "stages.json", early / "stages.json")
    steps = ["--train.steps=2", "--train.log_interval=5", "--train.ckpt_interval=1"]
    r = subprocess.run(
        [*cmd[:-2], str(early), "--train.batch_size=4", *steps], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert latest_pointer(early / "checkpoints")["step"] == 2
    assert load_checkpoint(early)["world_size"] == 2
    # resuming it in one process would re-slice every global batch: refused, naming the process count
    capsys.readouterr()
    assert main([*COMMON, "--out", str(early), "--resume", "--train.steps=3"]) == 2
    assert "written by 2 process(es) and this resume has 1" in capsys.readouterr().err
