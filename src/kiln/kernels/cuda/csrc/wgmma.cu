// Launchers of the Hopper wgmma + TMA GEMMs (kernels in wgmma_kernels.cuh): the TMA descriptors are
// built here on the host, one per operand per call (a few microseconds of CPU), and passed to the kernel
// as __grid_constant__ parameters.
#include <cuda.h>

#include "api.h"
#include "common.cuh"
#include "wgmma_kernels.cuh"

namespace {

// cuTensorMapEncodeTiled is a driver API function; reaching it through the runtime's entry-point query
// keeps the extension free of a -lcuda link (torch's builder links the runtime only).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
    // looked up once per process (a thread-safe static), never changed after
    static const EncodeTiled fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
        const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
#else
        const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
        return (e == cudaSuccess && q == cudaDriverEntryPointSuccess) ? reinterpret_cast<EncodeTiled>(p) : nullptr;
    }();
    return fn;
}

// The tensor map of a K-major operand: `rows` rows of K elements of `elem` bytes (row stride K * elem
// bytes, a multiple of 16), read in boxes of box_rows rows x 128 bytes with the 128-byte swizzle.
// Out-of-bounds elements of a box read as zero (OOB_FILL_NONE fills zeros; NAN_REQUEST_ZERO_FMA would
// fill NaNs).
const char* make_map(CUtensorMap* map, const void* base, int rows, int K, int elem, int box_rows) {
    const EncodeTiled encode = encode_tiled();
    if (encode == nullptr) return "kiln wgmma: cuTensorMapEncodeTiled not found in the CUDA driver (needs CUDA 12+)";
    const cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows};  // innermost first
    const cuuint64_t strides[1] = {(cuuint64_t)K * elem};         // bytes from row to row
    const cuuint32_t box[2] = {(cuuint32_t)(wgmma_gemm::ROW_BYTES / elem), (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = encode(map, elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                              const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? nullptr : "kiln wgmma: cuTensorMapEncodeTiled rejected the operand (alignment or strides)";
}

bool is_sm90() {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
}

template <bool FP8, int BM, int BN, int NC, int STAGES>
const char* launch(int M, int N, int K, const void* A, const void* Bt, const float* scale_a, const float* scale_b,
                   void* C, cudaStream_t stream) {
    constexpr int elem = FP8 ? 1 : 2;
    CUtensorMap tm_a, tm_b;
    if (const char* e = make_map(&tm_a, A, M, K, elem, BM)) return e;
    if (const char* e = make_map(&tm_b, Bt, N, K, elem, BN)) return e;
    constexpr int smem = wgmma_gemm::Smem<BM, BN, STAGES>::BYTES;
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
    if (!is_sm90()) return "kiln wgmma: needs a Hopper GPU (compute capability 9.0, built for sm_90a)";
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
