"""The ceilings: the cache (atomic, per device and torch version, refreshed on demand), the CPU errors,
the roofline bound, and on a GPU the measured figures against the device's datasheet bandwidth."""

import pytest
import torch

from kiln.cli import main
from kiln.errors import KilnError
from kiln.profile import ceilings as C
from kiln.profile.roofline import bound_seconds, op_row


def fake_doc(copy=4.0):
    return {"schema": C.SCHEMA, "date": "2026-12-02T00:00:00Z", "measure_s": 1.0, "device_name": "Fake GPU",
            "torch": torch.__version__, "values": {"dram_copy_TBps": copy, "dram_read_TBps": 4.5,
            "matmul_bf16_TFLOPs": 700.0, "matmul_fp32_TFLOPs": 50.0}, "methods": C.METHODS, "errors": {},
            "notes": {}}  # fmt: skip


def test_cache_is_read_written_and_refreshed(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 (fake)/x")
    monkeypatch.setattr(
        C, "measure_all", lambda device, log=None: calls.append(1) or fake_doc(4.0 + len(calls))
    )
    dev = torch.device("cuda")
    a = C.load_or_measure_ceilings(dev, directory=tmp_path)
    assert not a["cached"] and a["values"]["dram_copy_TBps"] == 5.0 and len(calls) == 1
    # the name reduced to [A-Za-z0-9._-]: "+" of a local torch version becomes "_"
    assert a["cache_path"].endswith(f"NVIDIA_H200_fake_x-{torch.__version__.replace('+', '_')}.json")
    b = C.load_or_measure_ceilings(dev, directory=tmp_path)
    assert b["cached"] and b["values"] == a["values"] and len(calls) == 1
    c = C.load_or_measure_ceilings(dev, refresh=True, directory=tmp_path)
    assert not c["cached"] and c["values"]["dram_copy_TBps"] == 6.0
    (tmp_path / a["cache_path"].split("/")[-1]).write_text("{not json")  # damaged: measured again
    d = C.load_or_measure_ceilings(dev, directory=tmp_path)
    assert not d["cached"] and len(calls) == 3
    assert [p.name for p in tmp_path.iterdir()] == [a["cache_path"].split("/")[-1]]  # no temp files left


def test_cpu_is_a_clear_error():
    with pytest.raises(KilnError, match="CUDA device"):
        C.load_or_measure_ceilings(torch.device("cpu"))
    c = C.measure_ceilings(torch.device("cpu"))  # what a benchmark's --smoke run records
    assert c["copy_TBps"] is None and c["bf16_matmul_TFLOPs"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
@pytest.mark.parametrize("what", [["ceilings"], ["roofline"]])
def test_cli_on_cpu_says_what_to_do(what, capsys):
    assert main(["profile", *what]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and "CUDA" in err


def test_roofline_bound_and_row():
    from kiln.profile.ops import Linear, RMSNorm

    v = fake_doc()["values"]
    bw = 4.5e12  # the larger of read and copy
    op = RMSNorm("n", rows=1024, cols=1024)  # memory bound
    t, kind = bound_seconds(op.flops(), op.bytes(), op.roof, v)
    assert kind == "memory" and t == pytest.approx(op.bytes() / bw)
    big = Linear("m", m=4096, n=4096, k=4096)  # compute bound: 2 * 4096^3 / 700e12
    t, kind = bound_seconds(big.flops(), big.bytes(), big.roof, v)
    assert kind == "compute" and t == pytest.approx(2 * 4096**3 / 700e12)
    row = op_row(big, ms=t * 1e3 * 2, values=v)  # twice the bound
    assert row["pct_of_bound"] == 50.0 and row["bound"] == "compute"
    assert bound_seconds(1, 1, "bf16", {}) == (None, None)


def test_roofline_smoke_writes_rows_and_plot(tmp_path):
    from kiln.profile import roofline

    doc = roofline.run(["rmsnorm"], tmp_path, smoke=True)
    assert [r["op"] for r in doc["rows"]] == ["rmsnorm"] and not doc["skipped"]
    assert (tmp_path / "roofline.png").exists() and (tmp_path / "roofline.json").exists()
    with pytest.raises(KilnError, match="unknown op"):
        roofline.run(["nope"], tmp_path, smoke=True)


@pytest.mark.gpu
def test_measured_ceilings_are_sane():
    dev = torch.device("cuda")
    doc = C.load_or_measure_ceilings(dev)  # this session's measurement when cached (the suite's first part)
    v = doc["values"]
    assert doc["measure_s"] < 60, doc["measure_s"]
    spec = C.spec_bandwidth(dev)
    if spec is not None:  # the copy cannot beat the datasheet (1.2x: clocks and rounding)
        assert v["dram_copy_TBps"] * 1e12 <= 1.2 * spec, (v["dram_copy_TBps"], spec)
        assert v["dram_read_TBps"] * 1e12 <= 1.2 * spec
    assert 0.1 < v["dram_copy_TBps"] < 20 and v["l2_read_TBps"] > v["dram_read_TBps"]
    if v["smem_TBps"] and v["spec_smem_TBps"]:  # the probe's byte count cannot beat the datasheet
        assert v["smem_TBps"] <= 1.2 * v["spec_smem_TBps"], (
            v["smem_TBps"],
            v["spec_smem_TBps"],
            doc["notes"],
        )
    assert v["matmul_bf16_TFLOPs"] > v["matmul_fp32_TFLOPs"] > 1
    assert 0 < v["graph_kernel_us"] < v["launch_triton_host_us"]
    assert v["h2d_pinned_GBps"] > 1
