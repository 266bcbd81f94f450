import json

import pytest
import torch

from kiln.errors import KilnError
from kiln.io.checkpoint import POINTER, latest_pointer, load_checkpoint, save_checkpoint


def _state(step):
    return {"model": {"w": torch.full((3,), float(step))}, "config": {"a": 1}, "step": step}


def test_save_points_at_the_newest_and_keeps_k(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _state(step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_0000020.pt", "step_0000030.pt"]
    assert latest_pointer(tmp_path)["step"] == 30
    assert load_checkpoint(tmp_path)["model"]["w"][0] == 30
    assert load_checkpoint(tmp_path / "step_0000020.pt")["step"] == 20
    assert not list(tmp_path.glob(".*tmp"))  # no temporary files left behind


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_is_reported_not_loaded(tmp_path, damage):
    path = save_checkpoint(tmp_path, 5, _state(5))
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(KilnError, match="corrupt or truncated"):
        load_checkpoint(tmp_path)


def test_unreadable_file_without_pointer_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.pt"
    bad.write_bytes(b"not a zip archive")
    with pytest.raises(KilnError, match="cannot be read"):
        load_checkpoint(bad)


def test_missing_and_corrupt_pointer(tmp_path):
    with pytest.raises(KilnError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(KilnError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    (tmp_path / POINTER).write_text("{oops")
    with pytest.raises(KilnError, match="corrupt"):
        load_checkpoint(tmp_path)
    (tmp_path / POINTER).write_text(json.dumps({"file": "step_1.pt"}))
    with pytest.raises(KilnError, match="corrupt"):
        latest_pointer(tmp_path)
