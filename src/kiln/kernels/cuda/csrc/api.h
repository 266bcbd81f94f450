// The C interface between the CUDA sources and the torch binding (binding.cpp).
//
// Every launcher takes raw device pointers and the CUDA stream as `void*`, launches, and returns NULL on
// success or the CUDA error string of the launch. Keeping torch out of the .cu files lets each one
// compile standalone with nvcc (CI has nvcc but no CUDA torch), and keeps the binding a thin layer.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---- vector_add.cu: out = a + b over n floats ----
// variant 0: one element per thread; 1: grid-stride loop over a fixed grid; 2: float4 (16-byte aligned).
const char* kiln_vector_add(int variant, const float* a, const float* b, float* out, int64_t n, void* stream);

// ---- probes.cu: the memory hierarchy measured ----
// Reads x[i * stride] for i < n (x holds n * stride floats); out gets one partial sum per thread
// (grid * 256 floats) so the reads cannot be optimized away.
const char* kiln_strided_read(const float* x, float* out, int64_t n, int stride, int grid, void* stream);
// Each warp reads shared memory at word (lane * stride + i) & 4095, `iters` times; out: grid * 256 floats.
const char* kiln_smem_bank(int stride, float* out, int grid, int iters, void* stream);
// One thread follows next[] from index 0: `warm` untimed steps, then `iters` timed dependent loads;
// cycles[0] = clock64 cycles of the timed loop, sink[0] = the last index (keeps the chain alive).
const char* kiln_pointer_chase(const uint32_t* next, int64_t warm, int64_t iters, long long* cycles,
                               uint32_t* sink, void* stream);
// Streaming read of n4 float4s while holding `kiln_occupancy_ballast(variant)` extra live registers per
// thread; block of 256 threads; out: grid * 256 floats.
int kiln_occupancy_variants(void);
int kiln_occupancy_ballast(int variant);
const char* kiln_occupancy_read(int variant, const float* x, float* out, int64_t n4, int grid, void* stream);
// Registers per thread, local (spill) bytes per thread and resident 256-thread blocks per SM of a variant.
const char* kiln_occupancy_info(int variant, int* regs, int* local_bytes, int* blocks_per_sm);

// ---- sgemm.cu: C (M, N) = A (M, K) @ B (K, N), fp32, row-major, any M, N, K >= 1 ----
// step: 0 naive, 1 coalesced, 2 shared-memory tiling, 3 1D blocktiling, 4 2D blocktiling,
// 5 vectorized loads, 6 warp tiling, 7 double-buffered shared memory (the order of
// kiln.kernels.cuda.ladder.SGEMM_LADDER).
int kiln_sgemm_steps(void);
const char* kiln_sgemm(int step, int M, int N, int K, const float* A, const float* B, float* C, void* stream);
// The warp-tiled kernel (step 6) at one of kiln_sgemm_warptile_configs() tile configurations (autotuning).
int kiln_sgemm_warptile_configs(void);
const char* kiln_sgemm_warptile(int config, int M, int N, int K, const float* A, const float* B, float* C,
                                void* stream);
// The double-buffered kernel (step 7) at one of the same tile configurations.
const char* kiln_sgemm_double_buffered(int config, int M, int N, int K, const float* A, const float* B, float* C,
                                       void* stream);
// The double-buffered kernel with A's transposed shared-memory rows skewed (conflict-free stores), at one of
// kiln_sgemm_skewed_configs() tile configurations (KILN_SKEWED_CONFIGS, ladder.SKEWED_CONFIGS).
int kiln_sgemm_skewed_configs(void);
const char* kiln_sgemm_skewed(int config, int M, int N, int K, const float* A, const float* B, float* C,
                              void* stream);

// ---- mma_bf16.cu: C (M, N) bf16 = A (M, K) bf16 @ B (K, N) bf16, fp32 accumulation ----
// Tensor cores through mma.sync m16n8k16 with ldmatrix, XOR-swizzled shared memory and a cp.async
// multi-stage pipeline. Needs sm_80+; K % 8 == 0, N % 8 == 0 and 16-byte aligned A, B, C. config: an index
// of KILN_MMA_CONFIGS (mma_kernels.cuh), kiln.kernels.cuda.ladder.MMA_CONFIGS.
int kiln_mma_configs(void);
const char* kiln_mma_bf16(int config, int M, int N, int K, const void* A, const void* B, void* C, void* stream);

// The mma.sync rate with no memory traffic: grid blocks of 256 threads, each warp iters x
// kiln_mma_peak_chains() bf16 m16n8k16 on registers; out: grid * 256 floats, each chains * 4 * iters * 16.
int kiln_mma_peak_chains(void);
const char* kiln_mma_peak(int iters, int grid, float* out, void* stream);

// ---- mma_fp8.cu: C (M, N) bf16 = scale_a * scale_b * A (M, K) e4m3 @ Bt (N, K) e4m3^T ----
// mma.sync m16n8k32 e4m3 (sm_89+), the geometry of bf16 config 0; K % 16 == 0; scales are device pointers
// to one float each.
const char* kiln_mma_fp8(int M, int N, int K, const void* A, const void* Bt, const float* scale_a,
                         const float* scale_b, void* C, void* stream);

// ---- wgmma.cu: Hopper warpgroup MMA fed by TMA, C (M, N) bf16 = A (M, K) @ Bt (N, K)^T ----
// Both operands K-major (Bt is B transposed, like an nn.Linear weight). bf16: K % 8 == 0; e4m3 (times
// *scale_a * *scale_b): K % 16 == 0; both: N % 8 == 0, 16-byte aligned pointers, a compute capability 9.0
// GPU. config: an index of KILN_WGMMA_CONFIGS (wgmma_kernels.cuh), kiln.kernels.cuda.ladder.WGMMA_CONFIGS.
int kiln_wgmma_configs(void);
const char* kiln_wgmma_bf16(int config, int M, int N, int K, const void* A, const void* Bt, void* C, void* stream);
const char* kiln_wgmma_fp8(int config, int M, int N, int K, const void* A, const void* Bt, const float* scale_a,
                           const float* scale_b, void* C, void* stream);

#ifdef __cplusplus
}
#endif
