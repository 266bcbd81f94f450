"""Helpers shared by several kernel modules: row layouts, launch sizing, autograd checks, and the Triton
functions that more than one kernel calls (the norms' deterministic partial-row sums, GEMM epilogue
activations). Nothing here is an op of its own.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels.dispatch import interpreting, sm_count

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 65536  # a longer row would not fit in one program's registers
# The backward's final sums (`sum_partial_rows`): programs per first-level group, and the int32 counters
# the forward zeroes after its statistics (counter 0 for the groups, 1 + g for group g's programs).
GROUP = tl.constexpr(16)
COUNTERS = tl.constexpr(128)
MAX_PROGRAMS = GROUP.value * (COUNTERS.value - 1)


@functools.cache
def griddep(device_index: int) -> bool:
    """Whether kernels on this GPU can signal their dependents early and wait for their predecessor
    (griddepcontrol: sm_90+)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _pdl_on(device_index: int) -> bool:
    return os.environ.get("KILN_PDL", "1") != "0" and griddep(device_index)


def pdl(t: torch.Tensor) -> bool:
    """Whether a kernel launched on t's device uses programmatic dependent launch (Hopper's griddepcontrol):
    the kernel may be scheduled while its predecessor in the stream still runs, and waits for it
    (`pdl_prologue`) before reading anything. In a decode step of ~13 small kernels per layer this hides
    each launch behind the previous kernel. sm_90+ only, never in the interpreter; KILN_PDL=0 turns it off
    (read once per device, for A/B timing)."""
    return t.is_cuda and not interpreting() and _pdl_on(t.device.index or 0)


def env_form(var: str, forms: tuple[str, ...], default: str | None = None) -> str:
    """A kernel switch from the environment (for A/B timing without a code change): `default` (forms[0] if
    None) when `var` is unset or empty, else one of `forms` (ValueError naming them otherwise). Callers
    cache the answer."""
    form = os.environ.get(var, "") or default or forms[0]
    if form not in forms:
        raise ValueError(f"{var} must be one of {', '.join(map(repr, forms))}, got {form!r}")
    return form


@functools.cache
def early_loads() -> bool:
    """Whether decode kernels read what their predecessor in the stream does not write before their
    programmatic-launch wait (decode attention's first tile of keys, RoPE's cos/sin rows), so those loads
    overlap it: on, unless KILN_DECODE_EARLY=off in the environment (read once, for A/B timing of whole
    decode steps). Each kernel's module doc says what it reads early and why that is safe."""
    return env_form("KILN_DECODE_EARLY", ("on", "off")) == "on"


def tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's allocator for kernels that build tensor descriptors on the device (TMA): 128 bytes of
    global scratch per descriptor per program, allocated at each launch (under a CUDA-graph capture, from
    the graph's pool). Set with `triton.set_allocator(tma_scratch)` before such a launch (a context
    variable, per thread)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


# The small decode kernels that may let the next kernel be scheduled before they wait themselves
# (`pdl_first`): the add + RMSNorm, RoPE + K/V write, decode attention's split and reduce kernels, and the
# one-token q/k/v projection with RoPE and the K/V write in its epilogue ("qkv", kernels/rope.py). By
# default the norm and the reduction, and those only where their caller says that the next kernel loads its
# weight before its wait (`signal_first`: the bf16 one-row q/k/v and o projections, Linear.reads_early;
# the quantized q/k/v and o, which load their first K step early, QuantLinear.reads_early), and the fused
# q/k/v kernel, whose successor (decode attention's split kernel) reads its first tile early.
# Whole decode steps on the H200 (docs/perf/inference.md, "Signalling before the wait"): 1.035x at batch 1
# with those two, a tie at 16 and 64; with all four, 1.041x at 1 but 0.978x at 16; ahead of the int8 and
# int4 projections, which load nothing early, 0.94x (hence the caller's say). The SwiGLU kernel
# signalling first too measured 0.990x at batch 1, and with gate_up and down's first 512 columns preloaded
# 0.990x (removed). The fused q/k/v kernel signalling first: 1.012x at batch 1 (c50f9bd, 7 rounds within
# 0.2%), the only batch it runs at.
PDL_FIRST_KERNELS = ("norm", "rope", "split", "reduce", "qkv")
PDL_FIRST_DEFAULT = ("norm", "reduce", "qkv")


