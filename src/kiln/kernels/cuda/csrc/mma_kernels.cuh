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

#include <cuda.h>  // CUtensorMap (the TMA-fed kernel's parameters)

#include "hopper_ptx.cuh"
#include "ptx.cuh"
#include "tma_ring.cuh"

namespace mma_gemm {

constexpr int TILE_BYTES = 128;  // bytes of K per row of a stage's tiles (KB; 256 at configs 12-14, 16, 17)
constexpr int GROUP_M = 8;       // tile rows per group of the block order

// Columns: config, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST, TMA, in the order of
// kiln.kernels.cuda.ladder.MMA_CONFIGS (a CPU test compares the two). Shared memory: STAGES x (BM + BN) x
// KB bytes (KB: bytes of K per row of a K tile). PIPE = 1: the warp's fragments are double-buffered in
// registers (the ldmatrix of k16 step ks + 1, or of the next K tile's step 0, is issued before the mma of
// step ks; see the main loop). EPI = 1: C is stored through shared memory in 16-byte coalesced chunks (see
// store_c). PERSIST = 1: a persistent grid whose K-tile copies run on across tiles (see the PERSIST path).
// Configs 5-8 (timed at 072ada3; 7 the fastest, 0.542x cuBLAS bf16) add that pipeline to the best
// earlier tiles, and a 128 x 128 tile of 4 warps with 3 stages (96 KiB) so that two blocks share an SM.
// Configs 9-13 (timed at 5f8741c; 12 the fastest, 0.563x) add the shared-memory epilogue: 9-11 to the register-pipelined
// configs 7, 5 and 6; 12 and 13 also take K tiles of 256 bytes (128 bf16: 8 k16 steps per tile, half the
// barriers and cp.async waits per FLOP) with 2 stages at 128 x 256 / 256 x 128 (192 KiB, one block per
// SM). 4 stages at 128 x 128 with two blocks per SM do not fit: 2 x 128 KiB > 228 KiB.
// Configs 14-17: 14, 15 and 16 are 12, 9 and 13 on a persistent grid (one block per tile
// slot, 132 or 264 on an H200, each looping over tiles; the next tile's first K tiles are copied during this
// tile's last K tiles and its epilogue); 17 is 9's tile (4 warps) with 3 stages of 256-byte K tiles at one
// block per SM (192 KiB; 2 stages at two blocks per SM would need 2 x 128 KiB); timed at 2cc8a3e, no gain
// (9 the fastest of all configurations, 0.572x).
// Configs 18-20 (TMA = 1): gemm_tma below, the tiles of 10, 9 and 11 fed by TMA from a producer warpgroup
// through mbarriers, with no block-wide barrier in the main loop; 19 (99 KiB) runs two blocks per SM.
// The bf16 kernel takes every configuration; the FP8 kernel config 0 only: with e4m3 fragments the 64 x 64
// warp tiles spill registers (ptxas: 255 registers and 36-316 bytes of spills, against none for bf16), and
// on Hopper the FP8 path that pays is wgmma (wgmma_kernels.cuh).
#define KILN_MMA_CONFIGS(X)                   \
    X(0, 128, 128, 2, 4, 3, 0, 128, 0, 0, 0)  \
    X(1, 128, 256, 2, 4, 3, 0, 128, 0, 0, 0)  \
    X(2, 128, 256, 2, 4, 4, 0, 128, 0, 0, 0)  \
    X(3, 256, 128, 4, 2, 3, 0, 128, 0, 0, 0)  \
    X(4, 128, 128, 2, 2, 4, 0, 128, 0, 0, 0)  \
    X(5, 128, 256, 2, 4, 4, 1, 128, 0, 0, 0)  \
    X(6, 256, 128, 4, 2, 4, 1, 128, 0, 0, 0)  \
    X(7, 128, 128, 2, 2, 3, 1, 128, 0, 0, 0)  \
    X(8, 128, 128, 2, 2, 3, 0, 128, 0, 0, 0)  \
    X(9, 128, 128, 2, 2, 3, 1, 128, 1, 0, 0)  \
    X(10, 128, 256, 2, 4, 4, 1, 128, 1, 0, 0) \
    X(11, 256, 128, 4, 2, 4, 1, 128, 1, 0, 0) \
    X(12, 128, 256, 2, 4, 2, 1, 256, 1, 0, 0) \
    X(13, 256, 128, 4, 2, 2, 1, 256, 1, 0, 0) \
    X(14, 128, 256, 2, 4, 2, 1, 256, 1, 1, 0) \
    X(15, 128, 128, 2, 2, 3, 1, 128, 1, 1, 0) \
    X(16, 256, 128, 4, 2, 2, 1, 256, 1, 1, 0) \
    X(17, 128, 128, 2, 2, 3, 1, 256, 1, 0, 0) \
    X(18, 128, 256, 2, 4, 4, 1, 128, 1, 0, 1) \
    X(19, 128, 128, 2, 2, 3, 1, 128, 1, 0, 1) \
    X(20, 256, 128, 4, 2, 4, 1, 128, 1, 0, 1)

template <int BM, int BN, int STAGES, int KB = TILE_BYTES>
constexpr int smem_bytes() {
    return STAGES * (BM + BN) * KB;
}

// Byte offset of the 16-byte chunk `chunk` of row `row` in a tile with `row_bytes` bytes per row.
__device__ __forceinline__ int swz(int row, int chunk, int row_bytes) {
    return row * row_bytes + ((chunk ^ (row & 7)) << 4);
}

// The origin in C of tile t of an m_tiles x n_tiles grid of BM x BN tiles, numbered in groups of GROUP_M
// tile rows walked down M first (see the file comment).
struct TileOrigin {
    int m0, n0;
};
// (t is unsigned: unsigned division, the first version's code for blockIdx.x.)
template <int BM, int BN>
__device__ __forceinline__ TileOrigin tile_origin(unsigned t, int m_tiles, int n_tiles) {
    const int per_group = GROUP_M * n_tiles, first_m = (int)(t / per_group) * GROUP_M;
    const int group_rows = m_tiles - first_m < GROUP_M ? m_tiles - first_m : GROUP_M;
    const int in_group = (int)(t % per_group);
    return {(first_m + in_group % group_rows) * BM, (in_group / group_rows) * BN};
}

// Copies one K tile into a stage with cp.async. Each tile is ROWS x ROW_BYTES in chunks of 16 bytes, NT
// threads taking every NT-th chunk. `rowmax`/`colmax`: bounds of the global matrix (rows, elements per
// row); ld: its row length in elements; ELEM: bytes per element.
// NT is a multiple of the chunks per row, so a thread keeps one chunk column and steps RS = NT / CHUNKS
// rows per copy: one global pointer advanced by a fixed stride, one bounds test per row, and (RS % 8 ==
// 0) the same swizzle for every row it copies, so the shared address is a base plus immediate offsets.
// (The first version computed every copy's address from scratch; the same bytes land in the same place.)
template <int ROWS, int ROW_BYTES, int ELEM, int NT>
__device__ __forceinline__ void load_tile(unsigned char* dst, const unsigned char* src, int r0, int c0,
                                          int rowmax, int colmax, int ld, int tid) {
    constexpr int CHUNKS = ROW_BYTES / 16;
    constexpr int PER_THREAD = ROWS * CHUNKS / NT;
    constexpr int RS = NT / CHUNKS;  // rows between one thread's copies
    static_assert(PER_THREAD * NT == ROWS * CHUNKS, "whole tile per pass");
    static_assert(RS * CHUNKS == NT && RS % 8 == 0, "one chunk column per thread, one swizzle per thread");
    const int r = tid / CHUNKS, ch = tid % CHUNKS;
    const int gc = c0 + ch * (16 / ELEM);  // element column
    const bool col_ok = gc < colmax;
    const unsigned char* g = src + ((int64_t)(r0 + r) * ld + gc) * ELEM;
    const int64_t step = (int64_t)RS * ld * ELEM;
    unsigned char* d = dst + swz(r, ch, ROW_BYTES);  // == swz(r + i * RS, ch) - i * RS * ROW_BYTES
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) {
        const bool ok = col_ok && r0 + r + i * RS < rowmax;
        kiln_ptx::cp_async16(d + i * RS * ROW_BYTES, ok ? g + i * step : src, ok);
    }
}

