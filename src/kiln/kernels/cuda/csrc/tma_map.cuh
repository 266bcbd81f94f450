// Host side of TMA, shared by the launchers of the TMA-fed GEMMs (wgmma.cu, mma.cu): the tensor map of a
// row-major operand, read in boxes of 128-byte rows with the 128-byte swizzle, and the Hopper check.
#pragma once
#include <cuda.h>  // CUtensorMap and the encode function's types (the function itself comes through the runtime)
#include <cuda_runtime.h>

namespace kiln {

// cuTensorMapEncodeTiled is a driver API function; reaching it through the runtime's entry-point query
// keeps the extension free of a -lcuda link (torch's builder links the runtime only).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encode_tiled() {
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

// The tensor map of a row-major operand of `rows` rows of `cols` elements of `elem` bytes (row stride
// cols * elem bytes, a multiple of 16), read in boxes of box_rows rows x 128 bytes with the 128-byte
// swizzle. Out-of-bounds elements of a box read as zero (OOB_FILL_NONE fills zeros; NAN_REQUEST_ZERO_FMA
// would fill NaNs). NULL on success, else the reason.
inline const char* make_tma_map(CUtensorMap* map, const void* base, int rows, int cols, int elem, int box_rows) {
    const EncodeTiled encode = encode_tiled();
    if (encode == nullptr) return "kiln TMA: cuTensorMapEncodeTiled not found in the CUDA driver (needs CUDA 12+)";
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};  // innermost first
    const cuuint64_t strides[1] = {(cuuint64_t)cols * elem};          // bytes from row to row
    const cuuint32_t box[2] = {(cuuint32_t)(128 / elem), (cuuint32_t)box_rows};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult r = encode(map, elem == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8, 2,
                              const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? nullptr : "kiln TMA: cuTensorMapEncodeTiled rejected the operand (alignment or strides)";
}

// wgmma, TMA and setmaxnreg: compute capability 9.0, with the kernels built for sm_90a.
inline bool is_sm90() {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    return major == 9 && minor == 0;
}

}  // namespace kiln
