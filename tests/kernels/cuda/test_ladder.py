"""The SGEMM ladder's registry agrees with the C launcher (csrc/sgemm.cu), and steps resolve by name."""

import dataclasses
import re

import pytest

from kiln.errors import KilnError
from kiln.kernels.cuda.build import CSRC
from kiln.kernels.cuda.ladder import (
    DOUBLE_BUFFERED_STEP_CONFIG,
    MMA_CONFIGS,
    SGEMM_LADDER,
    SKEWED_CONFIGS,
    WARPTILE_CONFIGS,
    WGMMA_CONFIGS,
    WGMMA_DEFAULT,
    MmaConfig,
    SkewedConfig,
    WgmmaConfig,
    step_index,
    wgmma_config_index,
)


def test_names_are_unique_and_ordered_like_the_launcher():
    names = [s.name for s in SGEMM_LADDER]
    assert len(set(names)) == len(names) == 8
    src = (CSRC / "sgemm.cu").read_text()
    assert re.search(r"kiln_sgemm_steps\(void\) \{ return (\d+); \}", src).group(1) == str(len(names))
    cases = [int(c) for c in re.findall(r"case (\d+):", src)]
    assert cases == list(range(len(names)))
    # each case launches the kernel of the step of that index (the names match the C templates)
    bodies = re.split(r"case \d+:", src.split("switch (step)")[1])[1:]
    for step, body in zip(SGEMM_LADDER, bodies):
        assert re.search(rf"\b{step.name}\b", body), f"case for {step.name} launches something else"


def test_step_index():
    assert step_index("naive") == 0 and step_index("warptiled") == 6 and step_index(3) == 3
    assert step_index("double_buffered") == 7
    for bad in ("fast", 8, -1, True, 2.0):
        with pytest.raises(KilnError, match="naive, coalesced"):
            step_index(bad)


def test_warptile_configs_match_the_launcher_and_the_first_is_step_6():
    src = (CSRC / "sgemm.cu").read_text()
    table = (
        (CSRC / "sgemm_kernels.cuh").read_text().split("#define KILN_WARPTILE_CONFIGS(X)")[1].split("\n\n")[0]
    )
    rows = re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", table)
    assert [int(r[0]) for r in rows] == list(range(len(WARPTILE_CONFIGS)))
    for r, cfg in zip(rows, WARPTILE_CONFIGS):
        assert tuple(int(v) for v in r[1:]) == (
            cfg.bm,
            cfg.bn,
            cfg.bk,
            cfg.wm,
            cfg.wn,
            cfg.wniter,
            cfg.tm,
            cfg.tn,
            cfg.threads,
        )
    assert re.search(r"kiln_sgemm_warptile_configs\(void\) \{ return (\d+); \}", src).group(1) == str(
        len(rows)
    )
    step6 = src.split("case 6:")[1].split("break;")[0]
    c0 = WARPTILE_CONFIGS[0]
    assert (
        f"warptiled<{c0.bm}, {c0.bn}, {c0.bk}, {c0.wm}, {c0.wn}, {c0.wniter}, {c0.tm}, {c0.tn}, {c0.threads}>"
        in step6
    )
    step7 = src.split("case 7:")[1].split("break;")[0]
    c1 = WARPTILE_CONFIGS[DOUBLE_BUFFERED_STEP_CONFIG]
    assert (
        f"double_buffered<{c1.bm}, {c1.bn}, {c1.bk}, {c1.wm}, {c1.wn}, {c1.wniter}, {c1.tm}, {c1.tn}, {c1.threads},"
        in step7
    )
    # the same constraints the kernel's static_asserts enforce, so a new row fails here before nvcc
    for cfg in WARPTILE_CONFIGS:
        warps = cfg.threads // 32
        assert (cfg.bn // cfg.wn) * (cfg.bm // cfg.wm) == warps
        wmiter = (cfg.wm * cfg.wn) // (32 * cfg.tm * cfg.tn * cfg.wniter)
        assert wmiter >= 1 and wmiter * 32 * cfg.tm * cfg.tn * cfg.wniter == cfg.wm * cfg.wn
        assert cfg.name


def test_wgmma_configs_match_the_kernel_table():
    src = (CSRC / "wgmma_kernels.cuh").read_text()
    table = src.split("#define KILN_WGMMA_CONFIGS(X)")[1].split("\n\n")[0]
    rows = re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+)\)", table)
    assert [int(r[0]) for r in rows] == list(range(len(WGMMA_CONFIGS)))
    for r, cfg in zip(rows, WGMMA_CONFIGS):
        assert tuple(int(v) for v in r[1:]) == (cfg.bm, cfg.bn, cfg.consumers, cfg.stages)
    assert 0 <= WGMMA_DEFAULT < len(WGMMA_CONFIGS)


