// The SGEMM ladder's kernels: C (M, N) = A (M, K) @ B (K, N), fp32, row-major, any M, N, K >= 1.
//
// Each step changes one thing about the one before it (the designs of Simon Boehm's "How to Optimize a
// CUDA Matmul Kernel for cuBLAS-like Performance", with bounds checks added so that odd shapes such as
// 1000 x 1027 x 999 work: out-of-range loads read 0, out-of-range stores are skipped). The launch
// configurations are in sgemm.cu; docs/cuda.md says what each step teaches.
#pragma once
#include <stdint.h>

namespace sgemm_ladder {

// 1. naive: thread (x, y) of a 32 x 32 block computes C[row, col] with row from threadIdx.x. The 32
//    threads of a warp have consecutive rows: their A reads are K floats apart and their C writes N
//    floats apart, so every load is a separate memory transaction (uncoalesced).
__global__ void naive(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                      float* __restrict__ C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    const int col = blockIdx.y * blockDim.y + threadIdx.y;
    if (row < M && col < N) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) acc += A[(int64_t)row * K + k] * B[(int64_t)k * N + col];
        C[(int64_t)row * N + col] = acc;
    }
}

// 2. coalesced: the same work, but a warp's 32 threads take 32 consecutive columns of one row: A's
//    element is one broadcast load, B's and C's accesses are 128 contiguous bytes.
template <int BS>
__global__ void coalesced(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                          float* __restrict__ C) {
    const int row = blockIdx.y * BS + threadIdx.x / BS;
    const int col = blockIdx.x * BS + threadIdx.x % BS;
    if (row < M && col < N) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) acc += A[(int64_t)row * K + k] * B[(int64_t)k * N + col];
        C[(int64_t)row * N + col] = acc;
    }
}

// 3. shared-memory tiling: the block stages a BS x BS tile of A and of B in shared memory, then every
//    thread reads BS values of each from there: each global element is loaded once per block instead
//    of once per thread.
template <int BS>
__global__ void smem_tiled(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                           float* __restrict__ C) {
    __shared__ float As[BS * BS];
    __shared__ float Bs[BS * BS];
    const int tr = threadIdx.x / BS, tc = threadIdx.x % BS;
    const int row = blockIdx.y * BS + tr, col = blockIdx.x * BS + tc;
    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += BS) {
        As[tr * BS + tc] = (row < M && k0 + tc < K) ? A[(int64_t)row * K + k0 + tc] : 0.f;
        Bs[tr * BS + tc] = (k0 + tr < K && col < N) ? B[(int64_t)(k0 + tr) * N + col] : 0.f;
        __syncthreads();
        for (int kk = 0; kk < BS; ++kk) acc += As[tr * BS + kk] * Bs[kk * BS + tc];
        __syncthreads();
    }
    if (row < M && col < N) C[(int64_t)row * N + col] = acc;
}

// 4. 1D blocktiling: each thread computes TM results of one column, so one B value read from shared
//    memory serves TM multiply-adds (step 3 did 2 shared loads per FMA). BM * BN / TM threads.
template <int BM, int BN, int BK, int TM>
__global__ void blocktile_1d(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                             float* __restrict__ C) {
    static_assert(BM * BK == BM * BN / TM && BN * BK == BM * BN / TM, "one A and one B element per thread");
    __shared__ float As[BM * BK];  // (BM, BK)
    __shared__ float Bs[BK * BN];  // (BK, BN)
    const int tid = threadIdx.x;
    const int threadCol = tid % BN, threadRow = tid / BN;  // results rows threadRow*TM .. +TM, one column
    const int aRow = tid / BK, aCol = tid % BK;
    const int bRow = tid / BN, bCol = tid % BN;
    const int rowBase = blockIdx.y * BM, colBase = blockIdx.x * BN;
    float acc[TM] = {0.f};
    for (int k0 = 0; k0 < K; k0 += BK) {
        const int ar = rowBase + aRow, ac = k0 + aCol;
        As[aRow * BK + aCol] = (ar < M && ac < K) ? A[(int64_t)ar * K + ac] : 0.f;
        const int br = k0 + bRow, bc = colBase + bCol;
        Bs[bRow * BN + bCol] = (br < K && bc < N) ? B[(int64_t)br * N + bc] : 0.f;
        __syncthreads();
        for (int d = 0; d < BK; ++d) {
            const float b = Bs[d * BN + threadCol];
#pragma unroll
            for (int r = 0; r < TM; ++r) acc[r] += As[(threadRow * TM + r) * BK + d] * b;
        }
        __syncthreads();
    }
    const int col = colBase + threadCol;
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const int row = rowBase + threadRow * TM + r;
        if (row < M && col < N) C[(int64_t)row * N + col] = acc[r];
    }
}