@functools.cache
def _pdl_first_set() -> frozenset[str]:
    raw = os.environ.get("KILN_PDL_FIRST", "")
    names = frozenset(n for n in raw.replace(":", ",").split(",") if n)
    if not names:
        return frozenset(PDL_FIRST_DEFAULT)
    if names in ({"all"}, {"none"}):
        return frozenset(PDL_FIRST_KERNELS if "all" in names else ())
    bad = sorted(names - set(PDL_FIRST_KERNELS))
    if bad:
        raise ValueError(
            f"KILN_PDL_FIRST: unknown kernel(s) {bad}; use 'all', 'none' or some of {PDL_FIRST_KERNELS}"
        )
    return names


def pdl_first(kernel: str) -> bool:
    """Whether `kernel` (one of PDL_FIRST_KERNELS) may signal its dependents before its own programmatic-
    launch wait (`pdl_prologue(PDL, FIRST=True)`; the norm and the reduction where their caller asks), so
    that the kernel after it is scheduled while the one before it still runs: the q/k/v projection loads
    its weights during the down projection before the norm, the o projection during decode attention's
    split kernel, not only during the norm or the reduction.
    KILN_PDL_FIRST (read once, for A/B timing of whole decode steps): unset for PDL_FIRST_DEFAULT, "none",
    "all", or kernel names separated by "," or ":"."""
    return kernel in _pdl_first_set()


@triton.jit
def pdl_prologue(PDL: tl.constexpr, FIRST: tl.constexpr = False):
    """First statement of a kernel launched with launch_pdl=PDL, in every program before any load or early
    return: wait until the previous kernel in the stream has finished and its writes are visible (so a
    kernel that reads its inputs two launches back is safe too: its predecessor waited the same way), then
    let the next kernel be scheduled (it will wait for this one in its own prologue).

    FIRST lets the next kernel be scheduled before this one waits: it then runs alongside this kernel's
    predecessor too (still waiting for this kernel's completion before its own first dependent read). Safe
    where what the next kernel reads before its wait was written before this kernel's predecessor began:
    true of every kiln kernel that reads early (weights, block tables, older cache rows, RoPE tables, all
    written before the decode step). A grid is scheduled only once every program of the one before it has
    signalled, so a chain of FIRST kernels cannot fill the GPU with programs that wait for one that is not
    resident."""
    if PDL:
        if FIRST:
            gdc_launch_dependents()
            gdc_wait()
        else:
            gdc_wait()
            gdc_launch_dependents()