def test_wgmma_config_arithmetic():
    cfg = WgmmaConfig(128, 256, 2, 4)
    # 4 stages x (128 + 256) rows x 128 bytes + 8 mbarriers + 1024 bytes of alignment slack
    assert cfg.smem_bytes == 4 * 384 * 128 + 64 + 1024 == 197696
    assert cfg.threads == 384 and cfg.name == "128x256 2cons 4st"
    for bad in ((128, 192, 1, 4), (128, 256, 1, 4), (96, 128, 1, 4), (128, 256, 2, 5), (128, 128, 1, 1)):
        with pytest.raises(KilnError, match="bad wgmma config"):
            WgmmaConfig(*bad)
    assert wgmma_config_index(0) == 0
    for bad in (len(WGMMA_CONFIGS), -1, True, "0"):
        with pytest.raises(KilnError, match="unknown wgmma config"):
            wgmma_config_index(bad)


def test_wgmma_ops_refuse_bad_arguments_before_any_cuda_call():
    import torch

    from kiln.kernels.cuda.ops import wgmma_bf16, wgmma_fp8

    a = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(KilnError, match="unknown wgmma config"):
        wgmma_bf16(a, a, 99)
    with pytest.raises(KilnError, match="CUDA tensors"):
        wgmma_bf16(a, a)
    with pytest.raises(KilnError, match="CUDA tensors"):
        wgmma_fp8(a.to(torch.float8_e4m3fn), a.to(torch.float8_e4m3fn), torch.ones(1), torch.ones(1))