// 5. 2D blocktiling: each thread computes a TM x TN block from TM + TN shared loads per k (an outer
//    product in registers): TM * TN FMAs for TM + TN loads. 256 threads for 128 x 128 x 8.
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM * BN) / (TM * TN))
    blocktile_2d(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                 float* __restrict__ C) {
    constexpr int NT = (BM * BN) / (TM * TN);
    static_assert(NT % BK == 0 && NT % BN == 0, "whole rows of the tiles per loading pass");
    __shared__ float As[BM * BK];  // (BM, BK)
    __shared__ float Bs[BK * BN];  // (BK, BN)
    const int tid = threadIdx.x;
    const int threadCol = tid % (BN / TN), threadRow = tid / (BN / TN);
    const int aRow = tid / BK, aCol = tid % BK;
    constexpr int aStride = NT / BK;  // rows of A's tile loaded per pass
    const int bRow = tid / BN, bCol = tid % BN;
    constexpr int bStride = NT / BN;
    const int rowBase = blockIdx.y * BM, colBase = blockIdx.x * BN;
    float acc[TM * TN] = {0.f};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int off = 0; off < BM; off += aStride) {
            const int r = rowBase + aRow + off, c = k0 + aCol;
            As[(aRow + off) * BK + aCol] = (r < M && c < K) ? A[(int64_t)r * K + c] : 0.f;
        }
        for (int off = 0; off < BK; off += bStride) {
            const int r = k0 + bRow + off, c = colBase + bCol;
            Bs[(bRow + off) * BN + bCol] = (r < K && c < N) ? B[(int64_t)r * N + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int d = 0; d < BK; ++d) {
#pragma unroll
            for (int i = 0; i < TM; ++i) regM[i] = As[(threadRow * TM + i) * BK + d];
#pragma unroll
            for (int j = 0; j < TN; ++j) regN[j] = Bs[d * BN + threadCol * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i * TN + j] += regM[i] * regN[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = rowBase + threadRow * TM + i;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = colBase + threadCol * TN + j;
            if (row < M && col < N) C[(int64_t)row * N + col] = acc[i * TN + j];
        }
    }
}

// Four consecutive floats of a row at column c of a matrix with `cols` columns: one 16-byte load when
// the row allows it (vec: cols % 4 == 0 and a 16-byte aligned base, so row * cols + c is too), else
// four guarded scalar loads; 0 past the end of the row or below the last row.
__device__ __forceinline__ float4 load4(const float* __restrict__ p, int64_t row, int rows, int c, int cols,
                                        bool vec) {
    if (row >= rows) return make_float4(0.f, 0.f, 0.f, 0.f);
    const float* q = p + row * cols + c;
    if (vec && c + 3 < cols) return *reinterpret_cast<const float4*>(q);
    float4 v;
    v.x = c < cols ? q[0] : 0.f;
    v.y = c + 1 < cols ? q[1] : 0.f;
    v.z = c + 2 < cols ? q[2] : 0.f;
    v.w = c + 3 < cols ? q[3] : 0.f;
    return v;
}

// Stores four consecutive floats of C's row at column c, the same way.
__device__ __forceinline__ void store4(float* __restrict__ p, int64_t row, int rows, int c, int cols, bool vec,
                                       float4 v) {
    if (row >= rows) return;
    float* q = p + row * cols + c;
    if (vec && c + 3 < cols) {
        *reinterpret_cast<float4*>(q) = v;
        return;
    }
    if (c < cols) q[0] = v.x;
    if (c + 1 < cols) q[1] = v.y;
    if (c + 2 < cols) q[2] = v.z;
    if (c + 3 < cols) q[3] = v.w;
}

