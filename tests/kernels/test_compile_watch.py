"""CompileWatch: Triton's JIT hooks, timed and chained (the hooks are called here as Triton calls them
around a compile; no GPU compiles on the CPU machine)."""

from __future__ import annotations

from triton import knobs
from triton.runtime.jit import JitFunctionInfo

from kiln.kernels.compile_watch import CompileWatch


def _compile(name: str, key: str) -> None:
    kw = dict(key=key, repr="", fn=JitFunctionInfo("m", name, None), compile={}, is_manual_warmup=False,
              already_compiled=False)  # fmt: skip
    assert not knobs.runtime.jit_cache_hook(**kw)  # falsy: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(**kw)


def test_compiles_are_counted_named_and_hooks_chained(monkeypatch):
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["fn"].name))
    before = knobs.runtime.jit_post_compile_hook
    with CompileWatch(keep=2) as watch:
        _compile("_a", "1")
        mark = watch.mark()
        for i, name in enumerate(("_b", "_c", "_b")):
            _compile(name, str(i + 2))
        got = watch.since(mark)
        assert [n for n, _ in got] == ["_c", "_b"]  # the last `keep` of the 3 since the mark
        assert all(s >= 0 for _, s in got) and watch.count == 4
        assert watch.since(watch.mark()) == []
    assert seen == ["_a", "_b", "_c", "_b"]  # the hook that was there still ran
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is before
    assert CompileWatch.describe([]) == ""
    assert (
        CompileWatch.describe([("_b", 1.5), ("_c", 0.5), ("_b", 1.0)])
        == "3 Triton compiles, 3.00 s: _b x2, _c"
    )