def test_mma_configs_match_the_kernel_table():
    src = (CSRC / "mma_kernels.cuh").read_text()
    table = src.split("#define KILN_MMA_CONFIGS(X)")[1].split("\n\n")[0]
    rows = re.findall(
        r"X\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), ([01]), (\d+), ([01]), ([01]), ([01])\)", table
    )
    assert [int(r[0]) for r in rows] == list(range(len(MMA_CONFIGS)))
    for r, cfg in zip(rows, MMA_CONFIGS):
        assert tuple(int(v) for v in r[1:]) == (
            cfg.bm,
            cfg.bn,
            cfg.warps_m,
            cfg.warps_n,
            cfg.stages,
            int(cfg.pipelined),
            cfg.k_bytes,
            int(cfg.smem_epilogue),
            int(cfg.persistent),
            int(cfg.tma),
        )
    # the FP8 mma.sync launcher runs config 0's geometry, without the register pipeline
    c0 = MMA_CONFIGS[0]
    assert not c0.pipelined
    fp8 = (CSRC / "mma.cu").read_text().split("kiln_mma_fp8(int M")[1]
    assert f"launch<true, {c0.bm}, {c0.bn}, {c0.warps_m}, {c0.warps_n}, {c0.stages}, false>" in fp8
    assert MmaConfig(128, 256, 2, 4, 4).smem_bytes == 4 * 384 * 128
    assert MmaConfig(128, 256, 2, 4, 4).name == "128x256 warps 2x4 of 64x64 4st"
    assert MmaConfig(128, 256, 2, 4, 4, True).name == "128x256 warps 2x4 of 64x64 4st regpipe"
    c12 = MmaConfig(128, 256, 2, 4, 2, True, 256, True)
    assert (
        c12.smem_bytes == 2 * 384 * 256
        and c12.name == "128x256 warps 2x4 of 64x64 2st regpipe k128 smem-epilogue"
    )
    # persistent: the C tile must fit in one stage (A and B of one K tile): 128 x 256 at 128-byte K tiles
    # does not (64 KiB > 48 KiB), and only the pipelined shared-memory-epilogue kernel has the loop
    c14 = MmaConfig(128, 256, 2, 4, 2, True, 256, True, True)
    assert c14.name.endswith("k128 smem-epilogue persistent") and c14.smem_bytes == c12.smem_bytes
    for bad in ((128, 256, 2, 4, 4, True, 128, True, True), (128, 128, 2, 2, 3, False, 128, True, True)):
        with pytest.raises(KilnError, match="persistent"):
            MmaConfig(*bad)
    # two blocks per SM (<= 228 KiB together): config 7's tile and its smem-epilogue twin, not 4 stages
    for cfg in MMA_CONFIGS:
        if cfg.bm == cfg.bn == 128 and cfg.threads == 128 and cfg.stages == 3 and cfg.k_bytes == 128:
            assert 2 * cfg.smem_bytes <= 228 * 1024
    assert 2 * MmaConfig(128, 128, 2, 2, 4).smem_bytes > 228 * 1024
    # TMA-fed (gemm_tma): a producer warpgroup beside the consumers, the stages plus alignment slack and
    # two mbarriers a stage (two such blocks of config 19's tile fit an SM's 228 KiB, as config 9's do)
    t18 = MmaConfig(128, 256, 2, 4, 4, True, 128, True, tma=True)
    assert t18.threads == 384 and t18.smem_bytes == 4 * 384 * 128 + 1024 + 64
    assert t18.name.endswith("4st regpipe smem-epilogue tma warp-specialized")
    t19 = MmaConfig(128, 128, 2, 2, 3, True, 128, True, tma=True)
    assert t19.threads == 256 and 2 * (t19.smem_bytes + 1024) <= 228 * 1024
    for bad in (
        dict(pipelined=False, smem_epilogue=True),
        dict(pipelined=True, smem_epilogue=False),
        dict(pipelined=True, smem_epilogue=True, k_bytes=256),
        dict(pipelined=True, smem_epilogue=True, persistent=True),
    ):
        with pytest.raises(KilnError, match="bad mma config"):
            MmaConfig(128, 128, 2, 2, 2, tma=True, **bad)
    with pytest.raises(KilnError, match="whole warpgroups"):  # 2 warps: not a warpgroup
        MmaConfig(128, 128, 2, 1, 3, True, 128, True, tma=True)
    for bad in (
        (128, 128, 3, 4, 3),
        (128, 128, 2, 16, 3),
        (256, 256, 2, 4, 4),
        (128, 128, 2, 2, 3, True, 64),
        (128, 256, 2, 4, 3, True, 256),
    ):
        with pytest.raises(KilnError, match="bad mma config"):
            MmaConfig(*bad)


def test_skewed_configs_match_the_launcher():
    src = (CSRC / "sgemm.cu").read_text()
    table = (
        (CSRC / "sgemm_kernels.cuh").read_text().split("#define KILN_SKEWED_CONFIGS(X)")[1].split("\n\n")[0]
    )
    rows = re.findall(r"X\(" + ", ".join([r"(\d+)"] * 11) + r"\)", table)
    assert [int(r[0]) for r in rows] == list(range(len(SKEWED_CONFIGS)))
    for r, cfg in zip(rows, SKEWED_CONFIGS):
        # (bm, bn, bk, wm, wn, wniter, tm, tn, threads, min_blocks): the table's column order
        assert tuple(int(v) for v in r[1:]) == dataclasses.astuple(cfg)
    n = re.search(r"kiln_sgemm_skewed_configs\(void\) \{ return (\d+); \}", src).group(1)
    assert n == str(len(rows))
    # the launcher instantiates the kernel with the skew on
    assert "double_buffered<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB, true>" in src
    # config 0 is step 7's tile (the skew is the one change)
    c0, step7 = SKEWED_CONFIGS[0], WARPTILE_CONFIGS[DOUBLE_BUFFERED_STEP_CONFIG]
    assert dataclasses.astuple(c0)[:-1] == dataclasses.astuple(step7)


