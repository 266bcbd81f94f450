"""The CUDA ladder benchmark's plots and tables from a result of the shape it writes (the measuring
part needs a GPU; its error path without one is in test_build.py)."""

import pytest

from kiln.profile.cuda_ladder import plot
from kiln.profile.report import format_table


def fake_result() -> dict:
    ladder = [{"step": i, "name": f"s{i}", "GFLOPs": 100.0 * (i + 1)} for i in range(7)]
    ladder += [{"step": None, "name": "warptiled_autotuned", "GFLOPs": 800.0, "config": 1},
               {"step": None, "name": "cublas_fp32", "GFLOPs": 900.0}]  # fmt: skip
    return {
        "sgemm": {"4096x4096x4096": ladder, "1000x1027x999": ladder},
        "probes": {
            "strided_reads": [{"stride": s, "GBps": 3000.0 / s} for s in range(1, 33)],
            "bank_conflicts": [{"stride": s, "slowdown": float(s)} for s in range(1, 34)],
            "latency": [{"bytes": 1 << p, "ns": float(p)} for p in range(12, 29)],
            "occupancy": [{"regs": r, "GBps": 4000.0 - r} for r in (32, 48, 80, 112)],
        },
    }


@pytest.mark.slow  # matplotlib: ~9 s on a busy 2-core machine
def test_plot_writes_one_png_per_ladder_shape_and_probe(tmp_path):
    written = plot(tmp_path / "cuda_ladder", fake_result())
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == sorted(["sgemm_4096x4096x4096.png", "sgemm_1000x1027x999.png", "strided_reads.png",
                            "bank_conflicts.png", "latency.png", "occupancy.png"])  # fmt: skip
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_tables_print_every_row():
    rows = fake_result()["sgemm"]["4096x4096x4096"]
    table = format_table(rows, [(c, c) for c in ("step", "name", "GFLOPs", "config")])
    assert len(table.splitlines()) == 2 + len(rows) and "warptiled_autotuned" in table
