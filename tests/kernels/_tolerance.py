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
    name: str = "output",
) -> None:
    """Assert `got` matches the float64 reference `want` within the table's bound for `dtype`.

    `dtype` defaults to `got.dtype` (the dtype the kernel computed in). Shapes must match exactly.
    """
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference shape {tuple(want.shape)}")
    atol, rtol = tolerance(dtype or got.dtype, scale)
    g = got.detach().to(device="cpu", dtype=torch.float64)
    w = want.detach().to(device="cpu", dtype=torch.float64)
    ok = bool(((g - w).abs() <= atol + rtol * w.abs()).all())
    if not ok:
        raise AssertionError(f"{name} ({got.dtype}): {error_report(g, w, atol, rtol)}")
