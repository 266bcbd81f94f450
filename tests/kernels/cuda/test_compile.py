"""Every .cu source compiles with nvcc where nvcc exists (CI's CPU machines have it; nothing runs there).

PTX for each file catches every C++ error in seconds; the tensor-core file also goes through ptxas to a
cubin, since only ptxas checks the inline mma/ldmatrix/cp.async assembly. The flags are the build's
(kiln.kernels.cuda.build.nvcc_flags for sm_90a) plus the -D flags torch's builder adds, which turn off
implicit bf16/half conversions (the kernels must not rely on them).
"""

import re
import subprocess

import pytest

from kiln.kernels.cuda import build

NVCC = build.find_nvcc()
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]
CU_FILES = sorted(p.name for p in build.CSRC.glob("*.cu"))


def nvcc(name: str, out, *mode: str) -> subprocess.CompletedProcess:
    cmd = [NVCC, "-std=c++17", *TORCH_NVCC_FLAGS, *build.nvcc_flags("90a"), *mode, "-o", str(out),
           str(build.CSRC / name)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("name", CU_FILES)
def test_cu_source_compiles_to_ptx(name, tmp_path):
    proc = nvcc(name, tmp_path / "x.ptx", "--ptx")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["mma.cu", "wgmma.cu"])
def test_tensor_core_assembly_assembles(name, tmp_path):
    proc = nvcc(name, tmp_path / "x.cubin", "--cubin", "--resource-usage")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-4000:]
    # no kernel spills registers to local memory (a spill in a GEMM main loop costs a large factor)
    spills = re.findall(r"(\d+) bytes spill stores", proc.stdout + proc.stderr)
    assert spills and all(s == "0" for s in spills), (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("name", ["wgmma.cu", "mma.cu"])
def test_hopper_kernels_compile_for_ampere_too(name, tmp_path):
    # the extension is built for the GPU in use: the files with Hopper kernels (wgmma, and mma.cu's TMA-fed
    # configurations) must still compile for sm_80 (those kernels trap there, and the launchers refuse
    # first), or the whole extension would fail to build on an A100
    cmd = [NVCC, "-std=c++17", *TORCH_NVCC_FLAGS, "-O3", "-gencode=arch=compute_80,code=sm_80", "--cubin",
           "-o", str(tmp_path / "x.cubin"), str(build.CSRC / name)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_every_cu_file_is_compiled_by_the_extension():
    assert set(CU_FILES) <= {p.name for p in build.compiled_sources()}
    assert set(CU_FILES) == {"vector_add.cu", "probes.cu", "sgemm.cu", "mma.cu", "wgmma.cu"}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_sgemm_kernels_do_not_spill(tmp_path):
    # the 256-thread SGEMM kernels are held to 128 registers (2 blocks per SM); the skewed layout exists
    # partly because an XOR swizzle spilled there: a spill in the FMA loop would cost more than the skew gains
    proc = nvcc("sgemm.cu", tmp_path / "x.cubin", "--cubin", "--resource-usage")
    assert proc.returncode == 0, proc.stderr[-4000:]
    spills = re.findall(r"(\d+) bytes spill stores", proc.stdout + proc.stderr)
    assert spills and all(s == "0" for s in spills), (proc.stdout + proc.stderr)[-4000:]
