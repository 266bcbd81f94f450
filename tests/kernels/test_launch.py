"""CachedLaunch: the specialization key, and on the GPU, cached launches equal to Triton's own."""

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from kiln.kernels import launch as L
from kiln.kernels.launch import CachedLaunch, _arg_key, fast_path_supported


def test_key_separates_what_triton_specializes():
    a = torch.zeros(8, dtype=torch.float32)
    assert _arg_key(a) != _arg_key(a[1:])  # 16-byte aligned vs not
    assert _arg_key(a) != _arg_key(a.half())  # dtype
    assert _arg_key(1) != _arg_key(2)  # the value 1
    assert _arg_key(16) != _arg_key(17)  # divisibility by 16
    assert _arg_key(16) != _arg_key(2**40)  # 32- vs 64-bit
    assert _arg_key(True) != _arg_key(False)
    assert _arg_key(0.5) == _arg_key(2.0)  # floats are runtime fp32 arguments, not specialized


def _scaled_copy(X, OUT, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offs, SCALE * tl.load(X + offs, mask=offs < n), mask=offs < n)


def test_key_takes_constexprs_by_value_positional_or_keyword():
    # a compiled JITFunction (not the interpreter's wrapper) carries the parameter list the key needs
    launch = CachedLaunch(JITFunction(_scaled_copy))
    x = torch.zeros(64)
    k2 = launch.key(0, (x, x, 64, 2, 32), {})
    k4 = launch.key(0, (x, x, 64, 4, 32), {})  # SCALE 2 vs 4: both "even", but different binaries
    assert k2 != k4
    assert launch.key(0, (x, x, 64), {"SCALE": 2, "BLOCK": 32}) != launch.key(
        0, (x, x, 64), {"SCALE": 4, "BLOCK": 32}
    )
    assert launch.key(0, (x, x, 64, 2, 32), {}) == k2  # and equal launches share one entry
    assert (
        launch.key(0, (x, x, 48, 2, 32), {}) == k2
    )  # runtime ints: only their class matters (48, 64 % 16 == 0)
    assert launch.key(0, (x, x, 50, 2, 32), {}) != k2


def test_generated_key_is_the_per_argument_key():
    """The key function generated per argument kinds gives, for each argument, what `_arg_key` gives
    (flattened), and constexprs by value, for every kind of argument a launcher passes."""
    launch = CachedLaunch(JITFunction(_scaled_copy))
    a, p = torch.zeros(64), torch.nn.Parameter(torch.zeros(64))
    for args in [(a, a, 64, 2, 32), (a[1:], p, 1, 2, 32), (a.half(), None, 2**40, 3, 16), (p, a, 17, 2, 32)]:
        want: list = []
        for x, const in zip(args, (False, False, False, True, True)):
            k = x if const else _arg_key(x)
            want += list(k) if isinstance(k, tuple) else [k]
        device, kinds, got, meta = launch.key(0, args, {"num_warps": 4})
        assert (device, kinds, got, meta) == (0, tuple(map(type, args)), tuple(want), (("num_warps", 4),))
    # a float argument is specialized by type only
    assert launch.key(0, (a, a, 0.5), {})[2] == launch.key(0, (a, a, 2.0), {})[2]


@triton.jit
def _axpy(X, Y, OUT, n, alpha, BLOCK: tl.constexpr, NEG: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    y = alpha * tl.load(X + offs, mask=ok) + tl.load(Y + offs, mask=ok)
    if NEG:
        y = -y
    tl.store(OUT + offs, y, mask=ok)


_axpy_cached = CachedLaunch(_axpy)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 1000, 4099])
def test_cached_launch_matches_plain_launch(n):
    base = torch.randn(2 * n + 8, device="cuda")
    for off in (0, 1, 3):  # misaligned views must not reuse the aligned binary
        x, y = base[off : off + n], base[n + off : 2 * n + off]
        for neg in (False, True):
            for _ in range(3):  # the first call compiles, the next ones take the cached handle
                out = torch.empty_like(x)
                _axpy_cached[(triton.cdiv(n, 256),)](x, y, out, n, 0.5, BLOCK=256, NEG=neg)
                want = -(0.5 * x + y) if neg else 0.5 * x + y
                torch.testing.assert_close(out, want)
    # defaults: NEG omitted takes the parameter's default
    out = torch.empty(n, device="cuda")
    for _ in range(2):
        _axpy_cached[(triton.cdiv(n, 256),)](base[:n], base[:n], out, n, 1.0, BLOCK=256)
        torch.testing.assert_close(out, 2 * base[:n])


@pytest.mark.gpu
def test_cached_launch_follows_the_current_stream_and_graph_capture():
    x = torch.randn(5000, device="cuda")
    out = torch.zeros_like(x)
    grid = (triton.cdiv(5000, 256),)
    _axpy_cached[grid](x, x, out, 5000, 1.0, BLOCK=256)  # compile outside the side stream
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out2 = torch.empty_like(x)
        _axpy_cached[grid](x, x, out2, 5000, 2.0, BLOCK=256)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(out2, 3 * x)
    g = torch.cuda.CUDAGraph()
    out3 = torch.empty_like(x)
    with torch.cuda.graph(g):
        _axpy_cached[grid](x, x, out3, 5000, 3.0, BLOCK=256)
    x.copy_(torch.ones_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out3, torch.full_like(x, 4.0))


