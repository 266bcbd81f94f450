"""The build helper on any machine: the toolchain errors, the cache key, the arch names, the cache root,
and the clean error a user gets from the kernels and `kiln bench cuda` without a CUDA torch."""

import shutil
from pathlib import Path

import pytest
import torch

from kiln.cli import main
from kiln.errors import KilnError
from kiln.kernels.cuda import build
from kiln.kernels.cuda.ops import mma_bf16, sgemm, vector_add

HAS_CUDA_TORCH = torch.version.cuda is not None and torch.cuda.is_available()
# what the first failing check says on this machine: a CPU-only torch, or a CUDA torch without a GPU
MISSING = "CUDA build of torch" if torch.version.cuda is None else "none is visible"


@pytest.mark.parametrize(
    "facts, needle",
    [
        (("2.13.0+cpu", None, False, None, False), "CPU-only"),
        (("2.11.0+cu130", "13.0", False, "/usr/bin/nvcc", True), "none is visible"),
        (("2.11.0+cu130", "13.0", True, None, True), "need nvcc"),
        (("2.11.0+cu130", "13.0", True, "/usr/bin/nvcc", False), "ninja"),
    ],
)
def test_check_toolchain_names_the_missing_piece(facts, needle):
    with pytest.raises(KilnError, match=needle):
        build.check_toolchain(*facts)


def test_check_toolchain_passes_with_everything():
    assert build.check_toolchain("2.11.0+cu130", "13.0", True, "/usr/bin/nvcc", True) is None


@pytest.mark.skipif(HAS_CUDA_TORCH, reason="the error path needs a machine without CUDA")
def test_kernels_raise_kiln_error_without_cuda_torch():
    build.load_extension.cache_clear()
    with pytest.raises(KilnError, match=MISSING):
        build.load_extension()
    # the ops check their inputs first: a CPU tensor is named as the problem, before any build
    x = torch.ones(4, 4)
    with pytest.raises(KilnError, match="CUDA tensors"):
        sgemm(x, x, "naive")
    with pytest.raises(KilnError, match="CUDA tensors"):
        vector_add(x, x)
    with pytest.raises(KilnError, match="CUDA tensors"):
        mma_bf16(x.bfloat16(), x.bfloat16())


@pytest.mark.skipif(HAS_CUDA_TORCH, reason="the error path needs a machine without CUDA")
def test_kiln_bench_cuda_is_a_clean_error_without_cuda(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and MISSING in err and "Traceback" not in err
    assert not out.exists()


def test_arch_names():
    assert build.arch_name((9, 0)) == "90a"
    assert build.arch_name((8, 0)) == "80"
    assert build.arch_name((8, 9)) == "89"
    assert build.arch_name((10, 0)) == "100"
    with pytest.raises(KilnError, match="7.5"):
        build.arch_name((7, 5))
    assert "-gencode=arch=compute_90a,code=sm_90a" in build.nvcc_flags("90a")


def test_sources_are_found_and_headers_are_not_compiled():
    names = {p.name for p in build.source_files()}
    assert {"api.h", "binding.cpp", "vector_add.cu", "probes.cu", "sgemm.cu", "mma.cu"} <= names
    compiled = {p.name for p in build.compiled_sources()}
    assert compiled == {n for n in names if n.endswith((".cu", ".cpp"))}
    assert "api.h" not in compiled and "sgemm_kernels.cuh" not in compiled


def test_cache_key_follows_sources_arch_and_versions(tmp_path):
    src = tmp_path / "csrc"
    shutil.copytree(build.CSRC, src)
    files = build.source_files(src)
    key = build.cache_key(files, "90a", "2.11.0", "13.0")
    assert key == build.cache_key(
        build.source_files(build.CSRC), "90a", "2.11.0", "13.0"
    )  # content, not path
    assert len(key) == 16 and int(key, 16) >= 0
    assert build.cache_key(files, "80", "2.11.0", "13.0") != key
    assert build.cache_key(files, "90a", "2.12.0", "13.0") != key
    assert build.cache_key(files, "90a", "2.11.0", "12.8") != key
    header = src / "sgemm_kernels.cuh"
    header.write_text(header.read_text() + "\n// an edit\n")  # a header edit rebuilds too
    assert build.cache_key(build.source_files(src), "90a", "2.11.0", "13.0") != key


def test_cache_root_and_build_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "k"))
    assert build.build_dir("abc") == tmp_path / "k" / "cuda" / "kiln_cuda_abc"
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert build.cache_root() == tmp_path / "x" / "kiln"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert build.cache_root() == Path(tmp_path / "h" / ".cache" / "kiln")
