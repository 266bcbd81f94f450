// Hopper GEMMs on warpgroup MMA (wgmma) fed by TMA: C (M, N) bf16 = A (M, K) @ Bt (N, K)^T, bf16 or
// e4m3 operands (e4m3: times scale_a * scale_b), fp32 accumulation. Both operands are K-major (rows of
// K contiguous): the layout of an nn.Linear weight and of torch._scaled_mm's second operand, and the
// only layout wgmma takes for 8-bit types.
//
// The block is 1 producer warpgroup + NC consumer warpgroups (128 threads each):
//   * the producer's thread 0 walks the K tiles: for stage s = kt % STAGES it waits until the consumers
//     have released the stage (mbarrier `empty[s]`), announces the stage's bytes on `full[s]`
//     (arrive.expect_tx) and issues two TMA box copies (A: BM rows x 128 bytes of K, B: BN rows x 128
//     bytes), which complete on `full[s]` by byte count. The copy engine writes the tiles with the
//     128-byte swizzle: the 16-byte chunk c of row r lands at chunk c ^ (r % 8), so the 8 rows of an
//     8 x 16-byte core matrix sit in 8 different bank groups when the tensor cores read them.
//   * consumer warpgroup c owns rows c * BM/NC .. of the tile (BM/NC/64 slices of 64 rows, one wgmma
//     m64nBNk16 (bf16) or m64nBNk32 (e4m3) each per 32 bytes of K): it waits on `full[s]`, issues the
//     4 K-steps x slices of wgmma on shared-memory descriptors (no registers hold A or B), commits them
//     as one group, then waits until at most this group is in flight (wait_group 1) and releases the
//     stage of the *previous* K tile: the tensor cores always have the next group queued.
//   * setmaxnreg (NC = 2): the producer needs few registers and gives them back (40), the consumers
//     take them (232): 128 threads x 40 + 256 x 232 <= 64K registers of the SM.
// Block order: blocks are numbered along M within groups of GROUP_M tile rows, so the blocks in flight
// share A's rows and B's columns in L2 (the grouped order of Triton's matmul tutorial).
// Edges: TMA fills the parts of a box outside the tensor with zeros (rows past M or N, K past K), so
// any M and N work; stores past C's edges are skipped. K needs 16-byte rows for TMA (K % 8 bf16,
// K % 16 e4m3) and N % 8 == 0 keeps the bf16x2 stores aligned; the launchers check both.
#pragma once
#include <cuda.h>  // CUtensorMap (a type only: the encode function is reached through the runtime)
#include <cuda_bf16.h>
#include <stdint.h>

#include "hopper_ptx.cuh"
#include "tma_ring.cuh"

namespace wgmma_gemm {

constexpr int ROW_BYTES = 128;  // bytes of K per tile row per stage: one 128-byte swizzle span
constexpr int GROUP_M = 8;      // tile rows per group of the block order

// Columns: config, BM, BN, NC (consumer warpgroups), STAGES. The order of
// kiln.kernels.cuda.ladder.WGMMA_CONFIGS (a CPU test compares the two).
#define KILN_WGMMA_CONFIGS(X) \
    X(0, 128, 128, 1, 4)      \
    X(1, 128, 256, 2, 4)      \
    X(2, 128, 256, 2, 3)      \
    X(3, 256, 128, 2, 4)      \
    X(4, 128, 128, 2, 5)

template <bool FP8, int N>
__device__ __forceinline__ void mma_step(float (&d)[N / 2], uint64_t da, uint64_t db) {
    if constexpr (FP8)
        kiln_hopper::wgmma_e4m3<N>(d, da, db, 1);
    else
        kiln_hopper::wgmma_bf16<N>(d, da, db, 1);
}

template <bool FP8, int BM, int BN, int NC, int STAGES>
__global__ void __launch_bounds__((NC + 1) * 128, 1)
    gemm(const __grid_constant__ CUtensorMap tm_a, const __grid_constant__ CUtensorMap tm_b, int M, int N, int K,
         __nv_bfloat16* __restrict__ C, const float* __restrict__ scale_a, const float* __restrict__ scale_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma, TMA and setmaxnreg exist on sm_90a only
    using S = kiln_hopper::RingSmem<BM, BN, STAGES>;
    constexpr int BK = FP8 ? 128 : 64;  // K elements per stage (128 bytes)
    constexpr int WG_ROWS = BM / NC;    // rows of C per consumer warpgroup
    constexpr int SLICES = WG_ROWS / 64;
    static_assert(WG_ROWS % 64 == 0 && SLICES >= 1, "each consumer owns whole 64-row slices");
    static_assert(BN == 128 || BN == 256, "wgmma N of 128 or 256");
    static_assert(SLICES * BN / 2 <= 128, "at most 128 fp32 accumulators per thread");

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = kiln_hopper::ring_smem(smem_raw);
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + S::BAR_OFFSET);  // STAGES: tile landed
    uint64_t* empty = full + STAGES;                                      // STAGES: stage released
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    if (threadIdx.x == 0) kiln_hopper::ring_init<STAGES>(full, empty, NC * 4);  // lane 0 of every consumer warp
    __syncthreads();