// 6. vectorized: step 5 with 16-byte global loads (LDG.128) and A's tile stored transposed, (BK, BM),
//    so that a thread's TM values of A at one k are contiguous and read as float4 from shared memory
//    too (LDS.128). vecA/vecB/vecC say whether the 16-byte path is legal for each matrix.
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM * BN) / (TM * TN))
    vectorized(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
               float* __restrict__ C, bool vecA, bool vecB, bool vecC) {
    constexpr int NT = (BM * BN) / (TM * TN);
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0 && BN % 4 == 0, "float4 granularity");
    static_assert(NT % (BK / 4) == 0 && NT % (BN / 4) == 0, "whole rows of the tiles per loading pass");
    __shared__ __align__(16) float As[BK * BM];  // transposed: (BK, BM)
    __shared__ __align__(16) float Bs[BK * BN];  // (BK, BN)
    const int tid = threadIdx.x;
    const int threadCol = tid % (BN / TN), threadRow = tid / (BN / TN);
    const int aRow = tid / (BK / 4), aCol4 = tid % (BK / 4);
    constexpr int aStride = NT / (BK / 4);
    const int bRow = tid / (BN / 4), bCol4 = tid % (BN / 4);
    constexpr int bStride = NT / (BN / 4);
    const int rowBase = blockIdx.y * BM, colBase = blockIdx.x * BN;
    float acc[TM * TN] = {0.f};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int off = 0; off < BM; off += aStride) {
            const float4 v = load4(A, rowBase + aRow + off, M, k0 + aCol4 * 4, K, vecA);
            As[(aCol4 * 4 + 0) * BM + aRow + off] = v.x;
            As[(aCol4 * 4 + 1) * BM + aRow + off] = v.y;
            As[(aCol4 * 4 + 2) * BM + aRow + off] = v.z;
            As[(aCol4 * 4 + 3) * BM + aRow + off] = v.w;
        }
        for (int off = 0; off < BK; off += bStride) {
            *reinterpret_cast<float4*>(&Bs[(bRow + off) * BN + bCol4 * 4]) =
                load4(B, k0 + bRow + off, K, colBase + bCol4 * 4, N, vecB);
        }
        __syncthreads();
#pragma unroll
        for (int d = 0; d < BK; ++d) {
#pragma unroll
            for (int i = 0; i < TM; i += 4)
                *reinterpret_cast<float4*>(&regM[i]) =
                    *reinterpret_cast<const float4*>(&As[d * BM + threadRow * TM + i]);
#pragma unroll
            for (int j = 0; j < TN; j += 4)
                *reinterpret_cast<float4*>(&regN[j]) =
                    *reinterpret_cast<const float4*>(&Bs[d * BN + threadCol * TN + j]);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i * TN + j] += regM[i] * regN[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = rowBase + threadRow * TM + i;
#pragma unroll
        for (int j = 0; j < TN; j += 4) {
            const float4 v = make_float4(acc[i * TN + j], acc[i * TN + j + 1], acc[i * TN + j + 2],
                                         acc[i * TN + j + 3]);
            store4(C, row, M, colBase + threadCol * TN + j, N, vecC, v);
        }
    }
}

