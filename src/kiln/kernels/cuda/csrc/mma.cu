// Launchers of the tensor-core GEMMs (kernels in mma_kernels.cuh), one per configuration of
// KILN_MMA_CONFIGS: the cp.async kernel, or the TMA-fed one where the TMA column is 1.
#include "api.h"
#include "common.cuh"
#include "mma_kernels.cuh"
#include "tma_map.cuh"

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <bool FP8, int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool PIPE, int KB = mma_gemm::TILE_BYTES,
          bool EPI = false, bool PERSIST = false>
const char* launch(int M, int N, int K, const void* A, const void* B, const float* scale_a, const float* scale_b,
                   void* C, cudaStream_t stream) {
    constexpr int smem = mma_gemm::smem_bytes<BM, BN, STAGES, KB>();
    auto kernel = mma_gemm::gemm<FP8, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST>;
    // more than 48 KiB of dynamic shared memory must be asked for, per kernel
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    const int64_t tiles = kiln::ceil_div(M, BM) * kiln::ceil_div(N, BN);
    unsigned blocks = (unsigned)tiles;
    if constexpr (PERSIST) {  // one block per tile slot the GPU holds at once; each loops over its tiles
        int per_sm = 0;
        const cudaError_t occ =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, WARPS_M * WARPS_N * 32, smem);
        if (occ != cudaSuccess) return cudaGetErrorString(occ);
        const int64_t slots = (int64_t)kiln::sm_count() * (per_sm > 0 ? per_sm : 1);
        blocks = (unsigned)(tiles < slots ? tiles : slots);
    }
    kernel<<<blocks, WARPS_M * WARPS_N * 32, smem, stream>>>(M, N, K, static_cast<const unsigned char*>(A),
                                                             static_cast<const unsigned char*>(B), scale_a, scale_b,
                                                             static_cast<__nv_bfloat16*>(C));
    return kiln::launch_status();
}

// The TMA-fed configurations (gemm_tma): tensor maps of A (M rows of K, boxes of BM rows) and B (K rows of
// N, boxes of 64 rows), built on the host per call, passed as __grid_constant__ parameters.
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES>
const char* launch_tma(int M, int N, int K, const void* A, const void* B, void* C, cudaStream_t stream) {
    if (!kiln::is_sm90()) return "kiln_mma_bf16: the TMA configurations need a Hopper GPU (compute capability 9.0)";
    CUtensorMap tm_a, tm_b;
    if (const char* e = kiln::make_tma_map(&tm_a, A, M, K, 2, BM)) return e;
    if (const char* e = kiln::make_tma_map(&tm_b, B, K, N, 2, 64)) return e;
    constexpr int smem = kiln_hopper::RingSmem<BM, BN, STAGES>::BYTES;
    constexpr int minb = mma_gemm::tma_blocks_per_sm<BM, BN, STAGES>();
    auto kernel = mma_gemm::gemm_tma<BM, BN, WARPS_M, WARPS_N, STAGES, minb>;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    const unsigned blocks = (unsigned)(kiln::ceil_div(M, BM) * kiln::ceil_div(N, BN));
    kernel<<<blocks, WARPS_M * WARPS_N * 32 + 128, smem, stream>>>(tm_a, tm_b, M, N, K, static_cast<__nv_bfloat16*>(C));
    return kiln::launch_status();
}

// One configuration's launcher (a template, so that the kernel a row does not use is never instantiated).
template <int BM, int BN, int WARPS_M, int WARPS_N, int STAGES, bool PIPE, int KB, bool EPI, bool PERSIST, bool TMA>
const char* launch_bf16(int M, int N, int K, const void* A, const void* B, void* C, cudaStream_t s) {
    if constexpr (TMA)
        return launch_tma<BM, BN, WARPS_M, WARPS_N, STAGES>(M, N, K, A, B, C, s);
    else
        return launch<false, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST>(M, N, K, A, B, nullptr, nullptr,
                                                                                        C, s);
}

const char* dispatch_bf16(int config, int M, int N, int K, const void* A, const void* B, void* C, void* stream) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (config) {
#define X(i, BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST, TMA)                                     \
    case i:                                                                                                    \
        return launch_bf16<BM, BN, WARPS_M, WARPS_N, STAGES, PIPE, KB, EPI, PERSIST, TMA>(M, N, K, A, B, C, s);
        KILN_MMA_CONFIGS(X)
#undef X
        default:
            return "kiln_mma_bf16: unknown config";
    }
}

}  // namespace

extern "C" int kiln_mma_configs(void) {
    int n = 0;
#define X(i, ...) ++n;
    KILN_MMA_CONFIGS(X)
#undef X
    return n;
}

extern "C" const char* kiln_mma_bf16(int config, int M, int N, int K, const void* A, const void* B, void* C,
                                     void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_mma_bf16: M, N and K must be >= 1";
    if (K % 8 != 0 || N % 8 != 0) return "kiln_mma_bf16: K and N must be multiples of 8";
    if (!aligned16(A) || !aligned16(B) || !aligned16(C)) return "kiln_mma_bf16: A, B and C must be 16-byte aligned";
    return dispatch_bf16(config, M, N, K, A, B, C, stream);
}

extern "C" const char* kiln_mma_fp8(int M, int N, int K, const void* A, const void* Bt, const float* scale_a,
                                    const float* scale_b, void* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_mma_fp8: M, N and K must be >= 1";
    if (K % 16 != 0 || N % 8 != 0) return "kiln_mma_fp8: K must be a multiple of 16 and N of 8";
    if (!aligned16(A) || !aligned16(Bt) || !aligned16(C)) return "kiln_mma_fp8: A, Bt and C must be 16-byte aligned";
    // config 0's geometry (128 x 128, 8 warps of 64 x 32, 3 stages): see KILN_MMA_CONFIGS
    return launch<true, 128, 128, 2, 4, 3, false>(M, N, K, A, Bt, scale_a, scale_b, C, static_cast<cudaStream_t>(stream));
}

extern "C" int kiln_mma_peak_chains(void) { return mma_gemm::PEAK_CHAINS; }

extern "C" const char* kiln_mma_peak(int iters, int grid, float* out, void* stream) {
    if (iters <= 0 || grid <= 0) return "kiln_mma_peak: iters and grid must be >= 1";
    mma_gemm::mma_peak<<<grid, mma_gemm::PEAK_THREADS, 0, static_cast<cudaStream_t>(stream)>>>(iters, out);
    return kiln::launch_status();
}
