// Launchers of the tensor-core GEMMs (kernels in mma_kernels.cuh).
#include "api.h"
#include "common.cuh"
#include "mma_kernels.cuh"

namespace {

constexpr int kSmemBytes = mma_gemm::STAGES * 2 * mma_gemm::BM * mma_gemm::TILE_BYTES;  // 96 KiB

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class Kernel>
const char* allow_smem(Kernel k) {
    // more than 48 KiB of dynamic shared memory must be asked for, per kernel
    cudaError_t err = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

dim3 grid(int M, int N) {
    return dim3((unsigned)kiln::ceil_div(N, mma_gemm::BN), (unsigned)kiln::ceil_div(M, mma_gemm::BM));
}

}  // namespace

extern "C" const char* kiln_mma_bf16(int M, int N, int K, const void* A, const void* B, void* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_mma_bf16: M, N and K must be >= 1";
    if (K % 8 != 0 || N % 8 != 0) return "kiln_mma_bf16: K and N must be multiples of 8";
    if (!aligned16(A) || !aligned16(B) || !aligned16(C)) return "kiln_mma_bf16: A, B and C must be 16-byte aligned";
    if (const char* e = allow_smem(mma_gemm::bf16_gemm)) return e;
    mma_gemm::bf16_gemm<<<grid(M, N), mma_gemm::THREADS, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(
        M, N, K, static_cast<const __nv_bfloat16*>(A), static_cast<const __nv_bfloat16*>(B),
        static_cast<__nv_bfloat16*>(C));
    return kiln::launch_status();
}

extern "C" const char* kiln_mma_fp8(int M, int N, int K, const void* A, const void* Bt, const float* scale_a,
                                    const float* scale_b, void* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln_mma_fp8: M, N and K must be >= 1";
    if (K % 16 != 0 || N % 8 != 0) return "kiln_mma_fp8: K must be a multiple of 16 and N of 8";
    if (!aligned16(A) || !aligned16(Bt) || !aligned16(C)) return "kiln_mma_fp8: A, Bt and C must be 16-byte aligned";
    if (const char* e = allow_smem(mma_gemm::fp8_gemm)) return e;
    mma_gemm::fp8_gemm<<<grid(M, N), mma_gemm::THREADS, kSmemBytes, static_cast<cudaStream_t>(stream)>>>(
        M, N, K, static_cast<const unsigned char*>(A), static_cast<const unsigned char*>(Bt), scale_a, scale_b,
        static_cast<__nv_bfloat16*>(C));
    return kiln::launch_status();
}