// The warp's fragments of k step ks of the stage at as / bs: MI A tiles (16 x 16, 4 registers) and NI B
// tiles (16 x 8, 2 registers), for a warp in column wn of the block's warps (WTN columns of C each). Every row
// an ldmatrix lane addresses is lane & 7 modulo 8 (the tiles start at multiples of 8 rows), so the swizzle's
// XOR is by lane & 7, and the per-thread offsets below are swz's with the compile-time parts (mi, ks, nj
// rows) left as immediate offsets: a handful of address registers instead of one per (step, tile), which the
// register-double-buffered configs need. a_row / a_x: the thread's A row offset (wm * WTM + (lane & 15)) *
// KB and chunk XOR (lane >> 4) ^ (lane & 7), computed once by the caller.
// B_ROW: bytes per row of the B tile (bf16: BN * 2 in the cp.async layout, 128 in TMA boxes; FP8: Bt rows
// of KB bytes). B_BOX (bf16): bytes from one 64-column group of B (8 chunks) to the next: 128 where a row of
// the tile is one swizzled row (the cp.async layout: chunk ch at (ch ^ (row & 7)), the XOR inside its aligned
// group of 8), a whole box (64 rows x 128 bytes) where TMA wrote the tile as boxes of 64 columns.
template <bool FP8, int MI, int NI, int KB, int WTN, int B_ROW, int B_BOX = 128>
__device__ __forceinline__ void load_frags(uint32_t (&af)[MI][4], uint32_t (&bfrag)[NI][2], const unsigned char* as,
                                           const unsigned char* bs, int ks, int a_row, int a_x, int wn, int lane) {
    const int lo = lane & 7, hi = lane >> 4;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        // 16-byte chunks: lanes 0-15 rows 0-15 at chunk 2ks, lanes 16-31 the same at chunk 2ks+1
        // (bf16: k + 8; e4m3: k + 16) -> a0 a1 a2 a3; == as + swz(r, ch, KB) (the XOR by
        // lo < 8 keeps the chunk in its aligned group of 8, also in KB = 256's 16-chunk rows)
        kiln_ptx::ldmatrix_x4(af[mi], as + a_row + mi * 16 * KB + (((2 * ks) ^ a_x) << 4));
    }
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
        uint32_t t[4];
        if constexpr (FP8) {
            // matrices: (n 0-7, k 0-15) (n 0-7, k 16-31) (n 8-15, k 0-15) (n 8-15, k 16-31); row
            // wn*WTN + nj*16 + lo + hi*8, chunk 2ks + ((lane >> 3) & 1)
            const int r = wn * WTN + lo + hi * 8;
            const int x = ((lane >> 3) & 1) ^ lo;
            kiln_ptx::ldmatrix_x4(t, bs + (r + nj * 16) * B_ROW + (((2 * ks) ^ x) << 4));
        } else {
            // lanes 0-15: k rows 0-15 at columns n..n+7, lanes 16-31: the same at n+8..n+15; row
            // ks*16 + (lane & 15), chunk (wn*WTN + nj*16)/8 + hi
            const int ch = (wn * WTN + nj * 16) / 8 + hi;
            const unsigned char* row = bs + (ks * 16 + (lane & 15)) * B_ROW;
            if constexpr (B_BOX == 128)
                kiln_ptx::ldmatrix_x4_trans(t, row + ((ch ^ lo) << 4));
            else
                kiln_ptx::ldmatrix_x4_trans(t, row + (ch >> 3) * B_BOX + (((ch & 7) ^ lo) << 4));
        }
        bfrag[2 * nj][0] = t[0];
        bfrag[2 * nj][1] = t[1];
        bfrag[2 * nj + 1][0] = t[2];
        bfrag[2 * nj + 1][1] = t[3];
    }
}