@pytest.mark.gpu
def test_bound_launch_runs_the_binary_on_new_arguments():
    n = 1000
    x, y, out = torch.randn(n, device="cuda"), torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    run = _axpy_cached.bind((triton.cdiv(n, 256),), (x, y, out, n, 0.5), {"BLOCK": 256, "NEG": True})
    torch.testing.assert_close(out, -(0.5 * x + y))
    for alpha in (2.0, -1.0):  # new tensors, a new float: the same specialization
        x2, y2, out2 = torch.randn_like(x), torch.randn_like(x), torch.empty_like(x)
        run((x2, y2, out2, n, alpha))
        torch.testing.assert_close(out2, -(alpha * x2 + y2))


def test_fast_path_only_on_tested_triton_versions():
    assert fast_path_supported("3.6.0") and fast_path_supported("3.6.1+git0123abcd")
    for version in ("3.7.0", "3.5.1", "4.6.0", "36.0", "", "unknown"):
        assert not fast_path_supported(version), version


def test_untested_triton_takes_the_plain_launch(monkeypatch):
    """On a Triton version the fast path was not tested with, every launch (and every bound run) is the
    plain `fn[grid](...)`, and nothing is cached."""
    calls = []

    class Plain:  # stands in for a JITFunction: records the launches it receives
        params = []

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append((grid, args, meta)) or "kernel"

    monkeypatch.setattr(L, "interpreting", lambda: False)  # as on a GPU machine
    cached = L.CachedLaunch(Plain(), triton_version="3.7.0")
    assert not cached.fast
    assert cached[(3,)](1, 2, BLOCK=4) == "kernel"
    run = cached.bind((2,), (5,), {"BLOCK": 8})
    run((6,))
    assert calls == [((3,), (1, 2), {"BLOCK": 4}), ((2,), (5,), {"BLOCK": 8}), ((2,), (6,), {"BLOCK": 8})]
    assert cached.compiled == {}


def _triton_key(fn: JITFunction, args: tuple, meta: dict) -> str:
    """Triton's own compiled-kernel cache key for a launch of `fn` (JITFunction.run's `key`), computed for
    an sm_90 target without a GPU: the binder specializes each argument as the launch would."""
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    _, specialization, options = binder(*args, **meta)
    return compute_cache_key({}, specialization, options)


def test_key_is_at_least_as_fine_as_tritons_cache_key():
    """Two launches that share a CachedLaunch key must share Triton's compiled-kernel cache key: reusing a
    cached binary is then exactly what Triton would have done. Checked over tensors of every dtype and
    alignment, ints of every class, floats, None, constexprs positional and by keyword, launch options."""
    fn = JITFunction(_axpy.fn)  # under the interpreter `_axpy` wraps the Python function
    launch = CachedLaunch(fn)
    base = torch.zeros(64)
    tensors = [base, base[1:], base[4:], base.half(), base.half()[8:], base.bfloat16()[1:]]
    ints = [1, 2, 16, 48, 17, 2**31 - 16, 2**31, 2**40 + 1, -16, -(2**33)]
    launches = []
    for x in tensors:
        for y in (tensors[0], tensors[1], None):
            for n in ints:
                for alpha in (0.5, 2.0):
                    launches.append(((x, y, base, n, alpha), {"BLOCK": 32}))
                launches.append(((x, y, base, n, 1.0, 64), {"NEG": True}))
                launches.append(((x, y, base, n, 1.0), {"BLOCK": 64, "NEG": True, "num_warps": 8}))
    seen: dict[tuple, str] = {}
    for args, meta in launches:
        ours, theirs = launch.key(0, args, meta), _triton_key(fn, args, meta)
        assert seen.setdefault(ours, theirs) == theirs, (
            f"one CachedLaunch key, two Triton keys: {args} {meta}"
        )
    assert len(seen) > 50  # the launches do reach many specializations


@pytest.mark.gpu
def test_cached_kernel_is_tritons_own_compiled_kernel():
    """On the GPU: what the cache holds for a launch is the very CompiledKernel in Triton's per-device cache
    under Triton's key for that launch."""
    fn = _axpy  # a real JITFunction on the GPU
    cached = CachedLaunch(fn)
    base = torch.randn(4200, device="cuda")
    device = torch.cuda.current_device()
    for off, n, meta in [
        (0, 4096, {"BLOCK": 256}),
        (1, 4096, {"BLOCK": 256}),
        (0, 1, {"BLOCK": 256, "NEG": True}),
    ]:
        args = (base[off : off + n], base[off : off + n], torch.empty(n, device="cuda"), n, 0.5)
        for _ in range(2):
            cached[(triton.cdiv(n, 256),)](*args, **meta)
        kernel, _ = cached.compiled[cached.key(device, args, meta)]
        kernel_cache, _, _, _, binder = fn.device_caches[device]
        # the options JITFunction.run adds before binding
        debug = bool(fn.debug) or triton.knobs.runtime.debug
        meta_run = dict(meta, debug=debug, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
        _, spec, options = binder(*args, **meta_run)
        assert kernel_cache[compute_cache_key({}, spec, options)] is kernel
