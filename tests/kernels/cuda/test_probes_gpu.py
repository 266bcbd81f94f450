"""The memory probes run and show the effects they exist to show (small sweeps; the benchmark runs the
full ones). Each bound below is far from the measured effect: a 32-way bank conflict is ~30x slower than
none, stride-32 reads use 1/8 of each sector, DRAM latency is several times L1's."""

import pytest

from kiln.kernels.cuda import probes

pytestmark = pytest.mark.gpu


def test_strided_reads_lose_bandwidth():
    rows = {r["stride"]: r for r in probes.strided_reads(strides=(1, 2, 32), n=1 << 22)}
    assert rows[1]["GBps"] > 2 * rows[32]["GBps"] > 0
    assert rows[32]["sector_use"] == 0.125 and rows[1]["sector_use"] == 1.0


def test_bank_conflicts_and_the_padded_fix():
    rows = {r["stride"]: r for r in probes.bank_conflicts(strides=(1, 2, 32, 33), iters=1024)}
    assert rows[32]["predicted_ways"] == 32 and rows[33]["predicted_ways"] == 1
    assert rows[32]["slowdown"] > 4
    assert rows[33]["slowdown"] < 2


def test_latency_grows_with_the_working_set():
    rows = probes.latency(sizes=(1 << 14, 1 << 27), iters=1024)
    small, large = rows
    assert 0 < small["cycles"] < large["cycles"]
    assert large["ns"] > 2 * small["ns"] > 0


def test_occupancy_falls_as_registers_rise():
    rows = probes.occupancy(n_bytes=1 << 26)
    regs = [r["regs"] for r in rows]
    warps = [r["warps_per_sm"] for r in rows]
    assert regs == sorted(regs) and regs[-1] > regs[0]
    assert warps == sorted(warps, reverse=True) and warps[-1] < warps[0]
    assert all(r["GBps"] > 0 for r in rows)


def test_mma_sync_peak_runs_every_mma():
    # every thread's sum is exactly chains * 4 * iters * 16 (bf16 1.0 operands, fp32 sums exact here)
    r = probes.mma_sync_peak(iters=256, blocks_per_sm=2)
    assert r["exact"] and r["TFLOPs"] > 0 and r["chains"] >= 1
