"""L2 prefetch: start bringing a weight's bytes from HBM into L2 before the kernel that reads it runs.

Why: a batch-1 decode step streams every weight once (3.09 GB at the Qwen2.5-1.5B shape), but between the
weight-streaming matmuls run kernels that read almost nothing (the add + RMSNorm, RoPE + K/V write, decode
attention over a few hundred keys, SwiGLU: ~13 us a layer on the H200, against ~22 us of weight bytes at
the copy rate), and during them HBM sits idle. A prefetch issued before them keeps HBM busy: the matmul
after them finds the first bytes of its weight in L2 (50 MB on the H200) instead of waiting on HBM.

Shapes: `l2_prefetch(regions)`, regions = [(tensor, nbytes), ...]: the first nbytes of each contiguous
tensor's storage (rounded down to 16 bytes). Nothing is computed or written: the reference is to do
nothing, and a prefetch changes no result, only when bytes arrive.

The kernel: Hopper's `cp.async.bulk.prefetch.L2.global [addr], size` (sm_90+, the TMA unit's bulk
prefetch: one instruction per CHUNK bytes, no registers or shared memory held, nothing to wait for). Each
program covers BLOCK chunks (one per thread); the grid covers every region. Launched as a programmatic
dependent launch where kiln's kernels are (kiln.kernels._common.pdl): it issues its prefetches as soon as
it is scheduled, beside its predecessor, then waits for that predecessor before it ends, so the kernel
after it still sees everything before it complete (PDL orders a kernel only against the one before it).
Off sm_90+, in the interpreter and on the CPU the launcher does nothing (the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels._common import griddep, pdl
from kiln.kernels.dispatch import interpreting
from kiln.kernels.launch import CachedLaunch, cdiv

CHUNK = 16384  # bytes per bulk prefetch (one per thread)
BLOCK = 32  # chunks per program: one warp, 512 KiB per program
MAX_REGIONS = 3


def l2_prefetch_ref(regions: Sequence[tuple[torch.Tensor, int]]) -> None:
    """A prefetch's effect on values: none."""


@triton.jit
def _prefetch_region(ptr, nbytes, chunk0, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Prefetch chunks chunk0 .. chunk0 + BLOCK - 1 of the nbytes at ptr (a uint8 pointer) into L2."""
    offs = (chunk0 + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)  # 0 past the end: no prefetch
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _l2_prefetch_kernel(
    P0, N0, P1, N1, P2, N2,  # (uint8 pointer, bytes) of up to three regions; unused ones have 0 bytes
    progs0, progs01,  # programs of region 0, of regions 0 and 1
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the predecessor at the end
):  # fmt: skip
    pid = tl.program_id(0)
    if pid < progs0:
        _prefetch_region(P0, N0, pid * BLOCK, CHUNK, BLOCK)
    elif pid < progs01:
        _prefetch_region(P1, N1, (pid - progs0) * BLOCK, CHUNK, BLOCK)
    else:
        _prefetch_region(P2, N2, (pid - progs01) * BLOCK, CHUNK, BLOCK)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # end after the predecessor: the next kernel's wait covers everything before this one


_prefetch_launch = CachedLaunch(_l2_prefetch_kernel)


def can_prefetch(t: torch.Tensor) -> bool:
    """Whether l2_prefetch issues anything for a tensor on t's device (CUDA sm_90+, not interpreted)."""
    return t.is_cuda and not interpreting() and griddep(t.device.index or 0)


def l2_prefetch(regions: Sequence[tuple[torch.Tensor, int]]) -> None:
    """Start the L2 prefetch of the first nbytes of each (tensor, nbytes) in regions (at most three;
    contiguous tensors on one CUDA device). Returns at once; a no-op where `can_prefetch` does not hold
    or nothing is asked for. CUDA-graph capturable (a fixed grid, no host sync)."""
    if len(regions) > MAX_REGIONS:
        raise ValueError(f"l2_prefetch: at most {MAX_REGIONS} regions, got {len(regions)}")
    args, progs = [], []
    for t, nbytes in regions:
        if not t.is_contiguous():
            raise ValueError("l2_prefetch: the tensor must be contiguous (its bytes are one range)")
        n = min(int(nbytes), t.numel() * t.element_size()) // 16 * 16  # the instruction's 16-byte unit
        if n <= 0 or t.data_ptr() % 16:
            continue
        args.append((t.view(-1).view(torch.uint8), n))
        progs.append(cdiv(n, CHUNK * BLOCK))
    if not args or not can_prefetch(args[0][0]):
        return
    while len(args) < MAX_REGIONS:
        args.append((args[0][0], 0))
        progs.append(0)
    use_pdl = pdl(args[0][0])
    _prefetch_launch[(sum(progs),)](
        args[0][0], args[0][1], args[1][0], args[1][1], args[2][0], args[2][1],
        progs[0], progs[0] + progs[1], CHUNK=CHUNK, BLOCK=BLOCK, PDL=use_pdl, num_warps=1,
        launch_pdl=use_pdl,
    )  # fmt: skip