// 7. warp tiling: a level between block and thread. Each warp owns a WM x WN piece of the block's tile
//    and computes it as WMITER x WNITER sub-tiles of (WM/WMITER) x (WN/WNITER); a thread's results are
//    TM x TN in each sub-tile. A warp's shared-memory reads then fall in a few contiguous runs (fewer
//    bank conflicts), and the register tile per thread grows to WMITER*TM x WNITER*TN.
template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int NT>
__global__ void __launch_bounds__(NT)
    warptiled(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
              float* __restrict__ C, bool vecA, bool vecB, bool vecC) {
    constexpr int WARPS = NT / 32;
    static_assert((BN / WN) * (BM / WM) == WARPS, "one warp per warp tile");
    constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
    static_assert(WMITER >= 1 && WMITER * 32 * TM * TN * WNITER == WM * WN, "warp tile = 32 threads' tiles");
    constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
    static_assert(WSUBN % TN == 0 && (WSUBN / TN) * (WSUBM / TM) == 32, "32 threads per sub-tile");
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0 && BN % 4 == 0, "float4 granularity");
    static_assert(NT % (BK / 4) == 0 && NT % (BN / 4) == 0, "whole rows of the tiles per loading pass");
    __shared__ __align__(16) float As[BK * BM];  // transposed: (BK, BM)
    __shared__ __align__(16) float Bs[BK * BN];  // (BK, BN)
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int warpCol = warp % (BN / WN), warpRow = warp / (BN / WN);
    const int tCol = lane % (WSUBN / TN), tRow = lane / (WSUBN / TN);
    const int aRow = tid / (BK / 4), aCol4 = tid % (BK / 4);
    constexpr int aStride = NT / (BK / 4);
    const int bRow = tid / (BN / 4), bCol4 = tid % (BN / 4);
    constexpr int bStride = NT / (BN / 4);
    const int rowBase = blockIdx.y * BM, colBase = blockIdx.x * BN;
    float acc[WMITER * TM * WNITER * TN] = {0.f};
    float regM[WMITER * TM], regN[WNITER * TN];
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int off = 0; off < BM; off += aStride) {
            const float4 v = load4(A, rowBase + aRow + off, M, k0 + aCol4 * 4, K, vecA);
            As[(aCol4 * 4 + 0) * BM + aRow + off] = v.x;
            As[(aCol4 * 4 + 1) * BM + aRow + off] = v.y;
            As[(aCol4 * 4 + 2) * BM + aRow + off] = v.z;
            As[(aCol4 * 4 + 3) * BM + aRow + off] = v.w;
        }
        for (int off = 0; off < BK; off += bStride) {
            *reinterpret_cast<float4*>(&Bs[(bRow + off) * BN + bCol4 * 4]) =
                load4(B, k0 + bRow + off, K, colBase + bCol4 * 4, N, vecB);
        }
        __syncthreads();
#pragma unroll
        for (int d = 0; d < BK; ++d) {
#pragma unroll
            for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
                for (int i = 0; i < TM; i += 4)
                    *reinterpret_cast<float4*>(&regM[wm * TM + i]) = *reinterpret_cast<const float4*>(
                        &As[d * BM + warpRow * WM + wm * WSUBM + tRow * TM + i]);
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4)
                    *reinterpret_cast<float4*>(&regN[wn * TN + j]) = *reinterpret_cast<const float4*>(
                        &Bs[d * BN + warpCol * WN + wn * WSUBN + tCol * TN + j]);
#pragma unroll
            for (int i = 0; i < WMITER * TM; ++i)
#pragma unroll
                for (int j = 0; j < WNITER * TN; ++j) acc[i * (WNITER * TN) + j] += regM[i] * regN[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = rowBase + warpRow * WM + wm * WSUBM + tRow * TM + i;
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4) {
                    const float* a = &acc[(wm * TM + i) * (WNITER * TN) + wn * TN + j];
                    store4(C, row, M, colBase + warpCol * WN + wn * WSUBN + tCol * TN + j, N, vecC,
                           make_float4(a[0], a[1], a[2], a[3]));
                }
        }
}

// Bytes of shared memory of double_buffered<BM, BN, BK, ..., SKEW>: two buffers of A's transposed tile
// (with the skew's extra floats, see A_SKEW in the kernel) and two of B's.
template <int BM, int BN, int BK, bool SKEW>
constexpr int db_smem_bytes() {
    return 2 * 4 * (BK * BM + (SKEW ? (BK / 4 - 1) * (128 / BK) : 0) + BK * BN);
}

