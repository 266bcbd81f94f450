"""Build once, then load, the CUDA C++ extension that holds every kernel of kiln.kernels.cuda.

All sources in csrc/ (the .cu files and the torch binding binding.cpp) compile into one extension
through `torch.utils.cpp_extension.load`, on first use in a process. The build lives in

    <cache root>/cuda/kiln_cuda_<key>/      cache root: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln,
                                            else ~/.cache/kiln

where <key> hashes every file in csrc/ (names and bytes), the nvcc flags, the GPU architecture and the
torch and CUDA versions: an edit to any source, another GPU generation or another torch gets its own
build directory, and an unchanged tree loads the finished build in a second (ninja finds nothing to do).
Code is generated for the one architecture of the GPU in use (`sm_90a` on Hopper, where the `a`
features need it; `sm_XY` elsewhere), which keeps a cold build to about a minute. ninja compiles the
sources in parallel: $MAX_JOBS is set to the number of sources when the caller has not set it.

Without a CUDA build of torch, a visible GPU, nvcc or ninja, `load_extension` raises KilnError naming
what is missing and how to get it; the check is `check_toolchain`, a pure function of those four facts.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

from kiln.errors import KilnError

CSRC = Path(__file__).resolve().parent / "csrc"
# Files that are compiled (headers are hashed too, but only included).
COMPILED_SUFFIXES = (".cu", ".cpp")
HASHED_SUFFIXES = (".cu", ".cpp", ".cuh", ".h")
# The oldest GPU the kernels support: cp.async, ldmatrix and bf16 mma.sync need sm_80 (Ampere).
MIN_CAPABILITY = (8, 0)


def source_files(csrc: Path = CSRC) -> list[Path]:
    """Every source and header of the extension, sorted by name (the order the key hashes them in)."""
    return sorted(p for p in csrc.iterdir() if p.suffix in HASHED_SUFFIXES)


def compiled_sources(csrc: Path = CSRC) -> list[Path]:
    return [p for p in source_files(csrc) if p.suffix in COMPILED_SUFFIXES]


def arch_name(capability: tuple[int, int]) -> str:
    """'90a' for compute capability (9, 0) (wgmma/TMA-era features need the arch-specific target),
    else '<major><minor>', e.g. '80', '89'. KilnError below MIN_CAPABILITY."""
    major, minor = capability
    if (major, minor) < MIN_CAPABILITY:
        raise KilnError(
            f"kiln's CUDA kernels need a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"or newer (cp.async, ldmatrix, bf16 mma.sync); this one is {major}.{minor}"
        )
    return f"{major}{minor}a" if (major, minor) == (9, 0) else f"{major}{minor}"


def nvcc_flags(arch: str) -> list[str]:
    """Flags for nvcc beyond torch's own (torch adds the C++ standard and its -D flags). A -gencode flag
    here also stops torch from adding its default list of architectures."""
    return ["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"]


def cache_key(files: list[Path], arch: str, torch_version: str, cuda_version: str | None) -> str:
    """sha256 (first 16 hex digits) of the sources, the flags, the arch and the versions."""
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join(nvcc_flags(arch)).encode() + b"\0")
    h.update(f"{arch}\0{torch_version}\0{cuda_version}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln"


def check_toolchain(
    torch_version: str, torch_cuda: str | None, gpu: bool, nvcc: str | None, ninja: bool
) -> None:
    """KilnError for the first missing piece of a CUDA extension build, in the order a user fixes them."""
    if torch_cuda is None:
        raise KilnError(
            f"kiln's CUDA kernels need a CUDA build of torch; this one ({torch_version}) is CPU-only: "
            "install torch from a CUDA wheel index (e.g. --index-url https://download.pytorch.org/whl/cu130)"
        )
    if not gpu:
        raise KilnError(
            "kiln's CUDA kernels need a CUDA GPU and none is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
        )
    if nvcc is None:
        raise KilnError(
            "kiln's CUDA kernels are compiled on first use and need nvcc, which was not found: install the "
            "CUDA toolkit and put its bin/ on PATH (or set CUDA_HOME)"
        )
    if not ninja:
        raise KilnError("kiln's CUDA kernels are compiled with ninja, which was not found: pip install ninja")


def find_nvcc() -> str | None:
    """nvcc under $CUDA_HOME / $CUDA_PATH / /usr/local/cuda (what torch's builder uses), else on PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc")


def ninja_available() -> bool:
    return shutil.which("ninja") is not None


def build_dir(key: str) -> Path:
    return cache_root() / "cuda" / f"kiln_cuda_{key}"


@functools.cache
def load_extension(verbose: bool = False):
    """The compiled extension module (built on the first call of a process with a changed tree; later
    calls in the process return the same module). KilnError when the toolchain is missing or the build
    fails (with the compiler's message)."""
    import torch

    check_toolchain(
        torch.__version__, torch.version.cuda, torch.cuda.is_available(), find_nvcc(), ninja_available()
    )
    arch = arch_name(torch.cuda.get_device_capability())
    key = cache_key(source_files(), arch, torch.__version__, torch.version.cuda)
    name = f"kiln_cuda_{key}"
    out = build_dir(key)
    out.mkdir(parents=True, exist_ok=True)
    sources = compiled_sources()
    os.environ.setdefault("MAX_JOBS", str(len(sources)))  # read by torch's ninja invocation
    from torch.utils.cpp_extension import load

    try:
        return load(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=["-O3"],
            extra_cuda_cflags=nvcc_flags(arch),
            extra_include_paths=[str(CSRC)],
            build_directory=str(out),
            verbose=verbose,
        )
    except (RuntimeError, OSError, ImportError) as e:
        raise KilnError(f"building kiln's CUDA extension in {out} failed: {e}") from e
