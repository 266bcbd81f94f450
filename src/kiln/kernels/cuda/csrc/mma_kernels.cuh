// Tensor-core GEMMs through mma.sync: bf16 (m16n8k16) and FP8 e4m3 (m16n8k32), fp32 accumulation.
//
// One design for both (the Ampere-style kernel of CUTLASS's "multistage" GEMMs, written out by hand):
//   block tile 128 x 128, K tile of 128 bytes per row (64 bf16 or 128 e4m3), 8 warps as 2 (M) x 4 (N),
//   each warp owning 64 x 32 of C = 4 x 4 mma tiles of 16 x 8 (64 fp32 accumulators per thread);
//   STAGES K tiles in flight: cp.async copies tile kt + STAGES - 1 while the tensor cores work on kt;
//   shared memory rows of 128 or 256 bytes with their 16-byte chunks XOR-swizzled by (row % 8), so the
//   8 row addresses of every ldmatrix (8 consecutive rows, one chunk column) fall in 8 different
//   4-bank groups: conflict-free reads, where the unswizzled layout puts all 8 in the same banks.
// Tiles past the edges of A and B are zero-filled by cp.async (src-size 0) and stores past C's edges are
// skipped, so M is arbitrary; K and N must be multiples of 8 (bf16) or 16 (e4m3), so that every
// 16-byte chunk is either wholly inside or wholly outside the matrix (sgemm.cu has the scalar ladder).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "ptx.cuh"

namespace mma_gemm {

constexpr int BM = 128, BN = 128, THREADS = 256, STAGES = 3;
constexpr int TILE_BYTES = 128;  // bytes of K per row of a stage's A tile

// Byte offset of the 16-byte chunk `chunk` of row `row` in a tile with `row_bytes` bytes per row.
__device__ __forceinline__ int swz(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

// Copies one K tile into a stage with cp.async. Each tile is rows x row_bytes: 1024 chunks of 16 bytes
// = 4 per thread. `rowmax`/`colmax`: bounds of the global matrix (rows, elements per row); ld: its row
// length in elements; elem: bytes per element.
template <int ROWS, int ROW_BYTES, int ELEM>
__device__ __forceinline__ void load_tile(unsigned char* dst, const unsigned char* src, int r0, int c0,
                                          int rowmax, int colmax, int ld, int tid) {
    constexpr int CHUNKS = ROW_BYTES / 16;
    constexpr int PER_THREAD = ROWS * CHUNKS / THREADS;
    static_assert(PER_THREAD * THREADS == ROWS * CHUNKS, "whole tile per pass");
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const int idx = tid + i * THREADS;
        const int r = idx / CHUNKS, ch = idx % CHUNKS;
        const int gr = r0 + r, gc = c0 + ch * (16 / ELEM);  // global row, element column
        const bool ok = gr < rowmax && gc < colmax;
        const unsigned char* g = ok ? src + ((int64_t)gr * ld + gc) * ELEM : src;
        kiln_ptx::cp_async16(dst + swz(r, ch, ROW_BYTES), g, ok);
    }
}

// C (M, N) bf16 = A (M, K) @ B (K, N), bf16 row-major. A stage: A tile 128 x 64 (128-byte rows), B tile
// 64 x 128 (256-byte rows); B's fragments come through ldmatrix.trans (B is N-contiguous, mma wants
// K-pairs per register).
__global__ void __launch_bounds__(THREADS)
    bf16_gemm(int M, int N, int K, const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B,
              __nv_bfloat16* __restrict__ C) {
    constexpr int BK = TILE_BYTES / 2;                       // 64 bf16
    constexpr int A_BYTES = BM * BK * 2, B_BYTES = BK * BN * 2;  // 16 KiB each
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* As = smem;                       // STAGES x (128 rows x 128 B)
    unsigned char* Bs = smem + STAGES * A_BYTES;    // STAGES x (64 rows x 256 B)
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / 4, wn = warp % 4;  // warp tile rows wm*64.., columns wn*32..
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const unsigned char* a8 = reinterpret_cast<const unsigned char*>(A);
    const unsigned char* b8 = reinterpret_cast<const unsigned char*>(B);
    float acc[4][4][4] = {};  // [mi][ni][fragment]
    const int ktiles = (K + BK - 1) / BK;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            load_tile<BM, BK * 2, 2>(As + s * A_BYTES, a8, m0, s * BK, M, K, K, tid);
            load_tile<BK, BN * 2, 2>(Bs + s * B_BYTES, b8, s * BK, n0, K, N, N, tid);
        }
        kiln_ptx::cp_async_commit();  // an empty group past the end keeps the group count uniform
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        kiln_ptx::cp_async_wait<STAGES - 2>();  // tile kt has landed (for this thread's copies)
        __syncthreads();                        // ... for every thread's; and stage (kt-1) % STAGES is free
        const int nk = kt + STAGES - 1;
        if (nk < ktiles) {
            load_tile<BM, BK * 2, 2>(As + (nk % STAGES) * A_BYTES, a8, m0, nk * BK, M, K, K, tid);
            load_tile<BK, BN * 2, 2>(Bs + (nk % STAGES) * B_BYTES, b8, nk * BK, n0, K, N, N, tid);
        }
        kiln_ptx::cp_async_commit();
        const unsigned char* as = As + (kt % STAGES) * A_BYTES;
        const unsigned char* bs = Bs + (kt % STAGES) * B_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
            uint32_t af[4][4], bfrag[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                // lanes 0-15: rows 0-15 at k, lanes 16-31: rows 0-15 at k + 8 -> a0 a1 a2 a3
                const int r = wm * 64 + mi * 16 + (lane & 15);
                const int ch = ks * 2 + (lane >> 4);
                kiln_ptx::ldmatrix_x4(af[mi], as + swz(r, ch, BK * 2));
            }
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                // lanes 0-15: k rows 0-15 at columns n..n+7, lanes 16-31: the same at n+8..n+15
                uint32_t t[4];
                const int r = ks * 16 + (lane & 15);
                const int ch = (wn * 32 + nj * 16) / 8 + (lane >> 4);
                kiln_ptx::ldmatrix_x4_trans(t, bs + swz(r, ch, BN * 2));
                bfrag[2 * nj][0] = t[0];
                bfrag[2 * nj][1] = t[1];
                bfrag[2 * nj + 1][0] = t[2];
                bfrag[2 * nj + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) kiln_ptx::mma_bf16_16816(acc[mi][ni], af[mi], bfrag[ni]);
        }
    }
    kiln_ptx::cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;  // even; N % 8 == 0 so col + 1 < N too
            const int row = m0 + wm * 64 + mi * 16 + (lane >> 2);
            if (col < N) {
                if (row < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)row * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][0], acc[mi][ni][1]);
                if (row + 8 < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)(row + 8) * N + col) =
                        __floats2bfloat162_rn(acc[mi][ni][2], acc[mi][ni][3]);
            }
        }
}

