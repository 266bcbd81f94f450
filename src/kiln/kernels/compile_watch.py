"""Which Triton kernels a stretch of code compiled (or loaded from Triton's disk cache), and for how long.

Triton compiles a kernel at the first launch of each specialization (and, under an autotuner, of each
config it times). In a server that is a step of seconds; a log that says so names the cause at once.
`CompileWatch` installs Triton's JIT hooks for the length of its `with` block: `jit_cache_hook` runs
just before a compile and `jit_post_compile_hook` just after it (Triton 3.6, `knobs.runtime`), so the
time between them is the compile's (or the disk-cache load's). Hooks already installed keep running
(each of ours calls the one it replaced), and the old ones are back after the block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from triton import knobs


@dataclass
class CompileWatch:
    """`with CompileWatch() as w:` ... `w.since(mark)`: the (kernel name, seconds) compiles after `mark`,
    a value of `w.mark()`. Keeps the last `keep` compiles (a long-running server's log, not a history)."""

    keep: int = 1000
    compiles: list[tuple[str, float]] = field(default_factory=list)
    count: int = 0  # compiles seen in all (the list keeps the last `keep`)
    _started: dict[str, float] = field(default_factory=dict)
    _saved: tuple | None = None

    def __enter__(self) -> CompileWatch:
        rt = knobs.runtime
        before, after = rt.jit_cache_hook, rt.jit_post_compile_hook
        self._saved = (before, after)

        def pre(**kw):
            self._started[kw["key"]] = time.perf_counter()
            return before(**kw) if before is not None else None  # truthy: Triton skips the compile

        def post(**kw):
            t0 = self._started.pop(kw["key"], None)
            self.count += 1
            self.compiles.append((kw["fn"].name, 0.0 if t0 is None else time.perf_counter() - t0))
            del self.compiles[: -self.keep]
            return after(**kw) if after is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        return self

    def __exit__(self, *exc) -> None:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved
        self._saved = None

    def mark(self) -> int:
        return self.count

    def since(self, mark: int) -> list[tuple[str, float]]:
        n = self.count - mark  # of which the list still holds the last `keep`
        return self.compiles[-n:] if n > 0 else []

    @staticmethod
    def describe(compiles: list[tuple[str, float]]) -> str:
        """'3 Triton compiles, 4.71 s: _attn_fwd_kernel x3' or '' when none."""
        if not compiles:
            return ""
        names: dict[str, int] = {}
        for name, _ in compiles:
            names[name] = names.get(name, 0) + 1
        kinds = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.items())
        return f"{len(compiles)} Triton compiles, {sum(s for _, s in compiles):.2f} s: {kinds}"
