// Vector add three ways: what the thread/block model costs and what vector loads buy.
//
// out[i] = a[i] + b[i]. It moves 12 bytes per element and does one add, so its ceiling is DRAM
// bandwidth: a kernel is good when it reaches the device's copy bandwidth (read+write bytes per second).
#include "api.h"
#include "common.cuh"

namespace {

constexpr int kThreads = 256;

// One element per thread: grid = ceil(n / 256) blocks. The simplest mapping; a grid of millions of
// blocks, each retiring after one load pair.
__global__ void add_one_per_thread(const float* __restrict__ a, const float* __restrict__ b,
                                   float* __restrict__ out, int64_t n) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// Grid-stride loop: a fixed grid (a few blocks per SM) walks the array; any n works with any grid.
__global__ void add_grid_stride(const float* __restrict__ a, const float* __restrict__ b,
                                float* __restrict__ out, int64_t n) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) out[i] = a[i] + b[i];
}

// float4: one 16-byte load per operand per thread (LDG.128), a quarter of the load instructions.
// Needs 16-byte aligned pointers; the n % 4 tail is done by the first threads with scalar loads.
__global__ void add_float4(const float4* __restrict__ a, const float4* __restrict__ b,
                           float4* __restrict__ out, int64_t n) {
    const int64_t n4 = n / 4;
    const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = tid; i < n4; i += step) {
        float4 x = a[i], y = b[i];
        out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    const int64_t t = n4 * 4 + tid;  // the 0..3 trailing elements
    if (t < n) {
        reinterpret_cast<float*>(out)[t] =
            reinterpret_cast<const float*>(a)[t] + reinterpret_cast<const float*>(b)[t];
    }
}

}  // namespace

extern "C" const char* kiln_vector_add(int variant, const float* a, const float* b, float* out, int64_t n,
                                       void* stream) {
    if (n <= 0) return nullptr;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int persistent = kiln::sm_count() * 8;  // 8 blocks of 256 = 2048 threads: a full SM each
    switch (variant) {
        case 0:
            add_one_per_thread<<<(unsigned)kiln::ceil_div(n, kThreads), kThreads, 0, s>>>(a, b, out, n);
            break;
        case 1: {
            const int64_t need = kiln::ceil_div(n, kThreads);
            add_grid_stride<<<(unsigned)(need < persistent ? need : persistent), kThreads, 0, s>>>(a, b, out, n);
            break;
        }
        case 2: {
            const int64_t need = kiln::ceil_div(n / 4 > 0 ? n / 4 : 1, kThreads);
            add_float4<<<(unsigned)(need < persistent ? need : persistent), kThreads, 0, s>>>(
                reinterpret_cast<const float4*>(a), reinterpret_cast<const float4*>(b),
                reinterpret_cast<float4*>(out), n);
            break;
        }
        default:
            return "kiln_vector_add: unknown variant (0, 1 or 2)";
    }
    return kiln::launch_status();
}