// C (M, N) bf16 = scale_a * scale_b * A (M, K) @ Bt (N, K)^T, A and Bt e4m3 with K contiguous (the layout
// torch._scaled_mm takes: its second operand column-major). A stage: 128 x 128 bytes of each. Both
// operands are K-contiguous, so both come through plain ldmatrix (8-bit data has no .trans).
__global__ void __launch_bounds__(THREADS)
    fp8_gemm(int M, int N, int K, const unsigned char* __restrict__ A, const unsigned char* __restrict__ Bt,
             const float* __restrict__ scale_a, const float* __restrict__ scale_b, __nv_bfloat16* __restrict__ C) {
    constexpr int BK = TILE_BYTES;                 // 128 e4m3
    constexpr int A_BYTES = BM * BK, B_BYTES = BN * BK;  // 16 KiB each
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* As = smem;
    unsigned char* Bs = smem + STAGES * A_BYTES;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / 4, wn = warp % 4;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[4][4][4] = {};
    const int ktiles = (K + BK - 1) / BK;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            load_tile<BM, BK, 1>(As + s * A_BYTES, A, m0, s * BK, M, K, K, tid);
            load_tile<BN, BK, 1>(Bs + s * B_BYTES, Bt, n0, s * BK, N, K, K, tid);
        }
        kiln_ptx::cp_async_commit();
    }
    for (int kt = 0; kt < ktiles; ++kt) {
        kiln_ptx::cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int nk = kt + STAGES - 1;
        if (nk < ktiles) {
            load_tile<BM, BK, 1>(As + (nk % STAGES) * A_BYTES, A, m0, nk * BK, M, K, K, tid);
            load_tile<BN, BK, 1>(Bs + (nk % STAGES) * B_BYTES, Bt, n0, nk * BK, N, K, K, tid);
        }
        kiln_ptx::cp_async_commit();
        const unsigned char* as = As + (kt % STAGES) * A_BYTES;
        const unsigned char* bs = Bs + (kt % STAGES) * B_BYTES;
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) {
            uint32_t af[4][4], bfrag[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) {
                // 16-byte chunks = 16 k values: lanes 0-15 rows 0-15 at k, lanes 16-31 at k + 16
                const int r = wm * 64 + mi * 16 + (lane & 15);
                const int ch = ks * 2 + (lane >> 4);
                kiln_ptx::ldmatrix_x4(af[mi], as + swz(r, ch, BK));
            }
#pragma unroll
            for (int nj = 0; nj < 2; ++nj) {
                // matrices: (n 0-7, k 0-15) (n 0-7, k 16-31) (n 8-15, k 0-15) (n 8-15, k 16-31)
                uint32_t t[4];
                const int r = wn * 32 + nj * 16 + (lane & 7) + (lane >> 4) * 8;
                const int ch = ks * 2 + ((lane >> 3) & 1);
                kiln_ptx::ldmatrix_x4(t, bs + swz(r, ch, BK));
                bfrag[2 * nj][0] = t[0];
                bfrag[2 * nj][1] = t[1];
                bfrag[2 * nj + 1][0] = t[2];
                bfrag[2 * nj + 1][1] = t[3];
            }
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) kiln_ptx::mma_e4m3_16832(acc[mi][ni], af[mi], bfrag[ni]);
        }
    }
    kiln_ptx::cp_async_wait<0>();

    const float scale = scale_a[0] * scale_b[0];
#pragma unroll
    for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
            const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
            const int row = m0 + wm * 64 + mi * 16 + (lane >> 2);
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
