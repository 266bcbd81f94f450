"""The main job end to end on the tiny preset: it learns, it resumes exactly, and bad input is a clean error."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main

TINY = ["run", "--preset", "tiny", "--no-progress"]


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main([*TINY, "--out", str(out), "--train.log_interval=5"]) == 0
    return out


def test_loss_falls_and_beats_the_unigram_model(tiny_run):
    summary = json.loads((tiny_run / "summary.json").read_text())
    train = _records(tiny_run, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert summary["val_bpb"] < summary["unigram_val_bpb"]
    for name in ("config.json", "loss.png", "tokenizer", "data/meta.json", "checkpoints/LATEST.json"):
        assert (tiny_run / name).exists(), name
    rec = train[-1]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mem_gib"} <= rec.keys()
    assert summary["samples"] and isinstance(summary["samples"][0]["completion"], str)


def test_generate_from_a_checkpoint(tiny_run, capsys):
    assert main(["generate", "--checkpoint", str(tiny_run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("def ")


@pytest.mark.slow
def test_resume_is_bitwise_exact_across_processes(tmp_path):
    common = [
        *TINY,
        "--train.steps=12",
        "--train.log_interval=1",
        "--train.ckpt_interval=6",
        "--train.eval_interval=6",
        "--sample.max_new_tokens=0",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*common, "--out", str(straight)]) == 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for extra in (["--stop-at", "6"], ["--resume"]):  # each half in a fresh process
        r = subprocess.run(
            [sys.executable, "-m", "kiln.cli", *common, "--out", str(split), *extra],
            capture_output=True,
            text=True,
            env=env,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        # --no-progress still prints one log line per interval and the validation lines
        assert " | loss " in r.stdout and " | grad " in r.stdout and "val bpb" in r.stdout
    a = [(r["step"], r["loss"], r["grad_norm"]) for r in _records(straight, "train")]
    b = [(r["step"], r["loss"], r["grad_norm"]) for r in _records(split, "train")]
    assert [s for s, _, _ in b] == list(range(1, 13))
    assert a == b  # bitwise: floats compared exactly

    # validation figures equal exactly; train_time_s is a wall-clock reading, different in every run
    def val(d):
        return [{k: v for k, v in r.items() if k != "train_time_s"} for r in _records(d, "val")]

    assert val(straight) == val(split)


def _fails(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "kiln: error:" in err and message in err and "Traceback" not in err


def test_bad_input_is_one_clear_message(tmp_path, capsys, tiny_run):
    out = str(tmp_path / "r")
    _fails(capsys, [*TINY, "--out", out, "--data", str(tmp_path / "missing.txt")], "does not exist")
    (tmp_path / "empty.txt").write_text("")
    _fails(capsys, [*TINY, "--out", out, "--data", str(tmp_path / "empty.txt")], "empty")
    _fails(capsys, [*TINY, "--out", out, "--train.nope=1"], "unknown config key config.train.nope")
    _fails(capsys, ["generate", "--checkpoint", str(tmp_path / "nope")], "does not exist")
    _fails(capsys, [*TINY, "--out", str(tmp_path / "fresh"), "--resume"], "nothing to resume")


def test_damaged_checkpoints_are_refused_and_good_ones_never_overwritten(tmp_path, capsys, tiny_run):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(tiny_run, run)
    ckpts = sorted((run / "checkpoints").glob("step_*.pt"))
    before = {p.name: p.read_bytes() for p in ckpts}
    # a second `run` into the same directory must not start over on top of it
    _fails(capsys, [*TINY, "--out", str(run)], "already holds a run")
    assert {p.name: p.read_bytes() for p in ckpts} == before
    latest = ckpts[-1]
    latest.write_bytes(before[latest.name][: len(before[latest.name]) // 3])  # truncated
    _fails(capsys, ["generate", "--checkpoint", str(run), "--prompt", "x"], "corrupt or truncated")
    data = bytearray(before[latest.name])
    data[len(data) // 2] ^= 0x55  # one flipped byte
    latest.write_bytes(bytes(data))
    _fails(capsys, ["generate", "--checkpoint", str(run), "--prompt", "x"], "corrupt or truncated")
    # --resume passes over it to the older, intact one (with a warning; test_run_reliability.py covers
    # that); both damaged, it has nothing to resume from
    ckpts[0].write_bytes(before[ckpts[0].name][:100])
    _fails(capsys, [*TINY, "--out", str(run), "--resume"], "no intact checkpoint")
    assert latest.read_bytes() == bytes(data)  # a damaged file is reported, never replaced


def test_console_script_reports_errors_without_traceback(tmp_path):
    kiln = Path(sys.executable).with_name("kiln")
    cmd = [str(kiln)] if kiln.exists() else [sys.executable, "-m", "kiln.cli"]
    r = subprocess.run(
        [*cmd, "run", "--preset", "tiny", "--out", str(tmp_path), "--model.bogus=1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert "unknown config key config.model.bogus" in r.stderr and "Traceback" not in r.stderr