// 8. double-buffered shared memory: step 7's tiles with two shared buffers per operand. While the FMAs
//    run on buffer `cur`, the next K tile's global loads are already in flight into registers (issued
//    before the FMAs, consumed after them), and are then stored into buffer cur ^ 1: the load latency
//    (~600 cycles from DRAM/L2) hides behind the tile's FMAs instead of stalling every warp at the
//    __syncthreads that step 7 has between its loads and its math, and one barrier per K tile suffices
//    (buffer cur ^ 1 was last read in the previous iteration, before the previous barrier). The cost is
//    the staging registers (BM*BK/NT + BK*BN/NT floats per thread: 16 for 128 x 128 x 16 on 256
//    threads) and twice the shared memory. MINB: blocks per SM the register budget is held to (2 at
//    256 threads: at most 128 registers per thread, so that 16 warps per SM stay resident).
//    SKEW (the skewed kernel, kiln_sgemm_skewed): the rows of A's transposed
//    tile are skewed so that its stores are conflict-free, see a_col below.
template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int NT, int MINB, bool SKEW = false>
__global__ void __launch_bounds__(NT, MINB)
    double_buffered(int M, int N, int K, const float* __restrict__ A, const float* __restrict__ B,
                    float* __restrict__ C, bool vecA, bool vecB, bool vecC) {
    constexpr int WARPS = NT / 32;
    static_assert((BN / WN) * (BM / WM) == WARPS, "one warp per warp tile");
    constexpr int WMITER = (WM * WN) / (32 * TM * TN * WNITER);
    static_assert(WMITER >= 1 && WMITER * 32 * TM * TN * WNITER == WM * WN, "warp tile = 32 threads' tiles");
    constexpr int WSUBM = WM / WMITER, WSUBN = WN / WNITER;
    static_assert(WSUBN % TN == 0 && (WSUBN / TN) * (WSUBM / TM) == 32, "32 threads per sub-tile");
    static_assert(TM % 4 == 0 && TN % 4 == 0 && BK % 4 == 0 && BN % 4 == 0, "float4 granularity");
    static_assert(NT % (BK / 4) == 0 && NT % (BN / 4) == 0, "whole rows of the tiles per loading pass");
    constexpr int aStride = NT / (BK / 4), bStride = NT / (BN / 4);
    constexpr int A_LOADS = BM / aStride, B_LOADS = BK / bStride;  // float4s per thread per K tile
    static_assert(A_LOADS * aStride == BM && B_LOADS * bStride == BK, "whole tiles per thread");
    // Where column m of A's transposed tile sits in row k. Unskewed (As[k * BM + m]), a warp's transposed
    // store (its lanes: BK/4 k-groups x 32/(BK/4) consecutive m, storing one of the 4 floats of their
    // float4 at a time) puts the BK/4 k-groups on the same banks, since rows are BM = 0 mod 32 floats
    // apart: a (BK/4)-way conflict (4-way at BK = 16). SKEW shifts row k by (k / 4) * (128 / BK) floats
    // (8 per k-group at BK = 16), so the k-groups land on different banks: conflict-free. The shift is a
    // multiple of 4 (16-byte reads stay aligned) and never decreases with k, so row k still ends before
    // row k + 1 starts (the tile grows by the last shift); in the compute loop k is a compile-time
    // constant, so the shift is an immediate offset: no extra registers (an XOR swizzle of the float4
    // groups also removes the conflict, but its per-k address sets made ptxas spill at 128 registers).
    static_assert(!SKEW || (BK == 8 || BK == 16 || BK == 32), "SKEW: 32/(BK/4) consecutive m per k-group");
    constexpr int A_SKEW = SKEW ? 128 / BK : 0;             // floats per k-group
    constexpr int A_BUF = BK * BM + (BK / 4 - 1) * A_SKEW;  // floats per buffer
    auto a_col = [](int k, int m) -> int { return m + (k >> 2) * A_SKEW; };
    // Two buffers of A's transposed (BK, BM) tile, then two of B's (BK, BN). Up to 48 KiB they are static
    // arrays; past it (db_smem_bytes, e.g. 128 x 256 x 16 with the skew: 49344 bytes) they live in
    // dynamic shared memory, which the launcher sizes and opts in to (cudaFuncSetAttribute).
    constexpr bool DYN = db_smem_bytes<BM, BN, BK, SKEW>() > 48 * 1024;
    static_assert(db_smem_bytes<BM, BN, BK, SKEW>() == 4 * 2 * (A_BUF + BK * BN) && A_BUF % 4 == 0, "layout");
    using ABufs = float[2][A_BUF];    // transposed: (BK, BM), two buffers
    using BBufs = float[2][BK * BN];  // (BK, BN)
    extern __shared__ __align__(16) float db_dyn_smem[];
    __shared__ __align__(16) float As_st[DYN ? 1 : 2][DYN ? 4 : A_BUF];  // a placeholder when DYN
    __shared__ __align__(16) float Bs_st[DYN ? 1 : 2][DYN ? 4 : BK * BN];
    // A_BUF * 4 bytes is a multiple of 16, so B's buffers stay 16-byte aligned after A's
    ABufs& As = *reinterpret_cast<ABufs*>(DYN ? db_dyn_smem : &As_st[0][0]);
    BBufs& Bs = *reinterpret_cast<BBufs*>(DYN ? db_dyn_smem + 2 * A_BUF : &Bs_st[0][0]);
    const int tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const int warpCol = warp % (BN / WN), warpRow = warp / (BN / WN);
    const int tCol = lane % (WSUBN / TN), tRow = lane / (WSUBN / TN);
    const int aRow = tid / (BK / 4), aCol4 = tid % (BK / 4);
    const int bRow = tid / (BN / 4), bCol4 = tid % (BN / 4);
    const int rowBase = blockIdx.y * BM, colBase = blockIdx.x * BN;
    float acc[WMITER * TM * WNITER * TN] = {0.f};
    float regM[WMITER * TM], regN[WNITER * TN];
    float4 ra[A_LOADS], rb[B_LOADS];  // the next K tile, between its global load and its shared store

    auto fetch = [&](int k0) {
#pragma unroll
        for (int i = 0; i < A_LOADS; ++i) ra[i] = load4(A, rowBase + aRow + i * aStride, M, k0 + aCol4 * 4, K, vecA);
#pragma unroll
        for (int i = 0; i < B_LOADS; ++i) rb[i] = load4(B, k0 + bRow + i * bStride, K, colBase + bCol4 * 4, N, vecB);
    };
    auto stash = [&](int buf) {
#pragma unroll
        for (int i = 0; i < A_LOADS; ++i) {
            const int r = aRow + i * aStride;
            const int k = aCol4 * 4;  // the 4 k of this float4 share k / 4, hence one shift
            As[buf][(k + 0) * BM + a_col(k, r)] = ra[i].x;
            As[buf][(k + 1) * BM + a_col(k, r)] = ra[i].y;
            As[buf][(k + 2) * BM + a_col(k, r)] = ra[i].z;
            As[buf][(k + 3) * BM + a_col(k, r)] = ra[i].w;
        }
#pragma unroll
        for (int i = 0; i < B_LOADS; ++i)
            *reinterpret_cast<float4*>(&Bs[buf][(bRow + i * bStride) * BN + bCol4 * 4]) = rb[i];
    };

    fetch(0);
    stash(0);
    __syncthreads();
    int cur = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool more = k0 + BK < K;
        if (more) fetch(k0 + BK);  // in flight during the FMAs below
        const float* as = As[cur];
        const float* bs = Bs[cur];
#pragma unroll
        for (int d = 0; d < BK; ++d) {
#pragma unroll
            for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
                for (int i = 0; i < TM; i += 4)
                    *reinterpret_cast<float4*>(&regM[wm * TM + i]) = *reinterpret_cast<const float4*>(
                        &as[d * BM + a_col(d, warpRow * WM + wm * WSUBM + tRow * TM + i)]);
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4)
                    *reinterpret_cast<float4*>(&regN[wn * TN + j]) = *reinterpret_cast<const float4*>(
                        &bs[d * BN + warpCol * WN + wn * WSUBN + tCol * TN + j]);
#pragma unroll
            for (int i = 0; i < WMITER * TM; ++i)
#pragma unroll
                for (int j = 0; j < WNITER * TN; ++j) acc[i * (WNITER * TN) + j] += regM[i] * regN[j];
        }
        if (more) stash(cur ^ 1);
        __syncthreads();  // the next tile is in buffer cur ^ 1 for everyone; buffer cur is free
        cur ^= 1;
    }
