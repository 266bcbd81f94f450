"""A leaner launch path for Triton kernels that are called many times with few specializations.

`kernel[grid](*args, **meta)` costs about 17 us of host time per call on the H200's host (Triton 3.6:
it queries the device and stream, binds and specializes every argument, hashes a cache key, checks
global values, builds launch metadata and calls the (empty) launch-hook chains), against 9 us through
the compiled kernel's own handle (bench/host_overhead.py). For
a norm's forward+backward that is two launches on the critical path between the forward kernel and
the backward kernel, where the GPU sits idle waiting for the host.

`CachedLaunch(kernel)` keeps, per specialization, the compiled kernel Triton returned at its first
launch, and launches it directly afterwards. The key is built so that it is at least as fine as
Triton's own specialization, so a cached kernel is only reused where Triton would have picked the same
binary: each tensor's dtype and 16-byte alignment, each int's value class (== 1, divisible by 16,
32- or 64-bit), the current device, and every constexpr (positional or keyword) and launch option by
value.
Floats are not specialized by Triton (they are fp32 arguments), so only their type enters the key.
The key is computed by a function generated once per tuple of argument types, with every argument's
expression inlined, and a hit also holds the trailing constexpr arguments the handle takes: on the
2-core CPU machine that took a 12-argument key from 4.2 to 2.3 us. Under the interpreter, and while
torch.compile traces, it defers to the plain launch.

The fast path calls Triton internals that are not a public API (the compiled kernel's `run` and its
argument order, `knobs.runtime` hooks, `driver.active.get_current_stream`), so it is taken only on the
Triton versions it was tested with (`TESTED_TRITON`, major.minor); on any other version every launch is
the plain `fn[grid](...)`, slower on the host but correct.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime import driver

from kiln.kernels.dispatch import interpreting

# Triton (major, minor) versions the fast path was written and tested against: tests/kernels/test_launch.py
# checks its key against 3.6's own specialization, and the GPU tests run its launches on the H200.
TESTED_TRITON = ((3, 6),)


def fast_path_supported(version: str) -> bool:
    """Whether CachedLaunch may bypass `fn[grid]` on Triton `version` (e.g. "3.6.0", "3.7.0+git1234")."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return m is not None and (int(m.group(1)), int(m.group(2))) in TESTED_TRITON


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. `triton.cdiv` is a JIT function: ~4-5 us per call from Python, which
    four calls per GEMM launch turned into a fifth of its host time."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), on the host (`triton.next_power_of_2` is a JIT
    function too)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _arg_key(a: Any) -> Any:
    """One argument's share of the key, for any kind of argument (the generated keys inline this)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (a == 1, a & 15 == 0, -(2**31) <= a < 2**31, a >= 2**63)
    if isinstance(a, float):
        return float
    return a


def _key_function(kinds: tuple[type, ...], constexpr: list[bool]) -> Callable[[tuple], tuple]:
    """A function of the positional arguments, for calls whose arguments have the types `kinds`, returning
    what `_arg_key` would for each, as one flat tuple: generated once per kinds, with each argument's
    expression inlined (a Python call per argument cost as much as the rest of the launch path)."""
    parts = []
    for i, (kind, is_const) in enumerate(zip(kinds, constexpr)):
        a = f"a[{i}]"
        if is_const:  # by value: every constexpr value is its own binary
            parts.append(a)
        elif issubclass(kind, torch.Tensor):
            parts += [f"{a}.dtype", f"{a}.data_ptr() & 15 == 0"]
        elif kind is int:
            parts += [f"{a} == 1", f"{a} & 15 == 0", f"-2147483648 <= {a} < 2147483648", f"{a} >= 1 << 63"]
        elif kind is float:  # a runtime fp32 argument: its type (in the key's kinds) is all that matters
            continue
        else:
            parts.append(f"_arg_key({a})")
    return eval(f"lambda a: ({', '.join(parts)},)", {"_arg_key": _arg_key})  # noqa: S307 - our own text


def _hooks_active() -> bool:
    """Whether a launch hook (e.g. Triton's proton profiler) is installed: in Triton 3.6 the hook is an
    always-present chain, empty unless a profiler adds to it."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLaunch:
    """Wraps a @triton.jit function: `CachedLaunch(fn)[grid](*args, **meta)` launches like `fn[grid]`.

    The cache belongs to this wrapper (one per kernel, built at import like the kernel itself) and only
    ever grows by one compiled binary per specialization, as Triton's own cache does.
    """

    def __init__(self, fn, triton_version: str = triton.__version__) -> None:
        self.fn = fn
        # the cached handle only where it was tested (module docstring), and never under the interpreter
        # (fixed once triton is imported, as the kernel itself is); else every launch is plain
        self.fast = not interpreting() and fast_path_supported(triton_version)
        # key -> (the compiled kernel, the trailing arguments its handle takes after the positional ones)
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        # parameter names and defaults (the interpreter's wrapper has neither, and never needs them)
        params = getattr(fn, "params", [])
        self.names: list[str] = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.has_default}
        # a constexpr passed positionally is keyed by its value, like one passed by keyword
        self.constexpr = [p.is_constexpr for p in params]
        self.key_functions: dict[tuple[type, ...], Callable[[tuple], tuple]] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return lambda *args, **meta: self.launch(grid, args, meta)

    def key(self, device: int, args: tuple, meta: dict[str, Any]) -> tuple:
        """The cache key of a launch: finer than Triton's specialization (see the module docstring)."""
        kinds = tuple(map(type, args))
        f = self.key_functions.get(kinds)
        if f is None:
            f = self.key_functions[kinds] = _key_function(kinds, self.constexpr)
        return (device, kinds, f(args), tuple(meta.items()))

    def bind(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> Callable[[tuple], Any]:
        """Launch once with (args, meta), and return `run(new_args)` that launches the same binary on
        the same grid with other positional arguments, without computing a key. The caller guarantees
        that the new arguments specialize as `args` did (kinds, dtypes, 16-byte alignment, int classes),
        e.g. by memoizing `run` under a key holding all of those (matmul_fwd's plans)."""
        kernel = self.launch(grid, args, meta)
        entry = self.compiled.get(self.key(torch.cuda.current_device(), args, meta)) if self.fast else None
        if entry is None:  # the interpreter, an untested Triton, torch.compile tracing or a profiler hook
            return lambda new_args: self.launch(grid, new_args, meta)
        rest = entry[1]
        device = torch.cuda.current_device()
        g0, g1, g2 = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1

        def run(new_args: tuple) -> Any:
            if torch.cuda.current_device() != device or _hooks_active() or torch.compiler.is_compiling():
                return self.launch(grid, new_args, meta)
            kernel.run(
                g0, g1, g2, driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
                None, None, None, *new_args, *rest,
            )  # fmt: skip
            return kernel

        return run

    def launch(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> Any:
        if not self.fast or torch.compiler.is_compiling():
            # the interpreter or an untested Triton version; or torch.compile tracing, which captures a plain launch of a @triton.jit
            # function into its graph (it could not trace this cache's data_ptr keys)
            return self.fn[grid](*args, **meta)
        device = torch.cuda.current_device()
        key = self.key(device, args, meta)
        hit = self.compiled.get(key)
        if hit is None or _hooks_active():
            # first launch of this specialization (compile or load through Triton), or a profiler hook
            # that wants Triton's launch metadata: the plain path
            kernel = self.fn[grid](*args, **meta)
            # the compiled handle takes every parameter in order, constexprs included: those after the
            # positional ones come from the keywords (in the key) or the defaults
            rest = tuple(meta[n] if n in meta else self.defaults[n] for n in self.names[len(args) :])
            self.compiled[key] = (kernel, rest)
            return kernel
        kernel, rest = hit
        kernel.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            driver.active.get_current_stream(device), kernel.function, kernel.packed_metadata,
            None, None, None, *args, *rest,
        )  # fmt: skip
        return kernel