@triton.jit
def grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row, column) offsets of output tile `tile` of an (M, N) matmul in grouped order: GROUP_M tile-rows
    walked down a column of tiles before moving right, so programs running together share A's row panels
    and B's column panels in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    off_m = (first_m + (tile % per_group) % group_rows) * BLOCK_M
    off_n = ((tile % per_group) // group_rows) * BLOCK_N
    return off_m, off_n


@triton.jit
def zero_counters(at):
    """Program 0 zeroes the COUNTERS int32 counters at `at` (a float32 pointer into a norm's saved
    statistics). A masked store rather than a branch: the branch cost the LayerNorm forward 10 registers
    (64 -> 74 per thread at 8 warps, 4 -> 3 programs per SM; 0.1405 against 0.1334 ms on the H200)."""
    c = tl.arange(0, COUNTERS)
    tl.store(
        at.to(tl.pointer_type(tl.int32)) + c,
        tl.zeros((COUNTERS,), tl.int32),
        mask=(c < COUNTERS) & (tl.program_id(0) == 0),
    )


@triton.jit
def sum_partial_rows(
    P_ptr,  # (n_programs, D) float32 partial rows, one per program of this launch (row pid: this one's)
    Q_ptr,  # a second set (LayerNorm's db), summed alongside when HAS_Q
    OUT_P,  # (D,) out: the column sums of P, in OUT_P's dtype
    OUT_Q,
    CNT_ptr,  # float32 pointer to COUNTERS int32 counters, zero on entry and left zero
    n_cols,
    HAS_Q: tl.constexpr,
    SUM_ROWS: tl.constexpr,  # partial rows loaded per step (a (SUM_ROWS, BLOCK) tile)
    BLOCK: tl.constexpr,
):
    """Called by every program of a backward once its partial rows are stored: the last program of each
    GROUP to get here sums the group's rows (in program order) into the group's first row; the last
    group to finish sums those rows (in order) into OUT. Counter 0 counts finished groups, counter
    1 + g the finished programs of group g; each is reset by the program that saw it complete."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cnt = CNT_ptr.to(tl.pointer_type(tl.int32))
    group = pid // GROUP
    first = group * GROUP
    size = tl.minimum(n_prog - first, GROUP)
    tl.debug_barrier()  # every thread's partial stores happen before this program's release below
    if tl.atomic_add(cnt + 1 + group, 1, sem="acq_rel") == size - 1:
        tl.store(cnt + 1 + group, 0)  # all of the group has counted: reset for the next backward
        sum_rows(P_ptr, Q_ptr, P_ptr + first * n_cols, Q_ptr + first * n_cols, first, size, 1, n_cols,
                  HAS_Q, SUM_ROWS, BLOCK)  # fmt: skip
        n_groups = tl.cdiv(n_prog, GROUP)
        tl.debug_barrier()
        if tl.atomic_add(cnt, 1, sem="acq_rel") == n_groups - 1:
            tl.store(cnt, 0)
            sum_rows(P_ptr, Q_ptr, OUT_P, OUT_Q, 0, n_groups, GROUP, n_cols, HAS_Q, SUM_ROWS, BLOCK)


@triton.jit
def sum_rows(P_ptr, Q_ptr, OUT_P, OUT_Q, start, count, step, n_cols, HAS_Q: tl.constexpr,
              SUM_ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """OUT = sum of rows start, start + step, ... (count of them) of P (and Q), in that order."""
    cols = tl.arange(0, BLOCK)[None, :]
    acc_p = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_q = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, count, SUM_ROWS):
        k = i + tl.arange(0, SUM_ROWS)[:, None]
        offs = (start + k * step).to(tl.int64) * n_cols + cols
        ok = (k < count) & (cols < n_cols)
        # .cg: from L2, where the other programs' rows are (this SM's L1 is not coherent with theirs)
        acc_p += tl.sum(tl.load(P_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        if HAS_Q:
            acc_q += tl.sum(tl.load(Q_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    c = tl.arange(0, BLOCK)
    tl.store(OUT_P + c, acc_p.to(OUT_P.dtype.element_ty), mask=c < n_cols)
    if HAS_Q:
        tl.store(OUT_Q + c, acc_q.to(OUT_Q.dtype.element_ty), mask=c < n_cols)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "silu":
        x = x / (1.0 + tl.exp(-x))
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) * (x + 0.044715 x^3)
        x = x / (1.0 + tl.exp(-2.0 * u))  # 0.5 x (1 + tanh u) = x * sigmoid(2u)
    return x


# Per-row FP8 (e4m3) quantization, shared by kiln.kernels.fp8_matmul's quantize kernel and the producers
# that quantize their own output rows (the RMSNorm and SwiGLU kernels' FP8 forms): one arithmetic, so a
# fused producer gives the bits of the producer followed by quantize_fp8.
@triton.jit
def fp8_row_scale(amax):
    """(scale, 1 / scale) for a row whose largest magnitude is amax (float32): scale = amax / 448 (e4m3's
    largest finite value), at least 1e-12 so that an all-zero row divides by no zero."""
    scale = tl.maximum(amax / 448.0, 1e-12)
    return scale, 1.0 / scale


@triton.jit
def fp8_quantize(x, inv):
    """float32 x times 1 / scale, saturated to +-448, as float8e4nv."""
    return tl.minimum(tl.maximum(x * inv, -448.0), 448.0).to(tl.float8e4nv)


# The backward's row loop: on the H200 (32768 x 4096 bf16, 2026-11-29) three pipeline stages with two
# programs per SM measured best for both norms (RMSNorm 0.222 ms, LayerNorm 0.233 ms; one stage: 0.250
# and 0.277; one program per SM: 0.35 and 0.40, Liger's choice). 8 and 16 warps tied. Fixed rather than
# autotuned: the autotuner's per-call host cost showed up in the forward+backward timings.
ROW_LOOP_STAGES = 3
PROGRAMS_PER_SM = 2
# The forward's tile: rows of at least this many elements get a program each, shorter ones share one
# (and its weight load), with the warps of one row. H200, 32768 rows bf16 (bench/sweep_memory_bound.py,
# interleaved with Liger): D = 4096, one row in 8 warps 133.7 us (2 or 4 rows 134.6-135.6, Liger 132.5-
# 135.5 across runs); D = 1536, two rows in 4 warps 51.8 us (one row 52.7, Liger 62.4).
FWD_ROW_ELEMS = 4096


def fwd_rows(block: int, tile: int = FWD_ROW_ELEMS) -> int:
    """Rows per program of a norm's forward: as many rows of `block` as fill `tile` elements, at least 1."""
    return max(1, tile // block)


def row_warps(block: int) -> int:
    """num_warps for a kernel holding one row of `block` elements: about 16 elements per thread."""
    return max(1, min(32, block // 512))


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`t` as a (rows, n_cols) view with a contiguous last dim, copying only when it has to."""
    if t.dim() == 2 and t.stride(1) == 1:  # rows already: no new view (each is host time on the hot path)
        return t
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`t` (contiguous rows) viewed as `shape`: itself when it has that shape already."""
    return t if t.shape == shape else t.view(shape)


def backward_programs(n_rows: int, device: torch.device, per_sm: int) -> int:
    """How many persistent programs a backward launches: `per_sm` per SM on CUDA (4 * per_sm on the
    interpreter, as if it had 4 SMs), at most one per row and at most what the counters cover."""
    per_device = (sm_count(device) if device.type == "cuda" else 4) * per_sm
    return max(1, min(n_rows, per_device, MAX_PROGRAMS))


def sum_rows_step(block: int, sums: int = 1) -> int:
    """Partial rows per step of the backward's final sums of `sums` arrays: (rows, block) float32 tiles
    of at most 16384 values in all, 64 per thread at a row's warps (`row_warps`). Compiled for sm_90 at
    D = 4096, 8 warps: RMSNorm's backward at 4 rows takes 106 registers, LayerNorm's (dw and db) 118 at
    2 rows and 140 at 4, past the 128 that two programs per SM allow (its backward then ran at 0.277 ms
    against 0.232 on the H200)."""
    return max(1, min(4, 16384 // (block * sums)))


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on `tensors` (else the launcher is called without a Function)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_rows(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}; the kernel takes float32, float16 or bfloat16")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(
            f"{name}: rows of {x.shape[-1]} elements exceed the kernel's {MAX_ROW} (one row per program)"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{name}: residual must match x in shape and dtype, got {tuple(residual.shape)} {residual.dtype} "
            f"vs {tuple(x.shape)} {x.dtype}"
        )
    for t in (weight, residual):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: all tensors must be on one device, got {x.device} and {t.device}")


# ---------------------------------------------------------------- RoPE pairs in a projection's epilogue
# fmt: off
@triton.jit
def rope_pair_tables(COS, SIN, ROWS, stride_cos, stride_sin, SLOTS, jp):
    """The token's cos and sin at pair indices jp (PAIRS,) float32, and its cache slot: loads that depend on
    no result of the projection, so a kernel issues them before its K loop."""
    row = tl.load(ROWS).to(tl.int64)
    c = tl.load(COS + row * stride_cos + jp).to(tl.float32)
    s = tl.load(SIN + row * stride_sin + jp).to(tl.float32)
    return c, s, tl.load(SLOTS).to(tl.int64)


@triton.jit
def rope_pairs_store(y, h, col_a, col_b, Hq, Hk, Q_HEAD, c, s, slot, K_CACHE, V_CACHE,
                      stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
                      PAGE_SIZE: tl.constexpr, PAIRS: tl.constexpr):
    """The projection's epilogue for PAIRS rotation pairs of head h (q heads, then k, then v): y (2 PAIRS,)
    float32 sums (+ bias) in (pair, member) order, members at columns col_a and col_b of the head; c, s, slot
    from rope_pair_tables. Rounded to the output dtype (the projection's stored value), rotated in float32
    for q and k heads (rope_kv_write's math), rounded, stored into Q_HEAD (head h of q) or into the k / v
    cache at the token's slot (< 0: a padding row, nothing written); v heads are stored unrotated."""
    # the projection's output, as the unfused path stores it
    y = y.to(K_CACHE.dtype.element_ty).to(tl.float32)
    a, b = tl.split(tl.reshape(y, (PAIRS, 2)))  # (PAIRS,) each: the pairs' first and second members
    rotate = h < Hq + Hk  # v heads are stored unrotated
    first = tl.where(rotate, a * c - b * s, a)
    second = tl.where(rotate, a * s + b * c, b)
    if h < Hq:
        tl.store(Q_HEAD + col_a, first.to(Q_HEAD.dtype.element_ty))
        tl.store(Q_HEAD + col_b, second.to(Q_HEAD.dtype.element_ty))
    else:
        if slot >= 0:  # a padding row writes nothing
            page = slot // PAGE_SIZE
            pos = slot % PAGE_SIZE
            if h < Hq + Hk:
                out = K_CACHE + page * stride_kcp + pos * stride_kct + (h - Hq) * stride_kch
            else:
                out = V_CACHE + page * stride_vcp + pos * stride_vct + (h - Hq - Hk) * stride_vch
            tl.store(out + col_a, first.to(K_CACHE.dtype.element_ty))
            tl.store(out + col_b, second.to(K_CACHE.dtype.element_ty))
# fmt: on
