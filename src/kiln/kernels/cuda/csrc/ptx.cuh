// Thin wrappers over the PTX instructions the tensor-core kernels use, one per instruction, so the
// kernels read as the algorithm. Fragment layouts are those of the PTX ISA ("Matrix fragments for
// mma.m16n8k16 / mma.m16n8k32"): for a 16 x 8 fp32 result, lane l holds rows l/4 and l/4 + 8,
// columns 2*(l%4) and 2*(l%4) + 1.
#ifndef KILN_PTX_CUH
#define KILN_PTX_CUH
#include <cuda_runtime.h>
#include <stdint.h>

namespace kiln_ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers (sm_80+). full == false copies nothing
// and zero-fills the 16 bytes (src-size 0), which is how tiles past the matrix edge become zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool full) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
                 "r"(full ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8 x 8 matrices of 16-bit elements from shared memory: lanes 8i..8i+7 give the row addresses of
// matrix i (16 bytes each); lane l receives in r[i] row l/4, elements 2*(l%4) and 2*(l%4)+1 of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}
// The same, transposed: lane l receives rows 2*(l%4) and 2*(l%4)+1 of column l/4 of matrix i.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}

// d (16 x 8, fp32) += a (16 x 16, bf16, row-major) @ b (16 x 8, bf16, "col": k-pairs per register).
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d (16 x 8, fp32) += a (16 x 32, e4m3) @ b (32 x 8, e4m3): 4 fp8 values per register (sm_89+).
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    __trap();  // no FP8 tensor cores before Ada/Hopper; the Python side refuses to launch this
#else
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

}  // namespace kiln_ptx
#endif  // KILN_PTX_CUH
