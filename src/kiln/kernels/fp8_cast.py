"""FP8 casts for training's GEMMs: a 2-D tensor into both layouts its two GEMMs read (q and its transpose),
or into one layout with a scale per row.

    t (R, C) float, s () float32  ->  q (R, C) and qt (C, R), both contiguous, in e4m3 or e5m2
    q[r, c] = qt[c, r] = fp8(clamp(t[r, c] * (1 / s), -fmax, fmax))     (each step rounded to nearest even)

Why: FP8 training (kiln.kernels.fp8_train) feeds each quantized tensor to two GEMMs that want it in two
layouts. torch._scaled_mm takes its first operand row-major and its second column-major, so x (tokens, K)
is read as is by the forward and transposed by the weight gradient, and the output gradient likewise by dX
and dW. Made by a copy after the cast, those transposes are ATen's byte-wise transposing copies: 68.7 ms of
a 241 ms step at the 1.1B shape on the H200 (bench/train.py --profile), more than the FP8 GEMMs themselves
(66.2 ms). Here the cast writes both layouts itself.

The scale is applied as a product with its reciprocal (an IEEE `div_rn` per scale a thread holds, as
torch's `1 / s`), the same math as kiln.kernels.fp8_train.quantize: bit-exact against torch, and cheap. A
per-element division is either Triton's approximate `div.full` (2 ulp: a value moves across an FP8
rounding boundary now and then) or the IEEE sequence, which cost the two-pass form's 1.1B training step
2.5% on the H200.

Forms (`CAST_FORMS`, `KILN_FP8_CAST`), the same bytes (tests/kernels/test_fp8_cast.py):
- "copy": no kernel: q by the reference, qt a transposed *view* of q, which the GEMM op lays out with
  ATen's copy (the path verified first on the H200).
- "one_pass": one kernel; a (BLOCK_R, BLOCK_C) tile is loaded, scaled, saturated and cast, and its bytes
  stored twice, the second store at transposed addresses (Triton moves the tile through shared memory).
  Only for 16-bit inputs: from a float32 tile, Triton 3.6 on sm_90 wrote about a quarter of the
  transposed bytes wrong, every time, both as a byte store at transposed addresses and after a tl.trans of
  the float32 tile (bench/experiments/fp8_cast_probe.py at af0a30b); float32 inputs (the master weights,
  the small tensors) take the two passes below.
- "two_pass": two launches of the one-layout kernel, the second on t's transposed view: t read twice.
The default is the H200's fastest whole training step (docs/perf/training.md); the CPU interpreter checks
every form.

Triton hazards stepped around: tiles are stored as their bytes (bitcast to uint8), never transposed as FP8
tensors (tl.trans of FP8 tiles has miscompiled, mlc-ai/pith-train#74); the saturation is two selects, not
min/max (min.NaN / max.NaN next to a transposed 1-byte store miscompiled, triton-lang/triton#11111).

The row-wise recipe needs one layout at a time, scaled per row of what is written: `fp8_cast(t, s)` writes
q (R, C) contiguous from any strided t, with s () or one scale per row (R, 1); handed t's transposed view and
the view's row scales, it writes the transposed layout with the scales along t's columns, so that GEMM
operand needs no copy either (the one-layout kernel the two-pass form runs).

Shapes: any 2-D t with any strides and a float dtype; s a one-element float32 tensor (both ops), or one per
row (`fp8_cast`). `fp8_cast_dual` and `fp8_cast` are torch.library custom ops (`kiln::fp8_cast_dual`,
`kiln::fp8_cast`), so torch.compile keeps the kernels as they are (no inductor codegen of the transposed
store) and fuses the amax that makes s into the neighbouring kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import env_form
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
CAST_FORMS = ("copy", "one_pass", "two_pass")
DEFAULT_FORM = "one_pass"  # 1.199x bf16 at 1.1B against two_pass 1.189x, copy 0.935x (docs/perf/training.md)
BLOCK_R, BLOCK_C = 64, 64  # a tile: 4096 values, 8 KB of bf16 in, 2 x 4 KB out


def cast_form() -> str:
    """The form in force: $KILN_FP8_CAST, else DEFAULT_FORM (module doc)."""
    return env_form("KILN_FP8_CAST", CAST_FORMS, DEFAULT_FORM)


def scaled_cast(tf: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(sat(tf * (1 / s))) for float32 tf and a float32 s that broadcasts against it: the math of every
    FP8 cast in training (kiln.kernels.fp8_train.quantize's too)."""
    fmax = FP8_MAX[dtype]
    return (tf * (1.0 / s)).clamp(-fmax, fmax).to(dtype)


