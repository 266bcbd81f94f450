// A host emulation of the CUDA execution model, enough to run kiln's kernels on a CPU with g++ and check
// their index arithmetic, bounds checks and barrier placement (tests/kernels/cuda/test_emulated.py).
//
// Blocks run one after another; the threads of a block run as std::threads, so __syncthreads is a real
// barrier and a missing one shows up as a wrong or varying result. __shared__ becomes `static` (one copy,
// shared by the block's threads; blocks do not overlap). No timing, no warps scheduling, no memory model
// beyond C++'s: the GPU tests stay the oracle for what the hardware does.
#pragma once
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;
inline std::barrier<>* g_block_barrier = nullptr;
inline std::vector<std::barrier<>*> g_warp_barriers;  // one per warp of the running block

inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }

// Runs f() as every thread of every block of the grid.
template <class F>
void emu_launch(dim3 grid, dim3 block, F f) {
    gridDim = grid;
    blockDim = block;
    const unsigned nt = block.x * block.y * block.z;
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            std::barrier<> bar(nt);
            g_block_barrier = &bar;
            std::vector<std::barrier<>*> warps;
            for (unsigned w = 0; w < (nt + 31) / 32; ++w) warps.push_back(new std::barrier<>(32));
            g_warp_barriers = warps;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < nt; ++t)
                ts.emplace_back([&, t] {
                    blockIdx = dim3(bx, by);
                    threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
                    f();
                });
            for (auto& th : ts) th.join();
            for (auto* w : warps) delete w;
        }
}
