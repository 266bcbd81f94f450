"""The one tolerance table for kernel tests, and the comparison that reports where it failed.

Every kernel test compares a kernel's output (in its working dtype) against a reference computed in
float64. The bound is `|got - want| <= atol + rtol * |want|` elementwise, with (atol, rtol) taken from
`TOLERANCE` by the dtype the kernel ran in. On failure the message gives the max and mean absolute
error, the worst element's index and both values there, and how many elements are out of bounds.

A test that needs a looser bound passes `scale=` (a multiplier on both atol and rtol) and must say why
in a comment next to the call (e.g. a reduction over 8192 terms accumulates more rounding than one
elementwise op).

tests/kernels is a package: import with `from ._tolerance import assert_close` from a test module there.
"""

from __future__ import annotations

import torch

# (atol, rtol) per dtype. bf16 has an 8-bit mantissa (relative step 2**-8 = 3.9e-3): one rounding of the
# output costs up to 2e-3 relative, and a kernel's inputs are bf16-rounded too, so 1.6e-2 covers a few
# roundings. fp16 has 11 bits (4.9e-4 step). fp32 results from fp32 math differ from float64 by a few
# ulps times the length of the reductions involved.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float]:
    """The (atol, rtol) for `dtype`, both multiplied by `scale`."""
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for dtype {dtype}: add it to TOLERANCE in _tolerance.py")
    atol, rtol = TOLERANCE[dtype]
    return atol * scale, rtol * scale


def error_report(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> str:
    """A one-line summary: max/mean abs error, where the worst is, and how many are out of bounds."""
    g = got.detach().to(device="cpu", dtype=torch.float64)
    w = want.detach().to(device="cpu", dtype=torch.float64)
    err = (g - w).abs()
    bound = atol + rtol * w.abs()
    bad = ~(err <= bound)  # NaN in either counts as bad
    if err.numel() == 0:
        return "empty tensors"
    worst = int(torch.nan_to_num(err - bound, nan=float("inf")).argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape)) if err.dim() else ()
    return (
        f"max abs err {err.max().item():.3e}, mean abs err {err.mean().item():.3e}; "
        f"worst at {idx}: got {g.flatten()[worst].item():.6g}, want {w.flatten()[worst].item():.6g}; "
        f"{int(bad.sum())}/{err.numel()} out of atol={atol:.1e} rtol={rtol:.1e}"
    )


def assert_close(
    got: torch.Tensor,
    want: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    scale: float = 1.0,
    atol: float | None = None,
    name: str = "output",
) -> None:
    """Assert `got` matches the float64 reference `want` within the table's bound for `dtype`.

    `dtype` defaults to `got.dtype` (the dtype the kernel computed in). Shapes must match exactly.
    `atol` replaces the table's absolute bound, for outputs whose scale is far from 1 (softmax
    probabilities of 1e-4 would pass any bf16 atol): the caller says why.
    """
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference shape {tuple(want.shape)}")
    table_atol, rtol = tolerance(dtype or got.dtype, scale)
    atol = table_atol if atol is None else atol
    g = got.detach().to(device="cpu", dtype=torch.float64)
    w = want.detach().to(device="cpu", dtype=torch.float64)
    ok = bool(((g - w).abs() <= atol + rtol * w.abs()).all())
    if not ok:
        raise AssertionError(f"{name} ({got.dtype}): {error_report(g, w, atol, rtol)}")


def _as_tuple(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def check_op(
    op,
    ref,
    inputs: list,
    *,
    grad_inputs: tuple[int, ...] | None = None,
    scale: float = 1.0,
    grad_scale: float | None = None,
    atol: float | None = None,
    grad_atol: float | None = None,
    seed: int = 0,
) -> None:
    """Compare `op(*inputs)` and its input gradients against `ref` run on float64 copies of the inputs.

    `inputs` holds tensors (in the dtype the kernel runs in, any strides: they are used as they are), None,
    or plain values. The gradients of
    the tensors at `grad_inputs` (default: every floating tensor) are checked: both sides get the same
    random upstream gradient for every output. The reference sees the exact same (rounded) input values,
    in float64, so what remains is the kernel's own error. `grad_scale` loosens only the gradients
    (default `scale`); `atol` and `grad_atol` replace the table's absolute bound for outputs and
    gradients (see `assert_close`). Callers say why where they pass any of these.
    """
    floating = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    grad_inputs = tuple(floating) if grad_inputs is None else grad_inputs
    got_in = [
        t.detach().requires_grad_(i in grad_inputs) if i in floating else t for i, t in enumerate(inputs)
    ]
    want_in = [
        t.detach().to(torch.float64).requires_grad_(i in grad_inputs) if i in floating else t
        for i, t in enumerate(inputs)
    ]
    got = _as_tuple(op(*got_in))
    want = _as_tuple(ref(*want_in))
    assert len(got) == len(want), f"op returned {len(got)} outputs, reference {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, scale=scale, atol=atol, name=f"output {k}")
    if not grad_inputs:
        return
    gen = torch.Generator().manual_seed(seed)
    ups = [torch.randn(g.shape, generator=gen, dtype=torch.float32).to(g.dtype) for g in got]
    torch.autograd.backward([g for g in got], [u.to(g.device) for g, u in zip(got, ups)])
    torch.autograd.backward([w for w in want], [u.to(torch.float64).to(w.device) for w, u in zip(want, ups)])
    for i in grad_inputs:
        assert got_in[i].grad is not None, f"input {i} got no gradient"
        assert_close(
            got_in[i].grad,
            want_in[i].grad,
            scale=grad_scale or scale,
            atol=grad_atol,
            name=f"grad of input {i}",
        )
