"""`kiln run` when things go wrong: early stops, resumes with other settings, two writers, NaN steps,
damaged checkpoints and a full disk (issue 13). Every run reuses one prepared tokenizer and shard set, so
each costs a few tiny training steps."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.io import atomic
from kiln.io.checkpoint import latest_pointer, list_checkpoints, load_checkpoint, save_checkpoint
from kiln.io.lock import LOCK_FILE, DirLock
from kiln.model.transformer import Transformer

TINY = ["run", "--preset", "tiny", "--no-progress", "--sample.max_new_tokens=0"]
STAGES = ("tokenizer", "data", "stages.json")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A run stopped at step 0: its tokenizer and shards seed the other runs; its checkpoint is step 0."""
    out = tmp_path_factory.mktemp("runs") / "base"
    assert main([*TINY, "--out", str(out), "--stop-at", "0"]) == 0
    return out


def _seeded(base: Path, dest: Path) -> Path:
    """A fresh run directory holding only base's reusable stages (`kiln run` reuses them)."""
    dest.mkdir(parents=True)
    for name in STAGES:
        (shutil.copytree if (base / name).is_dir() else shutil.copy)(base / name, dest / name)
    return dest


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([*TINY, *map(str, args)])
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err
    return rc, cap.out, cap.err


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


# ---- item 1: runs that end before any validation --------------------------------------------------------------


def test_stop_at_zero_and_early_stops_then_exact_resume(base, tmp_path, capsys):
    assert [p.name for p in list_checkpoints(base / "checkpoints")] == ["step_0000000.pt"]
    assert json.loads((base / "summary.json").read_text())["val_bpb"] is None
    common = ["--train.steps=4", "--train.log_interval=1"]  # eval_interval stays 30: no validation
    straight = _seeded(base, tmp_path / "straight")
    assert _run(capsys, *common, "--out", straight)[0] == 0
    split = _seeded(base, tmp_path / "split")
    rc, out, _ = _run(capsys, *common, "--out", split, "--stop-at", 0)
    assert rc == 0 and "no validation yet at step 0" in out
    rc, out, _ = _run(capsys, *common, "--out", split, "--resume", "--stop-at", 2)
    assert rc == 0 and "no validation yet at step 2" in out
    assert json.loads((split / "summary.json").read_text())["val_bpb"] is None
    assert _run(capsys, *common, "--out", split, "--resume")[0] == 0
    a = [(r["step"], r["loss"], r["grad_norm"]) for r in _records(straight, "train")]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in _records(split, "train")]
    assert [s for s, _, _ in b] == [1, 2, 3, 4] and a == b  # bitwise, through a step-0 checkpoint

    # a finished run resumed says so and exits 0; steps below the checkpoint are an error; neither writes
    before = _snapshot(split)
    rc, out, _ = _run(capsys, "--out", split, "--resume")
    assert rc == 0 and "already finished at step 4" in out
    rc, out, _ = _run(capsys, "--out", split, "--resume", "--train.steps=4")
    assert rc == 0 and "already finished at step 4" in out
    rc, _, err = _run(capsys, "--out", split, "--resume", "--train.steps=3")
    assert rc == 2 and "train.steps=3 is below the checkpoint's step 4" in err
    rc, _, err = _run(capsys, "--out", split, "--resume", "--train.steps=6", "--stop-at", 3)
    assert rc == 2 and "--stop-at 3 is before the checkpoint's step 4" in err
    rc, _, err = _run(capsys, "--out", split, "--stop-at", -1, "--overwrite")
    assert rc == 2 and "--stop-at must be a step number >= 0" in err
    assert _snapshot(split) == before


# ---- item 2: a checkpoint before the first log line -------------------------------------------------------------


