"""Triton kernels that measure the memory system (kiln.profile.ceilings): streaming reads from DRAM or L2,
shared-memory traffic, and an empty kernel for launch latency. Measurement code, not model kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _read_kernel(
    X,  # float32 input, n = programs * CHUNK elements (no mask: the launcher sizes it)
    Out,  # float32 (programs,): one partial sum per program, so the loads cannot be optimized away
    n,  # elements of X
    CHUNK: tl.constexpr,  # contiguous elements each program reads per pass
    PASSES: tl.constexpr,  # passes over the buffer (1 for DRAM; many for L2, where each pass is cheap)
    BLOCK: tl.constexpr,  # elements per load
    CG: tl.constexpr,  # load with .cg (L2 only, not L1): the L2 probe must not hit L1
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(PASSES):
        # pass p reads the chunk of program (pid + p) mod nprog: every pass moves data between SMs and L2
        base = ((pid + p) % nprog).to(tl.int64) * CHUNK
        for i in range(0, CHUNK, BLOCK):
            offs = base + i + tl.arange(0, BLOCK)
            if CG:
                acc += tl.load(X + offs, cache_modifier=".cg")
            else:
                acc += tl.load(X + offs)
    tl.store(Out + pid, tl.sum(acc, axis=0))


@triton.jit
def _smem_kernel(
    Out,  # float32 (programs, N, N): each program's final tile (keeps the loop live)
    ITERS: tl.constexpr,  # transposes per program
    N: tl.constexpr,  # tile side; the tile is N * N float32 held in registers across the warps
):
    # x is carried through the loop in one register layout; tl.trans(x) has the transposed layout, so
    # every iteration converts it back, which Triton does through shared memory (a store and a load of
    # the whole tile). ceilings.py checks the compiled PTX for st.shared / ld.shared.
    pid = tl.program_id(0)
    r = tl.arange(0, N)
    x = (r[:, None] * N + r[None, :]).to(tl.float32) + pid
    for _ in range(ITERS):
        x = tl.trans(x) * 0.5 + 1.0
    tl.store(Out + pid.to(tl.int64) * N * N + r[:, None] * N + r[None, :], x)


@triton.jit
def _noop_kernel(X):  # X: one float32; the smallest kernel a launch can carry
    tl.store(X, 1.0)
