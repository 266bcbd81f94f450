"""The CUDA kernels' index arithmetic checked on the CPU: the SGEMM ladder and the tensor-core GEMMs (mma.sync
and wgmma + TMA)
compiled with g++ against a host emulation of the CUDA model (emu/: threads of a block as std::threads,
__syncthreads a barrier, ldmatrix/mma/cp.async by their PTX ISA definitions), run on odd shapes and
compared exactly with a host product of integer-valued inputs.

This is what CI can check without a GPU: tiling, bounds checks, swizzled addresses, fragment
bookkeeping and the stage ring. It cannot check timing, the memory model or the hardware's reading of
the instructions: the GPU tests (test_kernels_gpu.py) remain the oracle.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

from kiln.kernels.cuda.build import CSRC
from kiln.kernels.cuda.ladder import MMA_CONFIGS, SKEWED_CONFIGS, WGMMA_CONFIGS

EMU = Path(__file__).resolve().parent / "emu"
GXX = shutil.which("g++")


def build_and_run(tmp_path: Path, main_cpp: str) -> subprocess.CompletedProcess:
    exe = tmp_path / "emu"
    cmd = [GXX, "-std=c++20", "-O1", "-pthread", "-w", f"-I{tmp_path}", f"-I{EMU}", f"-I{EMU / 'stub'}",
           f"-I{CSRC}", "-o", str(exe), str(EMU / main_cpp)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"g++ failed:\n{proc.stderr[-4000:]}"
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_sgemm_ladder_emulated(tmp_path):
    # the emulation launches from the launchers' own configuration tables (sgemm_kernels.cuh), not a copy
    emu = (EMU / "sgemm_emu.cpp").read_text()
    assert "#define KILN_WARPTILE_CONFIGS" not in emu and "#define KILN_SKEWED_CONFIGS" not in emu
    # the double-buffered kernel's dynamic shared memory (configs past 48 KiB) becomes a static array big
    # enough for every configuration; the patched header shadows csrc's (tmp_path comes first in -I)
    src = (CSRC / "sgemm_kernels.cuh").read_text()
    decl = "extern __shared__ __align__(16) float db_dyn_smem[];"
    assert src.count(decl) == 1
    biggest = max(c.smem_bytes for c in SKEWED_CONFIGS) // 4
    static = f"static float db_dyn_smem[{biggest}] __attribute__((aligned(16)));"
    (tmp_path / "sgemm_kernels.cuh").write_text(src.replace(decl, static))
    proc = build_and_run(tmp_path, "sgemm_emu.cpp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # per shape: steps 0-4; then x 2 (vec): steps 5, 6, the 4 other warp-tile configs, the 5 double-buffered,
    # the skewed kernel's configs
    runs = 5 + 2 * (11 + len(SKEWED_CONFIGS))
    assert proc.stdout.count(": 0 wrong") == 2 * runs, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_tensor_core_gemms_emulated(tmp_path):
    # the kernels' dynamic shared memory becomes a static array (the emulation has no launch-time size)
    src = (CSRC / "mma_kernels.cuh").read_text()
    decl = "extern __shared__ __align__(128) unsigned char smem[];"
    assert src.count(decl) == 1
    biggest = max(c.smem_bytes for c in MMA_CONFIGS if not c.tma)
    static = f"static unsigned char smem[{biggest}] __attribute__((aligned(128)));"
    # the TMA kernel's becomes the emulation's block memory (emu_smem, hopper_emu.h), as in the wgmma test
    decl_tma = "extern __shared__ unsigned char smem_tma[];"
    assert src.count(decl_tma) == 1 and any(c.tma for c in MMA_CONFIGS)
    src = src.replace(decl_tma, "unsigned char* smem_tma = emu_smem;")
    (tmp_path / "mma_kernels_emu.cuh").write_text(src.replace(decl, static))
    proc = build_and_run(tmp_path, "mma_emu.cpp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # per shape: bf16 at every configuration, e4m3 at config 0's geometry; a third shape for the persistent
    # ones; the TMA-fed ones with tiles past 128 x 128 on the first shape only
    persistent = sum(c.persistent for c in MMA_CONFIGS)
    tma_first_only = sum(c.tma and c.bm * c.bn > 128 * 128 for c in MMA_CONFIGS)
    expected = 2 * (len(MMA_CONFIGS) + 1) + persistent - tma_first_only
    assert persistent and proc.stdout.count(": 0 wrong") == expected, proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(GXX is None, reason="needs g++")
def test_wgmma_gemms_emulated(tmp_path):
    # the kernel's dynamic shared memory becomes the emulation's block memory (emu_smem, hopper_emu.h)
    src = (CSRC / "wgmma_kernels.cuh").read_text()
    decl = "extern __shared__ unsigned char smem_raw[];"
    assert src.count(decl) == 1
    (tmp_path / "wgmma_kernels_emu.cuh").write_text(src.replace(decl, "unsigned char* smem_raw = emu_smem;"))
    proc = build_and_run(tmp_path, "wgmma_emu.cpp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # bf16 and e4m3 at every configuration
    assert proc.stdout.count(": 0 wrong") == 2 * len(WGMMA_CONFIGS), proc.stdout
