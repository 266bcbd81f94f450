"""`train.checkpoint_format` and the resume rules of a dcp checkpoint, without launching processes.

The launches themselves (dcp written, resumed on the same and on another mesh, exported) are in
tests/dist/test_run.py; here: which format a run writes, and the clear errors of a resume that cannot
work (one process, another data-parallel size, shards missing).
"""

import json

import pytest

from kiln.cli import main
from kiln.config import format_config
from kiln.errors import KilnError
from kiln.io.checkpoint import save_checkpoint
from kiln.train.checkpoint import resolve_format, set_aside_later, sharded_name
from kiln.train.config import config_from_dict, resolve_config, to_dict
from kiln.train.env import DistEnv
from kiln.train.run import _check_resume


def test_auto_is_dcp_for_sharded_and_pipelined_runs_only():
    assert resolve_format("auto", gathers=True) == "dcp"
    assert resolve_format("auto", gathers=False) == "full"
    assert resolve_format("full", gathers=True) == "full"
    with pytest.raises(
        KilnError, match="holds the whole model on every rank: use train.checkpoint_format=full"
    ):
        resolve_format("dcp", gathers=False)
    with pytest.raises(KilnError, match="train.checkpoint_format must be auto, full or dcp"):
        resolve_config("tiny", overrides=["--train.checkpoint_format=zip"])


def _stub(tmp_path, cfg, dp_size=2, shards=True):
    """A run directory whose newest checkpoint is a dcp one (step 2): the .pt stub and its directory."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    (run / "config.json").write_text(format_config(cfg) + "\n")
    state = {"model": None, "optimizer": None, "sharded": sharded_name(2), "step": 2, "world_size": 4,
             "dp_size": dp_size, "config": to_dict(cfg)}  # fmt: skip
    save_checkpoint(ckpts, 2, state)
    if shards:
        (ckpts / sharded_name(2)).mkdir()
        (ckpts / sharded_name(2) / ".metadata").write_bytes(b"")
    return run, state


def test_a_dcp_checkpoint_resumes_only_under_torchrun(tmp_path, capsys):
    cfg = resolve_config("tiny", overrides=["--train.steps=4", "--device=cpu"])
    run, _ = _stub(tmp_path, cfg)
    assert main(["run", "--out", str(run), "--resume"]) == 2
    assert "is a sharded (dcp) checkpoint: resume it under torchrun" in capsys.readouterr().err


def test_a_dcp_checkpoint_with_missing_shards_is_named(tmp_path, capsys):
    cfg = resolve_config("tiny", overrides=["--train.steps=4", "--device=cpu"])
    run, _ = _stub(tmp_path, cfg, shards=False)
    assert main(["run", "--out", str(run), "--resume"]) == 2
    assert "names the sharded checkpoint" in capsys.readouterr().err


def test_the_mesh_may_change_but_not_the_data_parallel_size(tmp_path):
    old = resolve_config(
        "tiny", overrides=["--parallel.pp=2", "--parallel.dp_replicate=1", "--train.steps=4"]
    )
    _, state = _stub(tmp_path, old, dp_size=1)
    file = tmp_path / "run" / "checkpoints" / "step_0000002.pt"
    # the world of 2 split as tp=2 instead of pp=2: same data-parallel size (1), the parallel keys may change
    new = config_from_dict({**to_dict(old), "parallel": {**to_dict(old)["parallel"], "pp": 1, "tp": 2}})
    assert _check_resume(new, DistEnv(rank=0, local_rank=0, world_size=2), state, file, None) is None
    # 4 processes of plain data parallel: 4 data-parallel ranks where the checkpoint had 1
    wide = config_from_dict(
        {**to_dict(old), "parallel": {**to_dict(old)["parallel"], "pp": 1, "dp_replicate": -1}}
    )
    with pytest.raises(KilnError, match="written with 1 data-parallel rank"):
        _check_resume(wide, DistEnv(rank=0, local_rank=0, world_size=4), state, file, None)
    # a full checkpoint keeps its parallel settings
    full = {**state, "sharded": None}
    with pytest.raises(KilnError, match="parallel.pp: 2 -> 1"):
        _check_resume(new, DistEnv(rank=0, local_rank=0, world_size=2), full, file, None)


def test_set_aside_moves_the_shards_with_their_pt(tmp_path):
    cfg = resolve_config("tiny")
    run, _ = _stub(tmp_path, cfg)
    ckpts = run / "checkpoints"
    moved = set_aside_later(ckpts, 1)
    assert [p.name for p in moved] == ["step_0000002.pt.superseded"]
    assert (ckpts / "step_0000002.dcp.superseded" / ".metadata").is_file()
    assert not (ckpts / "step_0000002.dcp").exists()
    assert (
        json.loads((ckpts / "LATEST.json").read_text())["file"] == "step_0000002.pt"
    )  # io's pointer, as before
