"""The one switch between eager reference ops and Triton kernels.

Backends:
- "auto" (default): Triton on CUDA tensors, the eager reference elsewhere.
- "reference": always the eager reference (the CPU path, and a baseline on GPU).
- "triton": always Triton; on CPU tensors this needs Triton's interpreter (TRITON_INTERPRET=1 set
  before triton is imported), which is how the CPU test suite runs every kernel.

The choice comes from the KILN_KERNELS environment variable, and can be overridden for a block of
code with `use_backend(...)` (a context variable, so threads and tests do not leak into each other).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "reference", "triton")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("kiln_kernel_backend", default=None)


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


@torch.compiler.assume_constant_result
def backend() -> str:
    """The backend in force: the innermost `use_backend`, else $KILN_KERNELS, else "auto".

    torch.compile treats the answer as a constant of the compiled graph (reading a context variable
    would otherwise break the graph at every op): choose the backend before compiling.
    """
    name = _override.get()
    if name is None:
        name = os.environ.get("KILN_KERNELS", "auto") or "auto"
    return _check(name)


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a `with` block: `with use_backend("reference"): ...`."""
    token = _override.set(_check(name))
    try:
        yield
    finally:
        _override.reset(token)


def interpreting() -> bool:
    """True when Triton runs through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor | None) -> bool:
    """Whether an op called on `tensors` should take its Triton path."""
    name = backend()
    if name == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if name == "auto":
        return on_cuda
    if not on_cuda and not interpreting():
        raise RuntimeError(
            "kernel backend 'triton' was forced on CPU tensors, but Triton's interpreter is off: "
            "set TRITON_INTERPRET=1 before importing triton, or use the 'reference' backend"
        )
    return True


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`, for launchers that size persistent grids.

    Cached per GPU (the property query is a noticeable part of a small kernel's launch). Under the
    interpreter it is 4, so persistent loops still run more than one iteration in the CPU tests.
    """
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
