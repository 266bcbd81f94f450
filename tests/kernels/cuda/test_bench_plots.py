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


def test_goals_and_verdict_name_the_fastest_kernel_of_each_kind():
    from kiln.profile.cuda_ladder import goals, verdict

    result = {
        "sgemm": {
            "4096x4096x4096": [
                {"name": "double_buffered", "vs_cublas": 0.858, "ms": 3.12},
                {"name": "skewed_autotuned", "vs_cublas": 0.91, "ms": 2.9, "config": 1, "tiles": "t1"},
                {"name": "cublas_fp32", "vs_cublas": 1.0, "ms": 2.68},
            ]
        },
        "tensor_cores": {
            "4096x4096x4096": [
                {"name": "mma_bf16", "vs_peer": 0.40, "ms": 0.44},
                {"name": "mma_bf16_config_5", "vs_peer": 0.55, "ms": 0.33},
                {"name": "mma_bf16_config_7", "vs_peer": None, "ms": None, "error": "worker exited"},
                {
                    "name": "mma_bf16_autotuned",
                    "vs_peer": 0.55,
                    "ms": 0.33,
                    "config": 5,
                    "tiles": "t5",
                    "failed_configs": {"7": "worker exited with status 1"},
                },  # fmt: skip
                {"name": "mma_fp8", "vs_peer": 0.9, "ms": 0.2},  # another kind: not this goal
                {"name": "cublas_bf16", "vs_peer": 1.0, "ms": 0.18, "TFLOPs": 760.0},
            ]
        },
        "mma_sync_peak": {"TFLOPs": 494.0},
    }
    g = goals(result)
    assert g["sgemm_vs_cublas_fp32"]["met"] and g["sgemm_vs_cublas_fp32"]["config"] == 1
    mma = g["mma_bf16_vs_cublas_bf16"]
    assert (
        not mma["met"]
        and mma["best"] == 0.55
        and mma["kernel"] == "mma_bf16_autotuned"
        and mma["config"] == 5
    )
    text = verdict(g)
    assert "sgemm_vs_cublas_fp32: MET  best 0.910x (goal 0.9x) by skewed_autotuned config 1 (t1)" in text
    assert "mma_bf16_vs_cublas_bf16: MISSED  best 0.550x (goal 0.6x)" in text
    assert mma["instruction_ceiling_vs_cublas"] == 0.65 and "494.0 TFLOP/s = 0.650x cuBLAS bf16" in text
    assert "config 7 failed: worker exited with status 1" in text
    # nothing measured at all (every kernel failed): MISSED, not a crash
    empty = goals({"sgemm": {}, "tensor_cores": {}})
    assert not any(v["met"] for v in empty.values()) and "no kernel measured" in verdict(empty)


def test_a_failed_section_is_one_error_row_and_is_not_plotted(tmp_path):
    from kiln.profile.cuda_ladder import _section, goals

    def faulting(bench, shape):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rows = _section(faulting, None, (8, 8, 8))
    assert rows == [
        {"name": "error", "error": "faulting (8, 8, 8): CUDA error: an illegal memory access was encountered"}
    ]
    result = fake_result()
    result["sgemm"]["4096x4096x4096"] = rows
    result["tensor_cores"] = {"4096x4096x4096": rows}
    assert not any(v["met"] for v in goals(result).values())


def test_tensor_core_bars_take_each_kinds_fastest_and_skip_what_was_not_measured():
    from kiln.profile.cuda_ladder import _tensor_core_bars

    rows = [{"name": "mma_bf16", "TFLOPs": 300.0}, {"name": "mma_bf16_autotuned", "TFLOPs": 480.0, "config": 18},
            {"name": "cublas_bf16", "TFLOPs": 780.0}, {"name": "mma_fp8", "TFLOPs": None, "error": "fault"},
            {"name": "scaled_mm_fp8", "TFLOPs": 1290.0}]  # fmt: skip
    wgmma = {"bf16 64x64x64": [{"name": "wgmma_bf16", "TFLOPs": 600.0}, {"name": "wgmma_bf16", "TFLOPs": 640.0},
                               {"name": "cublas_bf16", "TFLOPs": 700.0}]}  # fmt: skip
    assert _tensor_core_bars("64x64x64", rows, wgmma) == [
        ("mma.sync bf16", 300.0, False),
        ("mma.sync bf16 best (config 18)", 480.0, False),
        ("wgmma bf16 best", 640.0, False),
        ("cuBLAS bf16", 780.0, True),
        ("_scaled_mm FP8", 1290.0, True),
    ]


def test_replot_redraws_from_a_result_json_and_refuses_a_bad_one(tmp_path):
    import json

    from kiln.errors import KilnError
    from kiln.profile.cuda_ladder import main

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(KilnError, match="cannot read a result JSON"):
        main(["--replot", str(bad)])
    good = tmp_path / "ladder.json"
    good.write_text(json.dumps(fake_result()))
    assert main(["--replot", str(good)]) == 0
    assert (tmp_path / "ladder" / "sgemm_4096x4096x4096.png").read_bytes()[:4] == b"\x89PNG"