// The warp's MI x NI mma of one k step on the fragments af / bfrag.
template <bool FP8, int MI, int NI>
__device__ __forceinline__ void warp_mmas(float (&acc)[MI][NI][4], const uint32_t (&af)[MI][4],
                                          const uint32_t (&bfrag)[NI][2]) {
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

// Stores a block's BM x BN tile of C at (cm0, cn0), times `scale`, from the accumulators of NT threads
// (tid: the thread's index among them; warp (wm, wn) of them owns WTM x WTN). sync() is a barrier over the
// NT threads. EPI: through shared memory at cs (BM * BN * 2 bytes), C stored in 16-byte chunks.
template <int BM, int BN, int WTM, int WTN, int NT, bool EPI, class Sync>
__device__ __forceinline__ void store_c(float (&acc)[WTM / 16][WTN / 8][4], unsigned char* cs,
                                        __nv_bfloat16* __restrict__ C, int M, int N, int cm0, int cn0, int wm,
                                        int wn, int tid, float scale, Sync sync) {
    constexpr int MI = WTM / 16, NI = WTN / 8;
    const int lane = tid % 32;
    if constexpr (EPI) {
        // C through shared memory: the warps write their fragments as bf16 pairs into a BM x BN tile (in
        // the stages' memory, free once every warp is past its last ldmatrix: the barrier), then the
        // threads copy it out in 16-byte chunks, a warp's 32 chunks one or two whole rows of C: 128-byte
        // coalesced stores, where the direct stores below write 4 bytes per lane over 8 rows (8 half-used
        // 32-byte sectors per instruction). The tile's 16-byte chunks are XOR-swizzled by (row % 8) like
        // the stages: a fragment store's 8 rows (lane >> 2) then hit 8 different 4-bank groups, where
        // rows of BN * 2 = 0 (mod 128) bytes would put all 8 on the same 4 banks.
        constexpr int C_ROW = BN * 2;  // bytes per row of the C tile
        constexpr int CPR = BN / 8;    // 16-byte chunks per row
        constexpr int RSTEP = NT / CPR;
        static_assert(CPR >= 8 && RSTEP * CPR == NT && BM % RSTEP == 0, "whole rows per pass");
        sync();  // every warp's last ldmatrix is done: the stages may be overwritten
        const int x = lane >> 2;  // (row % 8) of every row this lane writes: the tiles start at multiples of 8
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int r = wm * WTM + mi * 16 + (lane >> 2), ch = (wn * WTN + ni * 8) / 8;
                unsigned char* p = cs + r * C_ROW + ((ch ^ x) << 4) + (lane & 3) * 4;
                *reinterpret_cast<__nv_bfloat162*>(p) =
                    __floats2bfloat162_rn(acc[mi][ni][0] * scale, acc[mi][ni][1] * scale);
                *reinterpret_cast<__nv_bfloat162*>(p + 8 * C_ROW) =  // row r + 8: the same swizzle
                    __floats2bfloat162_rn(acc[mi][ni][2] * scale, acc[mi][ni][3] * scale);
            }
        sync();
        const int c = tid % CPR, r0 = tid / CPR;
        const int col = cn0 + c * 8;  // N % 8 == 0: a chunk is wholly inside C or wholly outside
        if (col < N) {
#pragma unroll
            for (int i = 0; i < BM / RSTEP; ++i) {
                const int r = r0 + i * RSTEP;
                if (cm0 + r < M)
                    *reinterpret_cast<uint4*>(C + (int64_t)(cm0 + r) * N + col) =
                        *reinterpret_cast<const uint4*>(cs + r * C_ROW + ((c ^ (r & 7)) << 4));
            }
        }
    } else {  // each lane stores its bf16 pairs straight from registers
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni) {
                const int col = cn0 + wn * WTN + ni * 8 + (lane & 3) * 2;  // even; N % 8 == 0 so col + 1 < N too
                const int row = cm0 + wm * WTM + mi * 16 + (lane >> 2);
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
}

// FP8 = false: C (M, N) bf16 = A (M, K) @ B (K, N), bf16 row-major. A stage: A tile BM x 64 (128-byte
// rows), B tile 64 x BN (BN * 2-byte rows); B's fragments come through ldmatrix.trans (B is N-contiguous,
// mma wants K-pairs per register).
// FP8 = true: C = scale_a * scale_b * A (M, K) @ Bt (N, K)^T, A and Bt e4m3 with K contiguous (the layout
// torch._scaled_mm takes: its second operand column-major). A stage: BM x 128 and BN x 128 bytes. Both
// operands are K-contiguous, so both come through plain ldmatrix (8-bit data has no .trans).
template <bool FP8, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool PIPE, int KB = TILE_BYTES,
          bool EPI = false, bool PERSIST = false>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32)
    gemm(int M, int N, int K, const unsigned char* __restrict__ A, const unsigned char* __restrict__ B,
         const float* __restrict__ scale_a, const float* __restrict__ scale_b, __nv_bfloat16* __restrict__ C) {
    constexpr int NT = WARPS_M * WARPS_N * 32;
    constexpr int ELEM = FP8 ? 1 : 2;
    constexpr int BK = KB / ELEM;                      // 64 bf16 or 128 e4m3 (KB = 128); 128 bf16 (KB = 256)
    constexpr int KSTEP = FP8 ? 32 : 16;               // K of one mma
    constexpr int KS = BK / KSTEP;                     // mma k steps per K tile (4; 8 at KB = 256)
    constexpr int A_BYTES = BM * KB, B_BYTES = BN * KB;
    constexpr int B_ROW_BYTES = FP8 ? KB : BN * 2;  // Bt rows of KB bytes / B rows of BN bf16
    static_assert(KB == 128 || KB == 256, "K tiles of 8 or 16 swizzled 16-byte chunks per row");
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N;   // the warp's tile of C
    constexpr int MI = WTM / 16, NI = WTN / 8;              // its mma tiles
    static_assert(WTM % 16 == 0 && WTN % 16 == 0, "whole 16 x 16 fragment pairs per warp");
    static_assert(KS % 2 == 0, "PIPE: the next K tile's step 0 lands in fragment buffer 0");
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* As = smem;                       // STAGES x (BM rows x KB bytes)
    unsigned char* Bs = smem + STAGES * A_BYTES;    // STAGES x B tile
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;  // warp tile rows wm*WTM.., columns wn*WTN..

    // grouped block order (see the file comment)
    const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
    const TileOrigin origin = tile_origin<BM, BN>(blockIdx.x, m_tiles, n_tiles);
    const int m0 = origin.m0, n0 = origin.n0;

    float acc[MI][NI][4] = {};  // [mi][ni][fragment]
    const int ktiles = (K + BK - 1) / BK;
    auto load_stage = [&](int stage, int kt) {
        load_tile<BM, KB, ELEM, NT>(As + stage * A_BYTES, A, m0, kt * BK, M, K, K, tid);
        if constexpr (FP8)
            load_tile<BN, KB, 1, NT>(Bs + stage * B_BYTES, B, n0, kt * BK, N, K, K, tid);
        else
            load_tile<BK, BN * 2, 2, NT>(Bs + stage * B_BYTES, B, kt * BK, n0, K, N, N, tid);
    };
    const int a_row = (wm * WTM + (lane & 15)) * KB, a_x = (lane >> 4) ^ (lane & 7);  // see load_frags
    auto load_frags = [&](uint32_t (&af)[MI][4], uint32_t (&bfrag)[NI][2], const unsigned char* as,
                          const unsigned char* bs, int ks) {
        mma_gemm::load_frags<FP8, MI, NI, KB, WTN, B_ROW_BYTES>(af, bfrag, as, bs, ks, a_row, a_x, wn, lane);
    };
    auto mmas = [&](const uint32_t (&af)[MI][4], const uint32_t (&bfrag)[NI][2]) {
        warp_mmas<FP8, MI, NI>(acc, af, bfrag);
    };
    // Stores the block's C tile at (cm0, cn0); EPI: through shared memory at cs (the stages' memory).
    auto store_c = [&](unsigned char* cs, int cm0, int cn0) {
        static_assert(!EPI || BM * BN * 2 <= smem_bytes<BM, BN, STAGES, KB>(), "the C tile fits in the stages");
        const float scale = FP8 ? scale_a[0] * scale_b[0] : 1.f;
        mma_gemm::store_c<BM, BN, WTM, WTN, NT, EPI>(acc, cs, C, M, N, cm0, cn0, wm, wn, tid, scale,
                                                     [] { __syncthreads(); });
    };

    if constexpr (PERSIST) {
        // Persistent grid (configs 14-16): the launch has at most as many blocks as fit on the GPU at once,
        // and block b computes tiles b, b + gridDim.x, ... in the grouped order above. The cp.async copies run
        // one K-tile stream across tile boundaries: the copies of the next tile's first STAGES - 1 K tiles
        // are issued during this tile's last K tiles, so they land while this tile's epilogue runs, where a
        // fresh block would start them only after the previous block on its SM had stored C (one load
        // latency, ~1-2 us, per tile with one block per SM). A stage is A and B of one K tile, contiguous
        // (STAGE bytes), so the C tile of the epilogue fits in the one stage nothing is in flight to: the
        // last K tile's, whose next copy is the next tile's K tile STAGES - 1, issued after the next tile's
        // first barrier, i.e. after every thread has read C back out of it.
        static_assert(!FP8 && PIPE && EPI, "persistent: the bf16 register-pipelined shared-memory-epilogue kernel");
        constexpr int STAGE = A_BYTES + B_BYTES;
        static_assert(BM * BN * 2 <= STAGE, "the C tile fits in one stage");
        const int tiles = m_tiles * n_tiles;
        // the copier's position: K tile ld_kt of tile ld_tile (origin ld_m0, ld_n0), into stage ld_stage
        int ld_tile = blockIdx.x, ld_kt = 0, ld_stage = 0, ld_m0 = m0, ld_n0 = n0;
        auto load_next = [&]() {
            if (ld_tile < tiles) {
                unsigned char* st = smem + ld_stage * STAGE;
                load_tile<BM, KB, 2, NT>(st, A, ld_m0, ld_kt * BK, M, K, K, tid);
                load_tile<BK, BN * 2, 2, NT>(st + A_BYTES, B, ld_kt * BK, ld_n0, K, N, N, tid);
                ld_stage = ld_stage + 1 == STAGES ? 0 : ld_stage + 1;
                if (++ld_kt == ktiles) {
                    ld_kt = 0;
                    ld_tile += gridDim.x;
                    if (ld_tile < tiles) {
                        const TileOrigin o = tile_origin<BM, BN>((unsigned)ld_tile, m_tiles, n_tiles);
                        ld_m0 = o.m0;
                        ld_n0 = o.n0;
                    }
                }
            }
            kiln_ptx::cp_async_commit();  // one group per K tile consumed, empty past the last tile
        };
        for (int s = 0; s < STAGES - 1; ++s) load_next();
        uint32_t af[2][MI][4], bfrag[2][NI][2];
        int stage = 0;  // the stage of the K tile being read
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const TileOrigin o = tile_origin<BM, BN>((unsigned)tile, m_tiles, n_tiles);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.f;
            // the tile's first K tile has landed (every thread's copies); every thread has read the previous
            // tile's C out of the stage the first copy below overwrites
            kiln_ptx::cp_async_wait<STAGES - 2>();
            __syncthreads();
            load_frags(af[0], bfrag[0], smem + stage * STAGE, smem + stage * STAGE + A_BYTES, 0);
            int last = stage;
            for (int kt = 0; kt < ktiles; ++kt) {  // the register pipeline of the PIPE loop below
                const unsigned char* as = smem + stage * STAGE;
                const unsigned char* bs = as + A_BYTES;
                const int next = stage + 1 == STAGES ? 0 : stage + 1;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    if (ks == 0) load_next();  // into the stage read by the previous K tile
                    if (ks + 1 < KS) {
                        load_frags(af[(ks + 1) % 2], bfrag[(ks + 1) % 2], as, bs, ks + 1);
                    } else if (kt + 1 < ktiles) {
                        kiln_ptx::cp_async_wait<STAGES - 2>();
                        __syncthreads();
                        load_frags(af[0], bfrag[0], smem + next * STAGE, smem + next * STAGE + A_BYTES, 0);
                    }
                    mmas(af[ks % 2], bfrag[ks % 2]);
                }
                last = stage;
                stage = next;
            }
            store_c(smem + last * STAGE, o.m0, o.n0);  // its first barrier: every warp's last ldmatrix is done
        }
        kiln_ptx::cp_async_wait<0>();
    } else {
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < ktiles) load_stage(s, s);
            kiln_ptx::cp_async_commit();  // an empty group past the end keeps the group count uniform
        }
        if constexpr (!PIPE) {
            for (int kt = 0; kt < ktiles; ++kt) {
                kiln_ptx::cp_async_wait<STAGES - 2>();  // tile kt has landed (for this thread's copies)
                __syncthreads();                        // ... for every thread's; and stage (kt-1) % STAGES is free
                const int nk = kt + STAGES - 1;
                if (nk < ktiles) load_stage(nk % STAGES, nk);
                kiln_ptx::cp_async_commit();
                const unsigned char* as = As + (kt % STAGES) * A_BYTES;
                const unsigned char* bs = Bs + (kt % STAGES) * B_BYTES;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    uint32_t af[MI][4], bfrag[NI][2];
                    load_frags(af, bfrag, as, bs, ks);
                    mmas(af, bfrag);
                }
            }
        } else {
            // Fragments double-buffered in registers (CUTLASS's warp-level pipeline): while the tensor cores
            // run the MI x NI mma of step ks from buffer ks % 2, the ldmatrix of step ks + 1 fill the other
            // buffer, so no mma waits on a shared-memory load. ldmatrix and mma are `asm volatile` and stay in
            // program order, which is why the next step's loads are written before this step's mma. At the
            // last step the next K tile is made visible first (cp.async wait + barrier) and its step 0 loaded.
            // The stage the cp.async of step 0 overwrites, (kt - 1) % STAGES, was last read by the ldmatrix of
            // tile kt - 1's last step, issued before the barrier of that tile's last step.
            uint32_t af[2][MI][4], bfrag[2][NI][2];
            kiln_ptx::cp_async_wait<STAGES - 2>();  // tile 0 has landed
            __syncthreads();
            load_frags(af[0], bfrag[0], As, Bs, 0);
            for (int kt = 0; kt < ktiles; ++kt) {
                const unsigned char* as = As + (kt % STAGES) * A_BYTES;
                const unsigned char* bs = Bs + (kt % STAGES) * B_BYTES;
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    if (ks == 0) {
                        const int nk = kt + STAGES - 1;
                        if (nk < ktiles) load_stage(nk % STAGES, nk);
                        kiln_ptx::cp_async_commit();
                    }
                    if (ks + 1 < KS) {
                        load_frags(af[(ks + 1) % 2], bfrag[(ks + 1) % 2], as, bs, ks + 1);
                    } else if (kt + 1 < ktiles) {  // uniform across the block: the barrier is safe
                        kiln_ptx::cp_async_wait<STAGES - 2>();  // tile kt + 1 has landed (this thread's copies)
                        __syncthreads();                        // ... every thread's
                        const int s1 = (kt + 1) % STAGES;
                        load_frags(af[0], bfrag[0], As + s1 * A_BYTES, Bs + s1 * B_BYTES, 0);
                    }
                    mmas(af[ks % 2], bfrag[ks % 2]);
                }
            }
        }
        kiln_ptx::cp_async_wait<0>();

        store_c(smem, m0, n0);
    }
}