    // grouped block order: GROUP_M tile rows, walked down M first, then along N
    const int m_tiles = (M + BM - 1) / BM, n_tiles = (N + BN - 1) / BN;
    const int per_group = GROUP_M * n_tiles;
    const int group = blockIdx.x / per_group, first_m = group * GROUP_M;
    const int group_rows = min(m_tiles - first_m, GROUP_M);
    const int in_group = blockIdx.x % per_group;
    const int m0 = (first_m + in_group % group_rows) * BM, n0 = (in_group / group_rows) * BN;
    const int ktiles = (K + BK - 1) / BK;

    if (wg == 0) {  // ---- producer ----
        if constexpr (NC > 1) kiln_hopper::setmaxnreg_dec<40>();
        if (tid == 0) {
            for (int kt = 0; kt < ktiles; ++kt) {
                const int s = kiln_hopper::ring_acquire<STAGES>(full, empty, kt, S::STAGE_BYTES);
                unsigned char* a_tile = smem + s * S::STAGE_BYTES;
                kiln_hopper::tma_load_2d(a_tile, &tm_a, &full[s], kt * BK, m0);
                kiln_hopper::tma_load_2d(a_tile + S::A_BYTES, &tm_b, &full[s], kt * BK, n0);
            }
        }
        return;
    }

    // ---- consumers ----
    if constexpr (NC > 1) kiln_hopper::setmaxnreg_inc<232>();
    const int c = wg - 1, warp = tid / 32, lane = tid % 32;
    float d[SLICES][BN / 2];
#pragma unroll
    for (int ms = 0; ms < SLICES; ++ms)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) d[ms][i] = 0.f;

    for (int kt = 0; kt < ktiles; ++kt) {
        const int s = kt % STAGES;
        kiln_hopper::mbar_wait(&full[s], (kt / STAGES) & 1);
        const unsigned char* a_tile = smem + s * S::STAGE_BYTES + c * WG_ROWS * ROW_BYTES;
        const unsigned char* b_tile = smem + s * S::STAGE_BYTES + S::A_BYTES;
#pragma unroll
        for (int ms = 0; ms < SLICES; ++ms) kiln_hopper::fence_regs(d[ms]);
        kiln_hopper::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)  // 32 bytes of K per instruction: 16 bf16 or 32 e4m3
#pragma unroll
            for (int ms = 0; ms < SLICES; ++ms)
                mma_step<FP8, BN>(d[ms], kiln_hopper::sw128_desc(a_tile + ms * 64 * ROW_BYTES + ks * 32),
                                  kiln_hopper::sw128_desc(b_tile + ks * 32));
        kiln_hopper::wgmma_commit();
#pragma unroll
        for (int ms = 0; ms < SLICES; ++ms) kiln_hopper::fence_regs(d[ms]);
        kiln_hopper::wgmma_wait<1>();  // K tile kt - 1's group is done: its stage can be refilled
        if (kt > 0 && lane == 0) kiln_hopper::mbar_arrive(&empty[(kt - 1) % STAGES]);
    }
    kiln_hopper::wgmma_wait<0>();
#pragma unroll
    for (int ms = 0; ms < SLICES; ++ms) kiln_hopper::fence_regs(d[ms]);

    // epilogue: the accumulator fragment (hopper_ptx.cuh) straight to C as bf16 pairs
    const float scale = FP8 ? scale_a[0] * scale_b[0] : 1.f;
#pragma unroll
    for (int ms = 0; ms < SLICES; ++ms) {
        const int row = m0 + c * WG_ROWS + ms * 64 + warp * 16 + lane / 4;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const int col = n0 + j * 8 + (lane % 4) * 2;  // even; N % 8 == 0 so col + 1 < N too
            if (col < N) {
                if (row < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)row * N + col) =
                        __floats2bfloat162_rn(d[ms][4 * j] * scale, d[ms][4 * j + 1] * scale);
                if (row + 8 < M)
                    *reinterpret_cast<__nv_bfloat162*>(C + (int64_t)(row + 8) * N + col) =
                        __floats2bfloat162_rn(d[ms][4 * j + 2] * scale, d[ms][4 * j + 3] * scale);
            }
        }
    }
#else
    __trap();  // not sm_90a: the launchers refuse before launching, this is the backstop
#endif
}

}  // namespace wgmma_gemm
