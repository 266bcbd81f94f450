// Memory-hierarchy probes: each kernel isolates one effect and the Python side sweeps its parameter
// (kiln.kernels.cuda.probes).
//   strided reads      global loads 32 threads wide: stride 1 uses every byte of each 32-byte sector
//                      fetched, stride s >= 8 uses 4 bytes of each (1/8 of the traffic is useful).
//   bank conflicts     shared memory has 32 banks of 4 bytes; a warp reading words lane * stride hits
//                      gcd(stride, 32) words per bank, so the access is replayed that many times.
//   pointer chasing    one thread follows a random cycle: each load's address depends on the previous
//                      load, so the time per step is the latency of the level the working set fits in.
//   occupancy          the same streaming read while each thread holds R extra live registers: more
//                      registers per thread, fewer resident warps per SM, less latency hidden.
#include "api.h"
#include "common.cuh"

namespace {

constexpr int kThreads = 256;

// x holds n * stride floats; thread t reads x[i * stride] for its i (grid-stride), four independent
// loads in flight per iteration so one thread's latency is not the limit.
__global__ void strided_read(const float* __restrict__ x, float* __restrict__ out, int64_t n, int stride) {
    const int64_t T = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float acc0 = 0.f, acc1 = 0.f, acc2 = 0.f, acc3 = 0.f;
    int64_t i = tid;
    for (; i + 3 * T < n; i += 4 * T) {
        acc0 += x[i * stride];
        acc1 += x[(i + T) * stride];
        acc2 += x[(i + 2 * T) * stride];
        acc3 += x[(i + 3 * T) * stride];
    }
    for (; i < n; i += T) acc0 += x[i * stride];
    out[tid] = acc0 + acc1 + acc2 + acc3;
}

// 4096 words (16 KiB) of shared memory; lane l of each warp reads word (l * stride + i) & 4095 for
// i = 0 .. iters-1. Adding i shifts every lane by the same word, so the bank pattern (and the conflict
// degree gcd(stride, 32)) is the same in every iteration. Stride 33 is the padded fix of stride 32: a
// 32 x 32 tile stored with rows of 33 words makes a column read touch 32 different banks.
__global__ void smem_bank(int stride, float* __restrict__ out, int iters) {
    __shared__ float s[4096];
    for (int j = threadIdx.x; j < 4096; j += blockDim.x) s[j] = (float)j;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int base = lane * stride;
    float acc = 0.f;
    for (int i = 0; i < iters; i += 4) {
        // four loads per iteration; each depends on the loop counter, so none can be hoisted
        acc += s[(base + i) & 4095];
        acc += s[(base + i + 1) & 4095];
        acc += s[(base + i + 2) & 4095];
        acc += s[(base + i + 3) & 4095];
    }
    out[(int64_t)blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// One thread: `warm` untimed steps (they bring a working set that fits into the caches), then `iters`
// timed ones. __ldca caches the loads in L1 as well as L2.
__global__ void pointer_chase(const uint32_t* __restrict__ next, int64_t warm, int64_t iters,
                              long long* __restrict__ cycles, uint32_t* __restrict__ sink) {
    uint32_t j = 0;
    for (int64_t i = 0; i < warm; ++i) j = __ldca(next + j);
    const long long t0 = clock64();
    for (int64_t i = 0; i < iters; ++i) j = __ldca(next + j);
    const long long t1 = clock64();
    cycles[0] = t1 - t0;
    sink[0] = j;
}

// Streaming read (grid-stride over float4s) with R ballast registers per thread: loaded once before
// the loop, declared modified by an empty asm inside it (so they must stay in registers across the loop;
// the asm emits no instruction), summed after it. R changes registers per thread and nothing else.
template <int R>
__global__ void __launch_bounds__(kThreads) occupancy_read(const float4* __restrict__ x, float* __restrict__ out,
                                                           int64_t n4) {
    const int64_t T = (int64_t)gridDim.x * blockDim.x;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float keep[R > 0 ? R : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float4 v = x[(tid + (int64_t)r * 4099) % n4];
        keep[r] = v.x;
    }
    float acc = 0.f;
    for (int64_t i = tid; i < n4; i += T) {
        const float4 v = x[i];
        acc += (v.x + v.y) + (v.z + v.w);
#pragma unroll
        for (int r = 0; r < R; ++r) asm volatile("" : "+f"(keep[r]));
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc += keep[r];
    out[tid] = acc;
}

constexpr int kBallast[] = {0, 16, 32, 64, 96, 128, 160, 192};
constexpr int kOccVariants = sizeof(kBallast) / sizeof(kBallast[0]);

template <int R>
const char* occ_launch(const float* x, float* out, int64_t n4, int grid, cudaStream_t s) {
    occupancy_read<R><<<grid, kThreads, 0, s>>>(reinterpret_cast<const float4*>(x), out, n4);
    return kiln::launch_status();
}

template <int R>
const char* occ_info(int* regs, int* local_bytes, int* blocks) {
    cudaFuncAttributes attr;
    cudaError_t err = cudaFuncGetAttributes(&attr, occupancy_read<R>);
    if (err != cudaSuccess) return cudaGetErrorString(err);
    *regs = attr.numRegs;
    *local_bytes = (int)attr.localSizeBytes;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, occupancy_read<R>, kThreads, 0);
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

extern "C" const char* kiln_strided_read(const float* x, float* out, int64_t n, int stride, int grid,
                                         void* stream) {
    if (stride < 1) return "kiln_strided_read: stride must be >= 1";
    strided_read<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, out, n, stride);
    return kiln::launch_status();
}

extern "C" const char* kiln_smem_bank(int stride, float* out, int grid, int iters, void* stream) {
    if (stride < 1 || stride > 64) return "kiln_smem_bank: stride must be in 1..64";
    if (iters % 4 != 0) return "kiln_smem_bank: iters must be a multiple of 4";
    smem_bank<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(stride, out, iters);
    return kiln::launch_status();
}

extern "C" const char* kiln_pointer_chase(const uint32_t* next, int64_t warm, int64_t iters, long long* cycles,
                                          uint32_t* sink, void* stream) {
    pointer_chase<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(next, warm, iters, cycles, sink);
    return kiln::launch_status();
}

extern "C" int kiln_occupancy_variants(void) { return kOccVariants; }

extern "C" int kiln_occupancy_ballast(int variant) {
    return variant >= 0 && variant < kOccVariants ? kBallast[variant] : -1;
}

#define KILN_OCC_CASES(X) X(0, 0) X(1, 16) X(2, 32) X(3, 64) X(4, 96) X(5, 128) X(6, 160) X(7, 192)

extern "C" const char* kiln_occupancy_read(int variant, const float* x, float* out, int64_t n4, int grid,
                                           void* stream) {
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (variant) {
#define X(v, r) \
    case v:     \
        return occ_launch<r>(x, out, n4, grid, s);
        KILN_OCC_CASES(X)
#undef X
    }
    return "kiln_occupancy_read: unknown variant";
}

extern "C" const char* kiln_occupancy_info(int variant, int* regs, int* local_bytes, int* blocks_per_sm) {
    switch (variant) {
#define X(v, r) \
    case v:     \
        return occ_info<r>(regs, local_bytes, blocks_per_sm);
        KILN_OCC_CASES(X)
#undef X
    }
    return "kiln_occupancy_info: unknown variant";
}