#pragma unroll
    for (int wm = 0; wm < WMITER; ++wm)
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = rowBase + warpRow * WM + wm * WSUBM + tRow * TM + i;
#pragma unroll
            for (int wn = 0; wn < WNITER; ++wn)
#pragma unroll
                for (int j = 0; j < TN; j += 4) {
                    const float* a = &acc[(wm * TM + i) * (WNITER * TN) + wn * TN + j];
                    store4(C, row, M, colBase + warpCol * WN + wn * WSUBN + tCol * TN + j, N, vecC,
                           make_float4(a[0], a[1], a[2], a[3]));
                }
        }
}

}  // namespace sgemm_ladder

// The configuration tables, shared by the launchers (sgemm.cu) and the host emulation's tests
// (tests/kernels/cuda/emu/sgemm_emu.cpp).
// The tile configurations of the warp-tiled (step 6) and double-buffered (step 7) kernels, searched by
// the benchmark (step 6 launches config 0, step 7 config 1: its 256 threads keep 16 warps per SM).
// Columns: BM BN BK WM WN WNITER TM TN threads, in the order of ladder.WARPTILE_CONFIGS.
#define KILN_WARPTILE_CONFIGS(X)                  \
    X(0, 128, 128, 16, 64, 64, 4, 8, 4, 128)      \
    X(1, 128, 128, 16, 64, 32, 2, 8, 4, 256)      \
    X(2, 64, 128, 16, 32, 64, 2, 8, 4, 128)       \
    X(3, 128, 128, 8, 64, 64, 4, 8, 4, 128)       \
    X(4, 128, 128, 8, 64, 32, 2, 8, 4, 256)

