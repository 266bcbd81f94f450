"""Layers import downward only (STYLE.md): nothing below train/ may name it, so checkpoints and presets are
read by model/ without importing the training stack."""

from pathlib import Path

import kiln

SRC = Path(kiln.__file__).parent
BELOW_TRAIN = ("io", "configs", "tokenizer", "kernels", "model", "data")


def test_nothing_below_train_imports_it():
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for pkg in BELOW_TRAIN
        for path in sorted((SRC / pkg).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "kiln.train" in line
    ]
    assert offenders == []


def test_io_imports_nothing_but_errors_from_kiln():
    lines = [ln for p in (SRC / "io").rglob("*.py") for ln in p.read_text().splitlines()]
    kiln_imports = {ln.split()[1] for ln in lines if ln.startswith("from kiln")}
    assert kiln_imports <= {"kiln.errors", "kiln.io.atomic", "kiln.io.checkpoint"}
