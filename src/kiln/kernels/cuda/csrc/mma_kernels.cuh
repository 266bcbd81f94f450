// Tensor-core GEMMs through mma.sync: bf16 (m16n8k16) and FP8 e4m3 (m16n8k32), fp32 accumulation.
//
// One design for both (the Ampere-style kernel of CUTLASS's "multistage" GEMMs, written out by hand), a
// template over its tile sizes (the configurations are KILN_MMA_CONFIGS below; config 0 is the first
// version: 128 x 128, 8 warps of 64 x 32, 3 stages):
//   block tile BM x BN, K tile of 128 bytes per row (64 bf16 or 128 e4m3), WARPS_M x WARPS_N warps,
//   each owning (BM / WARPS_M) x (BN / WARPS_N) of C as 16 x 8 mma tiles (64 x 64: 128 fp32 accumulators
//   per thread, and each ldmatrix'd fragment feeds 8 mma instead of 4: half the shared-memory reads per
//   FLOP of a 64 x 32 warp tile);
//   STAGES K tiles in flight: cp.async copies tile kt + STAGES - 1 while the tensor cores work on kt;
//   shared memory rows of 128 to 512 bytes with their 16-byte chunks XOR-swizzled by (row % 8), so the
//   8 row addresses of every ldmatrix (8 consecutive rows, one chunk column) fall in 8 different
//   4-bank groups: conflict-free reads, where the unswizzled layout puts all 8 in the same banks.
// Blocks are numbered in groups of GROUP_M tile rows walked down M first, so that the blocks resident
// together share rows of A and columns of B in L2 (Triton's grouped order).
// Tiles past the edges of A and B are zero-filled by cp.async (src-size 0) and stores past C's edges are
// skipped, so M is arbitrary; K and N must be multiples of 8 (bf16) or 16 (e4m3), so that every
// 16-byte chunk is either wholly inside or wholly outside the matrix (sgemm.cu has the scalar ladder).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "ptx.cuh"

namespace mma_gemm {

constexpr int TILE_BYTES = 128;  // bytes of K per row of a stage's tiles
constexpr int GROUP_M = 8;       // tile rows per group of the block order

// Columns: config, BM, BN, WARPS_M, WARPS_N, STAGES, in the order of kiln.kernels.cuda.ladder.MMA_CONFIGS
// (a CPU test compares the two). Shared memory: STAGES x (BM + BN) x 128 bytes. The bf16 kernel takes
// every configuration; the FP8 kernel config 0 only: with e4m3 fragments the 64 x 64 warp tiles spill
// registers (ptxas: 255 registers and 36-316 bytes of spills, against none for bf16), and on Hopper the
// FP8 path that pays is wgmma (wgmma_kernels.cuh).
#define KILN_MMA_CONFIGS(X)   \
    X(0, 128, 128, 2, 4, 3)   \
    X(1, 128, 256, 2, 4, 3)   \
    X(2, 128, 256, 2, 4, 4)   \
    X(3, 256, 128, 4, 2, 3)   \
    X(4, 128, 128, 2, 2, 4)

template <int BM, int BN, int STAGES>
constexpr int smem_bytes() {
    return STAGES * (BM + BN) * TILE_BYTES;
}

// Byte offset of the 16-byte chunk `chunk` of row `row` in a tile with `row_bytes` bytes per row.
__device__ __forceinline__ int swz(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

// Copies one K tile into a stage with cp.async. Each tile is ROWS x ROW_BYTES in chunks of 16 bytes, NT
// threads taking every NT-th chunk. `rowmax`/`colmax`: bounds of the global matrix (rows, elements per
// row); ld: its row length in elements; ELEM: bytes per element.
template <int ROWS, int ROW_BYTES, int ELEM, int NT>
__device__ __forceinline__ void load_tile(unsigned char* dst, const unsigned char* src, int r0, int c0,
                                          int rowmax, int colmax, int ld, int tid) {
    constexpr int CHUNKS = ROW_BYTES / 16;
    constexpr int PER_THREAD = ROWS * CHUNKS / NT;
    static_assert(PER_THREAD * NT == ROWS * CHUNKS, "whole tile per pass");
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int idx = tid + i * NT;
        const int r = idx / CHUNKS, ch = idx % CHUNKS;
        const int gr = r0 + r, gc = c0 + ch * (16 / ELEM);  // global row, element column
        const bool ok = gr < rowmax && gc < colmax;
        const unsigned char* g = ok ? src + ((int64_t)gr * ld + gc) * ELEM : src;
        kiln_ptx::cp_async16(dst + swz(r, ch, ROW_BYTES), g, ok);
    }
}

// FP8 = false: C (M, N) bf16 = A (M, K) @ B (K, N), bf16 row-major. A stage: A tile BM x 64 (128-byte
// rows), B tile 64 x BN (BN * 2-byte rows); B's fragments come through ldmatrix.trans (B is N-contiguous,
// mma wants K-pairs per register).
// FP8 = true: C = scale_a * scale_b * A (M, K) @ Bt (N, K)^T, A and Bt e4m3 with K contiguous (the layout
// torch._scaled_mm takes: its second operand column-major). A stage: BM x 128 and BN x 128 bytes. Both
// operands are K-contiguous, so both come through plain ldmatrix (8-bit data has no .trans).
template <bool FP8, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    gemm(int M, int N, int K, const unsigned char* __restrict__ A, const unsigned char* __restrict__ B,
         const float* __restrict__ scale_a, const float* __restrict__ scale_b, __nv_bfloat16* __restrict__ C) {
    constexpr int NT = WARPS_M * WARPS_N * 32;
    constexpr int ELEM = FP8 ? 1 : 2;
    constexpr int BK = TILE_BYTES / ELEM;              // 64 bf16 or 128 e4m3
    constexpr int KSTEP = FP8 ? 32 : 16;               // K of one mma
    constexpr int A_BYTES = BM * TILE_BYTES, B_BYTES = BN * TILE_BYTES;
    constexpr int B_ROW_BYTES = FP8 ? TILE_BYTES : BN * 2;  // Bt rows of 128 bytes / B rows of BN bf16
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;   // the warp's tile of C
    constexpr int MI = WTM / 16, NI = WTN / 8;              // its mma tiles
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "whole 16 x 16 fragment pairs per warp");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* As = smem;                       // STAGES x (BM rows x 128 B)
    unsigned char* Bs = smem + STAGES * A_BYTES;    // STAGES x B tile
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;  // warp tile rows wm*WTM.., columns wn*WTN..