def test_skewed_config_arithmetic():
    # as ptxas reports: two buffers of (16 x 128 + 3 x 8) floats of A and 16 x 128 of B
    assert SKEWED_CONFIGS[0].smem_bytes == 2 * 4 * (16 * 128 + 24 + 16 * 128) == 32960
    assert SKEWED_CONFIGS[4].smem_bytes == 24704
    assert SKEWED_CONFIGS[0].name == "128x128x16 warp 64x32/2 thread 8x4 256t 2b/SM"
    # BK = 16 at 128 x 256 passes 48 KiB with the skew: dynamic shared memory (configs 8-10)
    assert SKEWED_CONFIGS[8].smem_bytes == 2 * 4 * (16 * 128 + 24 + 16 * 256) == 49344 > 48 * 1024
    # more than 227 KiB; a warp count that does not match; BK = 12
    for bad in (
        (512, 512, 32, 128, 128, 4, 8, 4, 512, 1),
        (128, 128, 16, 64, 32, 2, 8, 4, 128, 1),
        (128, 128, 12, 64, 32, 2, 8, 4, 256, 2),
    ):
        with pytest.raises(KilnError, match="bad skewed SGEMM config"):
            SkewedConfig(*bad)


def test_sgemm_skewed_refuses_bad_arguments_before_any_cuda_call():
    import torch

    from kiln.kernels.cuda.ops import sgemm_skewed

    a = torch.zeros(8, 8)
    with pytest.raises(KilnError, match="unknown skewed SGEMM config"):
        sgemm_skewed(a, a, len(SKEWED_CONFIGS))
    with pytest.raises(KilnError, match="CUDA tensors"):
        sgemm_skewed(a, a)


def _transposed_store_ways(cfg, skew: int) -> int:
    """The worst bank conflict of the double-buffered kernel's transposed A stores (stash in
    csrc/sgemm_kernels.cuh), modelled word by word: lane -> (aRow, aCol4), element j of its float4 goes to
    word (k + j) * BM + m + (k / 4) * skew. The most distinct words one bank serves in one instruction."""
    per_row = cfg.bk // 4
    stride = cfg.threads // per_row  # aStride: rows between one thread's float4s
    worst = 0
    for warp in range(cfg.threads // 32):
        for i in range(cfg.bm // stride):
            for j in range(4):
                banks: dict[int, set[int]] = {}
                for lane in range(32):
                    tid = warp * 32 + lane
                    m, k = tid // per_row + i * stride, (tid % per_row) * 4
                    word = (k + j) * cfg.bm + m + (k >> 2) * skew
                    banks.setdefault(word % 32, set()).add(word)
                worst = max(worst, max(len(w) for w in banks.values()))
    return worst


def test_the_skew_makes_the_transposed_store_conflict_free():
    # unskewed: a (BK/4)-way conflict (4-way at BK = 16, step 7's tile); skewed by 128 / BK floats per k-group: none
    step7 = WARPTILE_CONFIGS[DOUBLE_BUFFERED_STEP_CONFIG]
    assert _transposed_store_ways(step7, 0) == 4
    for cfg in SKEWED_CONFIGS:
        assert _transposed_store_ways(cfg, 0) == cfg.bk // 4
        assert _transposed_store_ways(cfg, 128 // cfg.bk) == 1, cfg.name


def test_the_mma_peak_probe_block_matches_the_probes_module():
    from kiln.kernels.cuda.probes import THREADS

    src = (CSRC / "mma_kernels.cuh").read_text()
    assert f"constexpr int PEAK_THREADS = {THREADS};" in src