// ---- The TMA-fed, warp-specialized kernel (configs with TMA = 1; sm_90a) ----
// The same warp tiles, fragments, register pipeline and shared-memory epilogue as the kernel above, fed
// the way the wgmma kernel (wgmma_kernels.cuh) is, with no block-wide barrier in the main loop:
//   * a producer warpgroup (128 threads, whose thread 0 alone works) walks the K tiles: it waits until
//     stage s = kt % STAGES is released (mbarrier `empty[s]`, one arrival per consumer warp), announces the
//     stage's bytes on `full[s]` and issues the TMA box copies: A, BM rows x 128 bytes (64 bf16 of K); B
//     (K, N row-major), BN / 64 boxes of 64 K rows x 128 bytes (64 columns), one after another. TMA writes
//     each box with the 128-byte swizzle (chunk c of row r at chunk c ^ (r % 8)), which is the layout the
//     ldmatrix addressing of load_frags reads (A: swz(row, chunk, 128); B: B_BOX = one box);
//   * the consumer warps (WARPS_M x WARPS_N, whole warpgroups) each wait on `full[s]` by themselves, run
//     the k16 steps of the tile with the fragments double-buffered in registers (the PIPE loop above), and
//     release the stage once the mma of its last step have read their fragments (lane 0 of each warp).
// What this removes against the cp.async kernel: the __syncthreads of every K tile (a slow warp no
// longer holds the others), the cp.async address arithmetic and issue in the consumer warps' instruction
// stream, and the cp.async wait. setmaxnreg moves registers from the producer (24) to the consumers
// (CONSUMER_REGS: what MINB blocks per SM leave). Edges: TMA zero-fills boxes past M, N and K, and stores
// past C's edges are skipped, so M is arbitrary; K % 8 == 0 and N % 8 == 0 (16-byte rows for TMA).
// Registers a consumer thread may take (setmaxnreg: a multiple of 8, at most 240): the block's share of the
// SM's 65536 (MINB blocks per SM) less the producer warpgroup's 128 x 24 (setmaxnreg's least; its one
// working thread needs no more), over the nt consumer threads: 240 at 8 consumer warps, 232 at 4 and two
// blocks per SM (216 with a 40-register producer, where the 64 x 64 warp tile spilled).
constexpr int consumer_regs(int minb, int nt) {
    const int r = (65536 / minb - 128 * 24) / nt / 8 * 8;
    return r < 240 ? r : 240;
}

