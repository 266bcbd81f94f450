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


# Shared-memory reads, in CUDA C (compiled at run time by NVRTC through torch.cuda._compile_kernel: no
# toolchain, well under a second). Triton has no explicit shared memory, and a Triton probe that forced
# layout conversions through it (a tile transposed in a loop) hung Triton 3.6's compiler for sm_90.
# Each thread reads 16-byte words: consecutive lanes read consecutive words (no bank conflict; a
# quarter-warp's 128 contiguous bytes per shared-memory cycle), 8 independent loads in flight per
# iteration, their sum stored so nothing is optimized away. Bytes counted: 16 per load.
SMEM_READ_SOURCE = r"""
extern "C" __global__ void kiln_smem_read(float* out, int iters) {
    __shared__ float4 buf[2048];  // 32 KiB
    for (int i = threadIdx.x; i < 2048; i += blockDim.x) buf[i] = make_float4(i, i + 1, i + 2, i + 3);
    __syncthreads();
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    int base = threadIdx.x;
    for (int it = 0; it < iters; ++it) {
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
            float4 v = buf[(base + u * 256) & 2047];
            acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
        }
        base = (base + 32) & 2047;
    }
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc.x + acc.y + acc.z + acc.w;
}
"""
SMEM_READ_THREADS = 256
SMEM_READS_PER_ITER = 8


@triton.jit
def _noop_kernel(X):  # X: one float32; the smallest kernel a launch can carry
    tl.store(X, 1.0)
