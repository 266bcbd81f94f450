"""FP8 training GEMMs (kiln.kernels.fp8_train): each of forward, dX and dW against float64 autograd, for
both recipes and both paths, eager and under torch.compile.

The two paths: the float32 emulation (the CPU's) and the `fp8_scaled_mm` op (the GPU's: torch._scaled_mm
with the operand layouts the op makes). The second runs here on torch's CPU _scaled_mm kernel by forcing
`use_scaled_mm`, so the CPU suite covers the code the H200 runs: which tensor is quantized along which
dim, the transposed views each GEMM reads, the scales' shapes. torch.compile uses inductor's CPU backend.
"""

from __future__ import annotations

import pytest
import torch

import kiln.kernels.fp8_train as fp8_train
from kiln.kernels.fp8_train import fp8_train_linear

# (M, K, N): every dim a multiple of 16 (the GPU path's rule), tokens >> features as in training
M, K, N = 256, 192, 96

# Relative Frobenius error against float64. Rounding to a format with m mantissa bits errs uniformly within
# half a step, a relative std of about 2**-m / sqrt(12) per element: 0.036 for e4m3 (m=3), 0.072 for e5m2
# (m=2). A GEMM of two quantized operands adds both in quadrature (~0.05 for e4m3 x e4m3, ~0.08 with e5m2);
# the bounds leave 1.5x of that. Measured here: tensorwise 0.038 / 0.059 / 0.059, rowwise 0.037 / 0.036 /
# 0.037 (forward / dX / dW). A transposed operand or a scale on the wrong side gives errors of order 1.
BOUND = {"tensorwise": (0.075, 0.12, 0.12), "rowwise": (0.075, 0.075, 0.075)}


def _cpu_scaled_mm_or_skip() -> None:
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:  # torch builds without a CPU _scaled_mm
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {str(e)[:80]}")


@pytest.fixture(params=["emulated", "scaled_mm"])
def path(request, monkeypatch) -> str:
    if request.param == "scaled_mm":
        _cpu_scaled_mm_or_skip()
        monkeypatch.setattr(fp8_train, "use_scaled_mm", lambda *tensors: True)
    return request.param


@pytest.fixture(params=["copy", "one_pass"])
def cast(request, monkeypatch) -> str:
    """The casts' form (kiln.kernels.fp8_cast): "copy", or a kernel form, which on the CPU runs the
    kiln::fp8_cast_dual (tensorwise) and kiln::fp8_cast (rowwise) ops' references: the contiguous transposed
    operands the kernels hand the GEMMs (the kernels' own bytes are tests/kernels/test_fp8_cast.py's)."""
    monkeypatch.setenv("KILN_FP8_CAST", request.param)
    return request.param


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * K**-0.5
    dy = torch.randn(M, N, generator=g)
    return x, w, dy


def _fp8_step(fn, x, w, dy):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(xr, wr)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def _float64(x, w, dy):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(dy.double())
    return y64.detach(), x64.grad, w64.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_gemm_against_float64(recipe, path, cast):
    x, w, dy = _inputs()
    got = _fp8_step(lambda a, b: fp8_train_linear(a, b, None, recipe), x, w, dy)
    errs = [_rel(g, want) for g, want in zip(got, _float64(x, w, dy), strict=True)]
    assert all(e <= b for e, b in zip(errs, BOUND[recipe], strict=True)), (recipe, path, cast, errs)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_path_equals_the_emulation(recipe, monkeypatch, cast):
    """The same quantized operands: the GPU path's op on torch's CPU kernel and the float32 emulation
    differ only in accumulation order (both round the result to bf16 once)."""
    _cpu_scaled_mm_or_skip()
    x, w, dy = _inputs(seed=2)
    emulated = _fp8_step(lambda a, b: fp8_train_linear(a, b, None, recipe), x, w, dy)
    monkeypatch.setattr(fp8_train, "use_scaled_mm", lambda *tensors: True)
    op = _fp8_step(lambda a, b: fp8_train_linear(a, b, None, recipe), x, w, dy)
    for a, b in zip(op, emulated, strict=True):
        assert _rel(a, b) < 1e-2  # within about 2 bf16 steps relative


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_equals_eager(recipe, path, cast):
    """Inductor (CPU) traces the Function: the compiled forward and both gradients are the eager ones up
    to float32 reassociation inside fused kernels, and stay within the float64 bounds."""
    x, w, dy = _inputs(seed=3)
    fn = lambda a, b: fp8_train_linear(a, b, None, recipe)  # noqa: E731
    torch._dynamo.reset()
    compiled = _fp8_step(torch.compile(fn, backend="inductor", fullgraph=True), x, w, dy)
    eager = _fp8_step(fn, x, w, dy)
    for a, b in zip(compiled, eager, strict=True):
        # a scale computed by a fused kernel may differ from eager's in its last bit, moving a few values
        # across an FP8 rounding boundary: far below the FP8 error itself (0.04-0.06), far above nothing
        assert _rel(a, b) < 1e-2
    errs = [_rel(g, want) for g, want in zip(compiled, _float64(x, w, dy), strict=True)]
    assert all(e <= b for e, b in zip(errs, BOUND[recipe], strict=True)), (recipe, path, cast, errs)


@pytest.mark.slow
def test_fp8_check_smoke(tmp_path):
    """bench/fp8_check.py (the H200 diagnostic) runs on the CPU: every GEMM variant, eager and compiled
    (aot_eager), and three eager training runs, ending in a verdict with nothing BAD."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(root / "bench" / "fp8_check.py"), "--smoke", "--out", str(tmp_path),
           "--steps", "2", "--runs", "bf16,fp8-eager,fp8-c598f16-eager"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "fp8_check.json").read_text())
    assert doc["commit"] == "smoke-test" and len(doc["gemms"]) == 12  # 6 eager, 6 compiled
    assert all(g["ok"] for g in doc["gemms"]), [g for g in doc["gemms"] if not g["ok"]]
    assert set(doc["runs"]) == {"bf16", "fp8-eager", "fp8-c598f16-eager"}
    assert not [line for line in doc["verdict"] if line.startswith(("BAD", "GEMM BAD", "ERROR"))], doc[
        "verdict"
    ]
    assert "== VERDICT ==" in proc.stdout