// Blocks per SM a TMA configuration runs at: two where two blocks' shared memory (and the 1 KiB the
// hardware reserves for each) fits the SM's 228 KiB.
template <int BM, int BN, int STAGES>
constexpr int tma_blocks_per_sm() {
    return 2 * (kiln_hopper::RingSmem<BM, BN, STAGES>::BYTES + 1024) <= 228 * 1024 ? 2 : 1;
}

template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, int MINB>
__global__ void __launch_bounds__(WARPS_M* WARPS_N * 32 + 128, MINB)
    gemm_tma(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, int M, int N,
             int K, __nv_bfloat16* __restrict__ C) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // TMA, mbarrier waits and setmaxnreg: sm_90a
    using S = kiln_hopper::RingSmem<BM, BN, STAGES>;
    constexpr int NW = WARPS_M * WARPS_N, NT = NW * 32;  // consumer warps and threads
    constexpr int BK = 64, KS = BK / 16;                 // bf16 of K per stage; k16 steps per stage
    constexpr int WTM = BM / WARPS_M, WTN = BN / WARPS_N, MI = WTM / 16, NI = WTN / 8;
    constexpr int CONSUMER_REGS = consumer_regs(MINB, NT);
    static_assert(NW % 4 == 0, "setmaxnreg acts on whole warpgroups: the consumers are whole warpgroups");
    static_assert(WTM % 16 == 0 && WTN % 16 == 0 && BN % 64 == 0, "whole fragments, whole 64-column B boxes");
    static_assert(BM <= 256 && BM * BN * 2 <= S::BAR_OFFSET, "a TMA box has <= 256 rows; C fits in the stages");

    extern __shared__ unsigned char smem_tma[];
    unsigned char* smem = kiln_hopper::ring_smem(smem_tma);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::BAR_OFFSET);  // STAGES: the stage's bytes landed
    uint64_t* empty = full + STAGES;                                      // STAGES: every consumer warp is done
    if (threadIdx.x == 0) kiln_hopper::ring_init<STAGES>(full, empty, NW);  // lane 0 of every consumer warp
    __syncthreads();  // the only block-wide barrier: the mbarriers are initialized

    // The tile's origin and K tiles are computed on each side of the split, not before it: a value live
    // into both would have to fit the producer's 24 registers as well, and ptxas spills it.
    auto tile = [&] { return tile_origin<BM, BN>(blockIdx.x, (M + BM - 1) / BM, (N + BN - 1) / BN); };
    const int ktiles = (K + BK - 1) / BK;

    if (threadIdx.x < 128) {  // ---- producer ----
        kiln_hopper::setmaxnreg_dec<24>();
        const TileOrigin origin = tile();
        const int m0 = origin.m0, n0 = origin.n0;
        if (threadIdx.x == 0) {
            for (int kt = 0; kt < ktiles; ++kt) {
                const int s = kiln_hopper::ring_acquire<STAGES>(full, empty, kt, S::STAGE_BYTES);
                unsigned char* a_tile = smem + s * S::STAGE_BYTES;
                kiln_hopper::tma_load_2d(a_tile, &tm_a, &full[s], kt * BK, m0);
#pragma unroll
                for (int j = 0; j < BN / 64; ++j) {
                    unsigned char* b_box = a_tile + S::A_BYTES + j * 64 * 128;
                    kiln_hopper::tma_load_2d(b_box, &tm_b, &full[s], n0 + 64 * j, kt * BK);
                }
            }
        }
        return;
    }

    // ---- consumers ----
    kiln_hopper::setmaxnreg_inc<CONSUMER_REGS>();
    const TileOrigin origin = tile();
    const int m0 = origin.m0, n0 = origin.n0;
    const int tid = threadIdx.x - 128, lane = tid % 32, warp = tid / 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int a_row = (wm * WTM + (lane & 15)) * 128, a_x = (lane >> 4) ^ (lane & 7);  // see load_frags
    float acc[MI][NI][4] = {};
    uint32_t af[2][MI][4], bfrag[2][NI][2];
    auto frags = [&](int buf, int stage, int ks) {
        const unsigned char* as = smem + stage * S::STAGE_BYTES;
        load_frags<false, MI, NI, 128, WTN, 128, 64 * 128>(af[buf], bfrag[buf], as, as + S::A_BYTES, ks, a_row,
                                                           a_x, wn, lane);
    };
    // The consumers' waits spin on try_wait without mbar_wait's deadlock trap: a trap path inside the main
    // loop makes ptxas spill the accumulators around it (440 bytes at 128 x 256). A stall that holds the
    // producer still traps there (mbar_wait on `empty`); the ring's parities are checked by the host
    // emulation, where a wrong one deadlocks and aborts (tests/kernels/cuda/test_emulated.py).
    auto wait_full = [&](int s, int parity) {
        while (!kiln_hopper::mbar_try_wait(&full[s], parity)) {
        }
    };
    wait_full(0, 0);
    frags(0, 0, 0);
    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt % STAGES;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            if (ks + 1 < KS) {
                frags((ks + 1) % 2, s, ks + 1);
            } else if (kt + 1 < ktiles) {  // the next stage's step 0, once its bytes have landed
                const int s1 = (kt + 1) % STAGES;
                wait_full(s1, ((kt + 1) / STAGES) & 1);
                frags(0, s1, 0);
            }
            warp_mmas<false, MI, NI>(acc, af[ks % 2], bfrag[ks % 2]);
        }
        // the mma above consumed the stage's last fragments, so the warp's ldmatrix reads of it are done
        if (lane == 0) kiln_hopper::mbar_arrive(&empty[s]);
    }
    // every stage's bytes landed (each consumer waited on every full[s]); C goes through the stages'
    // memory, behind a barrier of the consumer warps alone (the producer warpgroup has left)
    store_c<BM, BN, WTM, WTN, NT, true>(acc, smem, C, M, N, m0, n0, wm, wn, tid, 1.f,
                                        [] { kiln_hopper::named_barrier_sync(1, NT); });
