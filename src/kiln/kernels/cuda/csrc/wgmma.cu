// Launchers of the Hopper wgmma + TMA GEMMs (kernels in wgmma_kernels.cuh): the TMA descriptors are
// built here on the host, one per operand per call (a few microseconds of CPU), and passed to the kernel
// as __grid_constant__ parameters.
#include "api.h"
#include "common.cuh"
#include "tma_map.cuh"
#include "wgmma_kernels.cuh"

namespace {

template <bool FP8, int BM, int BN, int NC, int STAGES>
const char* launch(int M, int N, int K, const void* A, const void* Bt, const float* scale_a, const float* scale_b,
                   void* C, cudaStream_t stream) {
    constexpr int elem = FP8 ? 1 : 2;
    CUtensorMap tm_a, tm_b;
    if (const char* e = kiln::make_tma_map(&tm_a, A, M, K, elem, BM)) return e;
    if (const char* e = kiln::make_tma_map(&tm_b, Bt, N, K, elem, BN)) return e;
    constexpr int smem = kiln_hopper::RingSmem<BM, BN, STAGES>::BYTES;
    auto kernel = wgmma_gemm::gemm<FP8, BM, BN, NC, STAGES>;
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    const unsigned blocks = (unsigned)(kiln::ceil_div(M, BM) * kiln::ceil_div(N, BN));
    kernel<<<blocks, (NC + 1) * 128, smem, stream>>>(tm_a, tm_b, M, N, K, static_cast<__nv_bfloat16*>(C), scale_a,
                                                      scale_b);
    return kiln::launch_status();
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <bool FP8>
const char* dispatch(int config, int M, int N, int K, const void* A, const void* Bt, const float* scale_a,
                     const float* scale_b, void* C, void* stream) {
    if (M <= 0 || N <= 0 || K <= 0) return "kiln wgmma: M, N and K must be >= 1";
    if (K % (FP8 ? 16 : 8) != 0) return "kiln wgmma: K must be a multiple of 8 (bf16) or 16 (e4m3): 16-byte rows for TMA";
    if (N % 8 != 0) return "kiln wgmma: N must be a multiple of 8";
    if (!aligned16(A) || !aligned16(Bt) || !aligned16(C)) return "kiln wgmma: A, Bt and C must be 16-byte aligned";
    if (!kiln::is_sm90()) return "kiln wgmma: needs a Hopper GPU (compute capability 9.0, built for sm_90a)";
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (config) {
#define X(i, BM, BN, NC, STAGES) \
    case i:                      \
        return launch<FP8, BM, BN, NC, STAGES>(M, N, K, A, Bt, scale_a, scale_b, C, s);
        KILN_WGMMA_CONFIGS(X)
#undef X
        default:
            return "kiln wgmma: unknown config";
    }
}

}  // namespace

extern "C" int kiln_wgmma_configs(void) {
    int n = 0;
#define X(i, BM, BN, NC, STAGES) ++n;
    KILN_WGMMA_CONFIGS(X)
#undef X
    return n;
}

extern "C" const char* kiln_wgmma_bf16(int config, int M, int N, int K, const void* A, const void* Bt, void* C,
                                       void* stream) {
    return dispatch<false>(config, M, N, K, A, Bt, nullptr, nullptr, C, stream);
}

extern "C" const char* kiln_wgmma_fp8(int config, int M, int N, int K, const void* A, const void* Bt,
                                      const float* scale_a, const float* scale_b, void* C, void* stream) {
    return dispatch<true>(config, M, N, K, A, Bt, scale_a, scale_b, C, stream);
}
