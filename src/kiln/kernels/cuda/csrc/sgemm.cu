// Launch configurations of the SGEMM ladder (kernels and their configuration tables in sgemm_kernels.cuh).
#include "api.h"
#include "common.cuh"
#include "sgemm_kernels.cuh"

namespace {

using namespace sgemm_ladder;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

dim3 tiles(int M, int N, int BM, int BN) {
    return dim3((unsigned)kiln::ceil_div(N, BN), (unsigned)kiln::ceil_div(M, BM));  // x: columns, y: rows
}

}  // namespace

extern "C" int kiln_sgemm_steps(void) { return 8; }

extern "C" int kiln_sgemm_warptile_configs(void) { return 5; }

// Blocks per SM the double-buffered kernel's registers are held to: 2 at 256 threads (<= 128 registers),
// else 1 (the 128-thread configurations hold 128 accumulators per thread).
constexpr int db_min_blocks(int threads) { return threads >= 256 ? 2 : 1; }

extern "C" const char* kiln_sgemm_double_buffered(int config, int M, int N, int K, const float* A,
                                                  const float* B, float* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_sgemm_double_buffered: M, N and K must be >= 1";
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vecA = K % 4 == 0 && aligned16(A);
    const bool vecB = N % 4 == 0 && aligned16(B);
    const bool vecC = N % 4 == 0 && aligned16(C);
    switch (config) {
#define X(i, BM, BN, BK, WM, WN, WNITER, TM, TN, NT)                                            \
    case i:                                                                                      \
        double_buffered<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, db_min_blocks(NT)>              \
            <<<tiles(M, N, BM, BN), NT, 0, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);             \
        break;
        KILN_WARPTILE_CONFIGS(X)
#undef X
        default:
            return "kiln_sgemm_double_buffered: unknown config";
    }
    return kiln::launch_status();
}

extern "C" int kiln_sgemm_skewed_configs(void) { return 14; }

namespace {

// Launches the skewed kernel at one configuration; past 48 KiB its buffers are dynamic shared memory,
// which must be asked for per kernel (configs 8-10: 128 x 256 / 256 x 128 tiles at BK = 16, 49344 bytes).
template <int BM, int BN, int BK, int WM, int WN, int WNITER, int TM, int TN, int NT, int MINB>
const char* launch_skewed(int M, int N, int K, const float* A, const float* B, float* C, bool vecA, bool vecB,
                          bool vecC, cudaStream_t s) {
    auto kernel = double_buffered<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB, true>;
    constexpr int bytes = db_smem_bytes<BM, BN, BK, true>();
    constexpr int dyn = bytes > 48 * 1024 ? bytes : 0;
    if (dyn) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
        if (err != cudaSuccess) return cudaGetErrorString(err);
    }
    kernel<<<tiles(M, N, BM, BN), NT, dyn, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);
    return kiln::launch_status();
}

}  // namespace

extern "C" const char* kiln_sgemm_skewed(int config, int M, int N, int K, const float* A, const float* B,
                                         float* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_sgemm_skewed: M, N and K must be >= 1";
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vecA = K % 4 == 0 && aligned16(A);
    const bool vecB = N % 4 == 0 && aligned16(B);
    const bool vecC = N % 4 == 0 && aligned16(C);
    switch (config) {
#define X(i, BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB) \
    case i:                                                \
        return launch_skewed<BM, BN, BK, WM, WN, WNITER, TM, TN, NT, MINB>(M, N, K, A, B, C, vecA, vecB, vecC, s);
        KILN_SKEWED_CONFIGS(X)
#undef X
        default:
            return "kiln_sgemm_skewed: unknown config";
    }
}

extern "C" const char* kiln_sgemm_warptile(int config, int M, int N, int K, const float* A, const float* B,
                                           float* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_sgemm_warptile: M, N and K must be >= 1";
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vecA = K % 4 == 0 && aligned16(A);
    const bool vecB = N % 4 == 0 && aligned16(B);
    const bool vecC = N % 4 == 0 && aligned16(C);
    switch (config) {
#define X(i, BM, BN, BK, WM, WN, WNITER, TM, TN, NT)                                            \
    case i:                                                                                      \
        warptiled<BM, BN, BK, WM, WN, WNITER, TM, TN, NT>                                        \
            <<<tiles(M, N, BM, BN), NT, 0, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);             \
        break;
        KILN_WARPTILE_CONFIGS(X)
#undef X
        default:
            return "kiln_sgemm_warptile: unknown config";
    }
    return kiln::launch_status();
}

extern "C" const char* kiln_sgemm(int step, int M, int N, int K, const float* A, const float* B, float* C,
                                  void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_sgemm: M, N and K must be >= 1";
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool vecA = K % 4 == 0 && aligned16(A);
    const bool vecB = N % 4 == 0 && aligned16(B);
    const bool vecC = N % 4 == 0 && aligned16(C);
    switch (step) {
        case 0:
            naive<<<dim3((unsigned)kiln::ceil_div(M, 32), (unsigned)kiln::ceil_div(N, 32)), dim3(32, 32), 0, s>>>(
                M, N, K, A, B, C);
            break;
        case 1:
            coalesced<32><<<tiles(M, N, 32, 32), 32 * 32, 0, s>>>(M, N, K, A, B, C);
            break;
        case 2:
            smem_tiled<32><<<tiles(M, N, 32, 32), 32 * 32, 0, s>>>(M, N, K, A, B, C);
            break;
        case 3:
            blocktile_1d<64, 64, 8, 8><<<tiles(M, N, 64, 64), 64 * 64 / 8, 0, s>>>(M, N, K, A, B, C);
            break;
        case 4:
            blocktile_2d<128, 128, 8, 8, 8><<<tiles(M, N, 128, 128), 256, 0, s>>>(M, N, K, A, B, C);
            break;
        case 5:
            vectorized<128, 128, 8, 8, 8><<<tiles(M, N, 128, 128), 256, 0, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);
            break;
        case 6:
            // BM BN BK WM WN WNITER TM TN threads: 4 warps of 64 x 64, each 1 x 4 sub-tiles of 64 x 16
            warptiled<128, 128, 16, 64, 64, 4, 8, 4, 128>
                <<<tiles(M, N, 128, 128), 128, 0, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);
            break;
        case 7:
            // config 1 of KILN_WARPTILE_CONFIGS: 8 warps of 64 x 32, 2 blocks per SM
            double_buffered<128, 128, 16, 64, 32, 2, 8, 4, 256, 2>
                <<<tiles(M, N, 128, 128), 256, 0, s>>>(M, N, K, A, B, C, vecA, vecB, vecC);
            break;
        default:
            return "kiln_sgemm: unknown step (0..7)";
    }
    return kiln::launch_status();
}