// The skewed kernel (double_buffered with SKEW: A's transposed store conflict-free) and the tiles its
// sweep adds (config 4 the fastest on the H200 at 4096^3: 0.881x cuBLAS fp32). Columns: BM BN BK WM WN WNITER TM TN threads, blocks per SM the
// registers are held to, in the order of ladder.SKEWED_CONFIGS. 0 is step 7's tile; 1 splits each
// thread's 8 x 8 results into 2 x 2 sub-tiles of 4 x 4 (WMITER = 2): a warp's A reads then span 128 bytes
// (one shared-memory wavefront) where 8 consecutive rows span 256; 2 and 3 are the same at BK = 8 (half
// the staging registers and shared memory); 4 and 5 give each of 256 threads 128 results in a 128 x 256
// or 256 x 128 tile at BK = 8 (one block per SM; the shared-memory reads per FMA of an 8 x 16 thread tile
// are 3/4 of an 8 x 8's; BK = 16 would pass the 48 KiB of static shared memory with the skew); 6 and 7 are
// 4 and 5 with the thread's results as 2 x 4 sub-tiles of 4 x 4 (each A read one wavefront, as in 1).
// Configs 8-13 (timed at 5f8741c; 10 the fastest, 0.920x cuBLAS fp32): 8 and 9 are 4 and 5 at BK = 16 (one barrier and one loop
// iteration per 16 k instead of per 8, and the global loads of a K tile twice as far ahead of their use;
// 12 more staging registers, 232 / 243 in all, no spills; 49344 bytes of shared memory, past the 48 KiB
// of static arrays, so the launcher gives it as dynamic shared memory); 10 is 6 at BK = 16; 11 is a
// 128 x 128 x 16 tile whose 256 threads each hold one 8 x 8 tile (TN = 8, one sub-tile per warp of
// 64 x 32), two blocks per SM at 128 registers; 12 and 13 split config 4's 8 warps per SM into two
// blocks of 4 (128 x 128 tiles, each thread 8 x 16 results as in 4; 251 / 225 registers, so two blocks
// fill the 64K registers), at BK = 16 and 8: one block's barrier then stalls half the SM's warps, not all,
// as with the mma.sync kernel's fastest configuration (7: two blocks of 4 warps per SM).
#define KILN_SKEWED_CONFIGS(X)                       \
    X(0, 128, 128, 16, 64, 32, 2, 8, 4, 256, 2)      \
    X(1, 128, 128, 16, 64, 32, 2, 4, 4, 256, 2)      \
    X(2, 128, 128, 8, 64, 32, 2, 8, 4, 256, 2)       \
    X(3, 128, 128, 8, 64, 32, 2, 4, 4, 256, 2)       \
    X(4, 128, 256, 8, 64, 64, 4, 8, 4, 256, 1)       \
    X(5, 256, 128, 8, 64, 64, 4, 8, 4, 256, 1)       \
    X(6, 128, 256, 8, 64, 64, 4, 4, 4, 256, 1)       \
    X(7, 256, 128, 8, 64, 64, 4, 4, 4, 256, 1)       \
    X(8, 128, 256, 16, 64, 64, 4, 8, 4, 256, 1)      \
    X(9, 256, 128, 16, 64, 64, 4, 8, 4, 256, 1)      \
    X(10, 128, 256, 16, 64, 64, 4, 4, 4, 256, 1)     \
    X(11, 128, 128, 16, 64, 32, 1, 8, 8, 256, 2)     \
    X(12, 128, 128, 16, 64, 64, 4, 8, 4, 128, 2)     \
    X(13, 128, 128, 8, 64, 64, 4, 8, 4, 128, 2)