#else
    __trap();  // not sm_90a: the launcher refuses before launching, this is the backstop
#endif
}

// The mma.sync instruction's own rate, with no memory traffic: the ceiling of every kernel above on this
// GPU (the benchmark compares it with cuBLAS, whose Hopper kernels use wgmma instead). Each warp issues
// iters x PEAK_CHAINS bf16 m16n8k16 on register operands, PEAK_CHAINS independent accumulators so that
// consecutive mma of a warp do not wait on each other's results. Every operand is bf16 1.0, so each
// accumulator ends at exactly iters * 16 (fp32 holds that exactly up to 2^24): the sums stored per thread
// let a test check that every mma ran. (Constant operands may draw less power than real data; the rate
// is then, if anything, flattered.)
constexpr int PEAK_CHAINS = 8;
constexpr int PEAK_THREADS = 256;

__global__ void __launch_bounds__(PEAK_THREADS) mma_peak(int iters, float* __restrict__ out) {
    const uint32_t one = 0x3f803f80u;  // two bf16 1.0
    const uint32_t a[4] = {one, one, one, one}, b[2] = {one, one};
    float acc[PEAK_CHAINS][4] = {};
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int c = 0; c < PEAK_CHAINS; ++c) kiln_ptx::mma_bf16_16816(acc[c], a, b);
    }
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < PEAK_CHAINS; ++c) sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    out[(int64_t)blockIdx.x * PEAK_THREADS + threadIdx.x] = sum;
}

}  // namespace mma_gemm