def test_checkpoint_interval_below_log_interval(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    rc, out, _ = _run(
        capsys, "--out", run, "--train.steps=3", "--train.log_interval=10", "--train.ckpt_interval=1"
    )
    assert rc == 0
    assert latest_pointer(run / "checkpoints")["step"] == 3
    assert [r["step"] for r in _records(run, "train")] == [3] and (run / "loss.png").exists()


# ---- item 3: what a resume may change ----------------------------------------------------------------------------


def test_resume_refuses_changed_settings_before_touching_a_file(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    assert _run(capsys, "--out", run, "--train.steps=4", "--stop-at", 2)[0] == 0
    before = _snapshot(run)
    rc, _, err = _run(
        capsys, "--out", run, "--resume", "--data.max_bytes=300000", "--tokenizer.vocab_size=400",
        "--train.batch_size=4", "--train.lr=0.01",
    )  # fmt: skip
    assert rc == 2
    for change in (
        "data.max_bytes: 400000 -> 300000",
        "tokenizer.vocab_size: 384 -> 400",
        "model.vocab_size: 384 -> 400",
        "train.batch_size: 8 -> 4",
        "train.lr: 0.003 -> 0.01",
    ):
        assert change in err
    # --config FILE is merged over the saved config, under the same rules
    cfg_file = tmp_path / "more.json"
    cfg_file.write_text(json.dumps({"model": {"n_layers": 3}}))
    rc, _, err = _run(capsys, "--out", run, "--resume", "--config", cfg_file)
    assert rc == 2 and "model.n_layers: 2 -> 3" in err
    assert _snapshot(run) == before  # config.json, tokenizer, shards and checkpoints untouched

    # a checkpoint written by another number of processes is refused, not silently re-sliced
    ckpt_dir = run / "checkpoints"
    state = load_checkpoint(ckpt_dir)
    save_checkpoint(ckpt_dir, 2, {**state, "world_size": 2})
    rc, _, err = _run(capsys, "--out", run, "--resume")
    assert rc == 2 and "written by 2 process(es)" in err and "--nproc_per_node=2" in err
    save_checkpoint(ckpt_dir, 2, state)

    cfg_file.write_text(json.dumps({"train": {"steps": 5}}))
    rc, out, _ = _run(capsys, "--out", run, "--resume", "--config", cfg_file, "--train.log_interval=2")
    assert rc == 0
    assert "resume: train.steps changed from 4 to 5" in out
    assert "resume: train.log_interval changed from 10 to 2" in out
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["steps"] == 5 and saved["train"]["log_interval"] == 2
    assert latest_pointer(ckpt_dir)["step"] == 5


def test_help_lists_what_a_resume_may_change(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "train.steps" in out and "train.ckpt_interval" in out and "--overwrite" in out


# ---- item 4: one writer per run directory ------------------------------------------------------------------------


def test_second_writer_is_refused_and_a_stale_lock_is_taken_over(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    with DirLock(run):
        rc, _, err = _run(capsys, "--out", run, "--train.steps=2")
        assert rc == 2 and f"is in use by process {os.getpid()}" in err
        with pytest.raises(Exception, match="is in use"):
            DirLock(run).acquire()
    assert not (run / "metrics.jsonl").exists()
    # a lock file left by a process that died holding it (the kernel has released its flock)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (run / LOCK_FILE).write_text(f"{dead.stdout.strip()} somehost\n")
    rc, out, _ = _run(capsys, "--out", run, "--train.steps=2")
    assert rc == 0 and f"taking over the stale lock of process {dead.stdout.strip()}" in out
    assert (run / LOCK_FILE).read_text() == ""  # released on exit


def test_fresh_run_into_an_earlier_run_needs_overwrite(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    assert _run(capsys, "--out", run, "--train.steps=3", "--train.log_interval=1")[0] == 0
    before = _snapshot(run)
    rc, _, err = _run(capsys, "--out", run, "--train.steps=2")
    assert rc == 2 and "--resume" in err and "--overwrite" in err
    assert _snapshot(run) == before
    rc, out, _ = _run(capsys, "--out", run, "--train.steps=2", "--train.log_interval=1", "--overwrite")
    assert rc == 0 and "--overwrite: deleted" in out
    assert [r["step"] for r in _records(run, "train")] == [1, 2]  # the old run's records are gone
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_0000002.pt"]
    assert (run / "tokenizer").is_dir()  # reused, not rebuilt
    rc, _, err = _run(capsys, "--out", run, "--resume", "--overwrite")
    assert rc == 2 and "contradict" in err


def test_temporary_names_are_unique_per_write(tmp_path):
    names = {atomic.temp_name(tmp_path / "x.pt") for _ in range(50)}
    assert len(names) == 50 and all(str(os.getpid()) in n.name for n in names)


# ---- item 5: non-finite steps and divergence ---------------------------------------------------------------------


def _poison(monkeypatch, bad_calls):
    """Make the training loss NaN on the given 1-based training forward calls."""
    real, calls = Transformer.loss, [0]

    def loss(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.training:
            calls[0] += 1
            if calls[0] in bad_calls:
                return out * float("nan")
        return out

    monkeypatch.setattr(Transformer, "loss", loss)


@pytest.mark.parametrize("fused", [False, True], ids=["host-flag", "fused-found-inf"])
def test_nan_steps_are_skipped_counted_and_never_checkpointed(base, tmp_path, capsys, monkeypatch, fused):
    if fused:  # the CUDA path (fused AdamW skips on the device via found_inf), run on the CPU
        import kiln.train.run as run_mod

        def fused_adamw(model, cfg):
            return torch.optim.AdamW(
                model.param_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                fused=True,
            )  # fmt: skip

        monkeypatch.setattr(run_mod, "build_optimizer", fused_adamw)
    _poison(monkeypatch, {3, 4})
    run = _seeded(base, tmp_path / "r")
    rc, out, _ = _run(
        capsys, "--out", run, "--train.steps=6", "--train.log_interval=3", "--train.ckpt_interval=3"
    )
    assert rc == 0
    assert "update(s) skipped" in out
    recs = _records(run, "train")
    assert [(r["step"], r["skipped"], r["skipped_total"]) for r in recs] == [(3, 1, 1), (6, 1, 2)]
    assert all(
        r["loss"] is not None and r["loss"] == r["loss"] for r in recs
    )  # finite means of applied steps
    state = load_checkpoint(run)
    assert state["skipped"] == 2
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_consecutive_nan_steps_stop_the_run(base, tmp_path, capsys, monkeypatch):
    _poison(monkeypatch, set(range(2, 100)))
    run = _seeded(base, tmp_path / "r")
    rc, _, err = _run(
        capsys, "--out", run, "--train.steps=10", "--train.max_bad_steps=3", "--train.ckpt_interval=2"
    )
    assert rc == 2 and "3 consecutive steps (up to step 4)" in err and "train.max_bad_steps=3" in err
    state = load_checkpoint(run)  # step 2's checkpoint: written before the run of bad steps grew too long
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in state["model"].values())


def test_non_finite_parameters_are_never_checkpointed():
    from kiln.errors import KilnError
    from kiln.train.checkpoint import check_finite

    model = torch.nn.Linear(3, 2)
    check_finite(model, 1)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(KilnError, match="not finite at step 7"):
        check_finite(model, 7)


def test_fused_adamw_found_inf_skips_the_whole_update():
    """The mechanism the device path relies on: GradScaler's protocol on fused AdamW."""
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones_like(p)
    opt.step()
    before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
    p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert torch.equal(p.detach(), before[0])
    assert all(torch.equal(opt.state[p][k], v) for k, v in before[1].items())


def test_divergence_is_flagged(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    rc, out, _ = _run(
        capsys,
        "--out",
        run,
        "--train.steps=4",
        "--train.log_interval=2",
        "--train.lr=30",
        "--train.warmup_steps=0",
    )
    assert rc == 0 and "warning: step" in out and "the run is diverging" in out
    assert any(r.get("diverging") for r in _records(run, "train"))


# ---- item 6: damaged checkpoints, dangling pointers, a full disk ------------------------------------------------


@pytest.fixture
def two_checkpoints(base, tmp_path, capsys):
    run = _seeded(base, tmp_path / "r")
    args = [
        "--out",
        run,
        "--train.steps=6",
        "--train.ckpt_interval=2",
        "--train.log_interval=1",
        "--stop-at",
        4,
    ]
    assert _run(capsys, *args)[0] == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_0000002.pt", "step_0000004.pt"]
    return run


def test_damaged_newest_checkpoint_falls_back_with_a_warning(two_checkpoints, capsys):
    run = two_checkpoints
    newest = run / "checkpoints" / "step_0000004.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x55
    newest.write_bytes(bytes(data))
    # the older one is verified against the checksum LATEST.json keeps for it, too
    assert [r["step"] for r in latest_pointer(run / "checkpoints")["checkpoints"]] == [2, 4]
    rc, out, _ = _run(capsys, "--out", run, "--resume", "--stop-at", 3)
    assert rc == 0
    assert "warning:" in out and "corrupt or truncated" in out and "falling back to" in out
    assert "resumed from step 2" in out
    assert (run / "checkpoints" / "step_0000004.pt.superseded").read_bytes() == bytes(data)  # kept aside
    assert [r["step"] for r in _records(run, "train")] == [1, 2, 3]  # the lost tail's records are dropped
    assert latest_pointer(run / "checkpoints")["step"] == 3


def test_pointer_to_a_deleted_file_and_resume_from(two_checkpoints, capsys):
    run = two_checkpoints
    (run / "checkpoints" / "step_0000004.pt").unlink()
    rc, out, _ = _run(capsys, "--out", run, "--resume", "--stop-at", 2)  # nothing to train: only the choice
    # the fallback found step 2, and --stop-at 2 there leaves nothing to do
    assert rc == 0 and "names step_0000004.pt, which does not exist" in out and "falling back to" in out
    assert "already at step 2" in out
    assert main(["generate", "--checkpoint", str(run), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "names step_0000004.pt, which does not exist" in err and "step_0000002.pt" in err
    rc, _, err = _run(capsys, "--out", run, "--resume-from", 3)
    assert rc == 2 and "no checkpoint of step 3" in err and "steps: 2" in err
    rc, out, _ = _run(capsys, "--out", run, "--resume-from", 2, "--stop-at", 3)
    assert rc == 0 and "resumed from step 2" in out
    assert latest_pointer(run / "checkpoints")["step"] == 3


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_a_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    from kiln.errors import KilnError

    save_checkpoint(tmp_path, 1, {"model": {"w": torch.ones(2)}, "config": {}})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    monkeypatch.setattr(atomic.os, "fsync", _no_space)
    with pytest.raises(KilnError, match=r"cannot write .*step_0000002\.pt: the disk is full"):
        save_checkpoint(tmp_path, 2, {"model": {"w": torch.zeros(2)}, "config": {}})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no partial temp, pointer intact


def test_disk_full_during_a_metrics_write_keeps_whole_lines(tmp_path, monkeypatch):
    from kiln.errors import KilnError
    from kiln.train.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1})
    real_write, calls = os.write, [0]

    def half_then_full(fd, data):
        calls[0] += 1
        if calls[0] == 1:
            return real_write(fd, bytes(data[:5]))  # a partial write, then the disk is full
        _no_space()

    monkeypatch.setattr(atomic.os, "write", half_then_full)
    with pytest.raises(KilnError, match=r"cannot write .*metrics\.jsonl: the disk is full"):
        log.write({"step": 2, "loss": 1.0})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_disk_full_in_a_run_exits_cleanly(base, tmp_path, capsys, monkeypatch):
    run = _seeded(base, tmp_path / "r")
    monkeypatch.setattr(atomic.os, "fsync", _no_space)
    rc, _, err = _run(capsys, "--out", run, "--train.steps=2")
    assert rc == 2 and "the disk is full" in err and str(run) in err
    assert not [p for p in run.rglob("*.tmp")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--parallel.tp=2"], "the world size 1 is not divisible by tp x pp x the given dp size = 2"),
        (["--parallel.dp_replicate=1", "--parallel.pp=2"], "= 2 processes, but the world size is 1"),
        (["--parallel.ep=2"], "parallel.ep=2 splits the experts over ranks of parallel.dp_shard (1)"),
    ],
)
def test_parallel_sizes_without_torchrun_are_one_error(capsys, tmp_path, flags, message):
    """One process with parallel.* sizes above 1 would otherwise train alone and say nothing: one error
    line naming the launch, before anything is written."""
    out = tmp_path / "run"
    rc, _, err = _run(capsys, "--out", out, *flags)
    assert rc == 2 and err.startswith("kiln: error: ") and message in err and "Traceback" not in err, err
    assert not out.exists()