def cast_ref(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference: q (R, C) contiguous in `dtype`; s () or one per row (R, 1)."""
    s = s.float().reshape(()) if s.numel() == 1 else s.float().reshape(-1, 1)
    return scaled_cast(t.float(), s, dtype).contiguous()


def cast_dual_ref(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of both layouts: (q (R, C), qt (C, R)) contiguous."""
    q = cast_ref(t, s, dtype)
    return q, q.t().contiguous()


@triton.jit
def _fp8_bytes(v, FMAX: tl.constexpr, E5M2: tl.constexpr):
    """float32 tile -> its FP8 bytes (uint8): saturated by selects (module doc), cast to nearest even."""
    v = tl.where(v > FMAX, FMAX, v)  # NaN stays NaN, as torch's clamp
    v = tl.where(v < -FMAX, -FMAX, v)
    if E5M2:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _cast_kernel(
    T_ptr,  # (R, C) float: t[r, c] at T_ptr + r * stride_tr + c * stride_tc
    S_ptr,  # float32: the scale (1,), or one per row (R,) when ROW_SCALE
    Q_ptr,  # (R, C) uint8 (the FP8 bytes), contiguous
    QT_ptr,  # (C, R) uint8, contiguous; written at transposed addresses when QT
    R,
    C,
    stride_tr,
    stride_tc,
    FMAX: tl.constexpr,
    E5M2: tl.constexpr,  # e5m2, else e4m3
    QT: tl.constexpr,  # also store the transpose (one_pass), else only q
    ROW_SCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (r < R)[:, None] & (c < C)[None, :]
    t = tl.load(T_ptr + r[:, None] * stride_tr + c[None, :] * stride_tc, mask=mask, other=0.0).to(tl.float32)
    if ROW_SCALE:  # one IEEE reciprocal per row of the tile, then products
        inv = tl.math.div_rn(1.0, tl.load(S_ptr + r, mask=r < R, other=1.0))[:, None]
    else:
        inv = tl.math.div_rn(1.0, tl.load(S_ptr))
    q = _fp8_bytes(t * inv, FMAX, E5M2)  # (BLOCK_R, BLOCK_C)
    tl.store(Q_ptr + r[:, None] * C + c[None, :], q, mask=mask)
    if QT:
        tl.store(QT_ptr + c[None, :] * R + r[:, None], q, mask=mask)


_cast_launch = CachedLaunch(_cast_kernel)


def _launch(t: torch.Tensor, s: torch.Tensor, q: torch.Tensor, qt: torch.Tensor | None, dtype) -> None:
    """q (R, C) and, when given, qt (C, R) from t (R, C) in one launch; s (1,) or (R,) float32."""
    R, C = t.shape
    if R and C:
        _cast_launch[(cdiv(R, BLOCK_R), cdiv(C, BLOCK_C))](
            t, s, q.view(torch.uint8), q.view(torch.uint8) if qt is None else qt.view(torch.uint8), R, C,
            t.stride(0), t.stride(1), FMAX=FP8_MAX[dtype], E5M2=dtype == E5M2, QT=qt is not None,
            ROW_SCALE=s.numel() > 1, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4,
        )  # fmt: skip


def cast_dual_triton(
    t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, form: str = "one_pass"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (q (R, C), qt (C, R)) contiguous in `dtype`, by the kernel form `form` (module doc)."""
    if form not in ("one_pass", "two_pass"):
        raise ValueError(f"cast_dual_triton: form must be one_pass or two_pass, got {form!r}")
    R, C = t.shape
    s = s.float().reshape(1)
    q = torch.empty((R, C), dtype=dtype, device=t.device)
    qt = torch.empty((C, R), dtype=dtype, device=t.device)
    if form == "one_pass" and t.element_size() <= 2:
        _launch(t, s, q, qt, dtype)
    else:  # two_pass, or a float32 t (module doc)
        _launch(t, s, q, None, dtype)
        _launch(t.t(), s, qt, None, dtype)
    return q, qt


def cast_triton(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Launcher: q (R, C) contiguous in `dtype` from t (R, C) of any strides; s () or one per row (R, 1)."""
    q = torch.empty(t.shape, dtype=dtype, device=t.device)
    _launch(t, s.float().reshape(-1), q, None, dtype)
    return q


def _check(name: str, t: torch.Tensor, s: torch.Tensor, rows: bool) -> None:
    if t.dim() != 2 or not (s.numel() == 1 or (rows and s.numel() == t.shape[0])):
        want = "one value or one per row" if rows else "one value"
        raise ValueError(f"{name}: t must be 2-D and s {want}, got {tuple(t.shape)} and {tuple(s.shape)}")


@torch.library.custom_op("kiln::fp8_cast", mutates_args=())
def fp8_cast(t: torch.Tensor, s: torch.Tensor, e5m2: bool) -> torch.Tensor:
    """t (R, C) float of any strides, s () or (R, 1) float32 -> q (R, C) contiguous FP8 (e5m2, else e4m3),
    q = fp8(sat(t * (1 / s))) with s per row where given so; the Triton kernel where kiln's kernels run,
    else the reference."""
    _check("fp8_cast", t, s, rows=True)
    dtype = E5M2 if e5m2 else E4M3
    return cast_triton(t, s, dtype) if use_triton(t) else cast_ref(t, s, dtype)


@fp8_cast.register_fake
def _(t, s, e5m2):
    return t.new_empty(t.shape, dtype=E5M2 if e5m2 else E4M3)


@torch.library.custom_op("kiln::fp8_cast_dual", mutates_args=())
def fp8_cast_dual(
    t: torch.Tensor, s: torch.Tensor, e5m2: bool, form: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) float, s one float32 -> (q (R, C), qt (C, R)) contiguous FP8 (e5m2, else e4m3) with
    q = qt^T = fp8(sat(t * (1 / s))); the Triton kernel form `form` where kiln's kernels run, else the
    reference."""
    _check("fp8_cast_dual", t, s, rows=False)
    dtype = E5M2 if e5m2 else E4M3
    if use_triton(t):
        return cast_dual_triton(t, s, dtype, form)
    return cast_dual_ref(t, s, dtype)


@fp8_cast_dual.register_fake
def _(t, s, e5m2, form):
    dtype = E5M2 if e5m2 else E4M3
    return t.new_empty(t.shape, dtype=dtype), t.new_empty((t.shape[1], t.shape[0]), dtype=dtype)