    // grouped block order (see the file comment)
    const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
    const int per_group = GROUP_M * n_tiles, first_m = (int)(blockIdx.x / per_group) * GROUP_M;
    const int group_rows = m_tiles - first_m < GROUP_M ? m_tiles - first_m : GROUP_M;
    const int in_group = (int)(blockIdx.x % per_group);
    const int m0 = (first_m + in_group % group_rows) * BM, n0 = (in_group / group_rows) * BN;

    float acc[MI][NI][4] = {};  // [mi][ni][fragment]
    const int ktiles = (K + BK - 1) / BK;
    auto load_stage = [&](int stage, int kt) {
        load_tile<BM, TILE_BYTES, ELEM, NT>(As + stage * A_BYTES, A, m0, kt * BK, M, K, K, tid);
        if constexpr (FP8)
            load_tile<BN, TILE_BYTES, 1, NT>(Bs + stage * B_BYTES, B, n0, kt * BK, N, K, K, tid);
        else
            load_tile<BK, BN * 2, 2, NT>(Bs + stage * B_BYTES, B, kt * BK, n0, K, N, N, tid);
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) load_stage(s, s);
        kiln_ptx::cp_async_commit();  // an empty group past the end keeps the group count uniform
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        kiln_ptx::cp_async_wait<STAGES - 2>();  // tile kt has landed (for this thread's copies)
        __syncthreads();                        // ... for every thread's; and stage (kt-1) % STAGES is free
        const int nk = kt + STAGES - 1;
        if (nk < ktiles) load_stage(nk % STAGES, nk);
        kiln_ptx::cp_async_commit();
        const unsigned char* as = As + (kt % STAGES) * A_BYTES;
        const unsigned char* bs = Bs + (kt % STAGES) * B_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / KSTEP; ++ks) {
            uint32_t af[MI][4], bfrag[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                // 16-byte chunks: lanes 0-15 rows 0-15 at chunk 2ks, lanes 16-31 the same at chunk 2ks+1
                // (bf16: k + 8; e4m3: k + 16) -> a0 a1 a2 a3
                const int r = wm * WTM + mi * 16 + (lane & 15);
                const int ch = ks * 2 + (lane >> 4);
                kiln_ptx::ldmatrix_x4(af[mi], as + swz(r, ch, TILE_BYTES));
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; ++nj) {
                uint32_t t[4];
                if constexpr (FP8) {
                    // matrices: (n 0-7, k 0-15) (n 0-7, k 16-31) (n 8-15, k 0-15) (n 8-15, k 16-31)
                    const int r = wn * WTN + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                    const int ch = ks * 2 + ((lane >> 3) & 1);
                    kiln_ptx::ldmatrix_x4(t, bs + swz(r, ch, B_ROW_BYTES));
                } else {
                    // lanes 0-15: k rows 0-15 at columns n..n+7, lanes 16-31: the same at n+8..n+15
                    const int r = ks * 16 + (lane & 15);
                    const int ch = (wn * WTN + nj * 16) / 8 + (lane >> 4);
                    kiln_ptx::ldmatrix_x4_trans(t, bs + swz(r, ch, B_ROW_BYTES));
                }
                bfrag[2 * nj][0] = t[0];
                bfrag[2 * nj][1] = t[1];
                bfrag[2 * nj + 1][0] = t[2];
                bfrag[2 * nj + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) {
                    if constexpr (FP8)
                        kiln_ptx::mma_e4m3_16832(acc[mi][ni], af[mi], bfrag[ni]);
                    else
                        kiln_ptx::mma_bf16_16816(acc[mi][ni], af[mi], bfrag[ni]);
                }
        }
    }
    kiln_ptx::cp_async_wait<0>();

    const float scale = FP8 ? scale_a[0] * scale_b[0] : 1.f;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int col = n0 + wn * WTN + ni * 8 + (lane & 3) * 2;  // even; N % 8 == 0 so col + 1 < N too
            const int row = m0 + wm * WTM + mi * 16 + (lane >> 2);
            if (col < N) {
                if (row < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)row * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][0] * scale, acc[mi][ni][1] * scale);
                if (row + 8 < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)(row + 8) * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][2] * scale, acc[mi][ni][3] * scale);
            }
        }
}

}  // namespace mma_gemm
