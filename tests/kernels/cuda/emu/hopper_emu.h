// Host versions of csrc/hopper_ptx.cuh (included first, it takes that file's include guard): mbarriers
// with arrival and transaction counts and phase parity, named barriers, TMA 2D box loads with zero fill
// and the 128-byte swizzle, wgmma reading its operands through shared-memory descriptors. Every operation is
// synchronous (a valid ordering of the asynchronous hardware), and the swizzle is one function used by
// both the TMA writer and the wgmma reader: this checks the kernel's own offsets, stage ring and barrier
// protocol (a wrong parity deadlocks here too: the wait gives up after 20 s and aborts), not the
// hardware's reading of the descriptors, which only the GPU tests can.
#pragma once
#define KILN_HOPPER_PTX_CUH
#define __CUDA_ARCH_FEAT_SM90_ALL 1
#define __grid_constant__
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>

#include "cuda_emu.h"
#include "ptx_emu.h"
#include <cuda.h>  // the stub: CUtensorMap

inline int min(int a, int b) { return a < b ? a : b; }
inline void __trap() { abort(); }

// The block's shared memory (the test points the kernel's extern array here); blocks run one at a time.
alignas(1024) inline unsigned char emu_smem[256 * 1024];

namespace kiln_hopper {

inline uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - emu_smem);
}
// the 128-byte swizzle on a shared-memory byte address: bits 4-6 ^= bits 7-9
inline uint32_t sw128(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

struct Bar {
    uint32_t count = 0, pending = 0;
    int64_t tx = 0;
    uint32_t completed = 0;  // phases completed so far
};
inline std::mutex g_mu;
inline std::condition_variable g_cv;
inline std::map<const uint64_t*, Bar> g_bars;

inline void maybe_complete(Bar& b) {
    if (b.pending == 0 && b.tx == 0) {
        b.completed += 1;
        b.pending = b.count;
        g_cv.notify_all();
    }
}
inline void mbar_init(uint64_t* bar, uint32_t count) {
    std::lock_guard<std::mutex> lk(g_mu);
    g_bars[bar] = Bar{count, count, 0, 0};
}
inline void mbar_fence_init() {}
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    std::lock_guard<std::mutex> lk(g_mu);
    Bar& b = g_bars.at(bar);
    b.tx += bytes;
    b.pending -= 1;
    maybe_complete(b);
}
inline void mbar_arrive(uint64_t* bar) {
    std::lock_guard<std::mutex> lk(g_mu);
    Bar& b = g_bars.at(bar);
    if (b.pending == 0) {
        fprintf(stderr, "mbarrier: more arrivals than its count\n");
        abort();
    }
    b.pending -= 1;
    maybe_complete(b);
}
inline void mbar_complete_tx(uint64_t* bar, uint32_t bytes) {
    std::lock_guard<std::mutex> lk(g_mu);
    Bar& b = g_bars.at(bar);
    b.tx -= bytes;
    if (b.tx < 0) {
        fprintf(stderr, "mbarrier: more bytes than expected\n");
        abort();
    }
    maybe_complete(b);
}
// try_wait.parity p succeeds once the current phase's parity is not p (the phase of parity p is done)
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
    std::unique_lock<std::mutex> lk(g_mu);
    const bool ok = g_cv.wait_for(lk, std::chrono::seconds(20),
                                  [&] { return (g_bars.at(bar).completed & 1) != parity; });
    if (!ok) {
        fprintf(stderr, "mbarrier wait: deadlock (thread %u, barrier at byte %u, parity %u never completed)\n",
                threadIdx.x, smem_u32(bar), parity);
        abort();
    }
}

// try_wait.parity returns whether the phase is done, after suspending the thread for a while in hardware;
// here it blocks until the phase is done (or aborts as a deadlock, as mbar_wait does): a kernel's spin on
// it then never spins on the host's two cores
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
    mbar_wait(bar, parity);
    return true;
}

// bar.sync id, count: a barrier among `count` threads of the block (barrier 0 is __syncthreads'). The
// std::barrier of an id is made at its first use with that count, and resets itself after every phase;
// a launch with another count (another kernel: launches run one after another, so nothing waits on the
// old one then) replaces it.
inline std::barrier<>* g_named_barriers[16] = {};
inline uint32_t g_named_counts[16] = {};
inline void named_barrier_sync(uint32_t id, uint32_t count) {
    std::barrier<>* b;
    {
        std::lock_guard<std::mutex> lk(g_mu);
        if (g_named_barriers[id] == nullptr || g_named_counts[id] != count) {
            delete g_named_barriers[id];
            g_named_barriers[id] = new std::barrier<>(count);
            g_named_counts[id] = count;
        }
        b = g_named_barriers[id];
    }
    b->arrive_and_wait();
}

// box (box[0] elements x box[1] rows) at element c0 of row c1; outside the tensor reads 0
inline void tma_load_2d(void* dst, const void* map, uint64_t* bar, int c0, int c1) {
    const CUtensorMap& m = *static_cast<const CUtensorMap*>(map);
    const uint32_t row_bytes = m.box[0] * m.elem, dst0 = smem_u32(dst);
    if (row_bytes != 128 || dst0 % 1024) {
        fprintf(stderr, "tma: box rows must be 128 bytes and the destination 1024-byte aligned\n");
        abort();
    }
    for (uint32_t r = 0; r < m.box[1]; ++r)
        for (uint32_t e = 0; e < m.box[0]; ++e) {
            const int64_t gr = int64_t(c1) + r, ge = int64_t(c0) + e;
            const bool in = gr >= 0 && ge >= 0 && uint64_t(gr) < m.dims[1] && uint64_t(ge) < m.dims[0];
            for (int b = 0; b < m.elem; ++b)
                emu_smem[sw128(dst0 + r * 128 + e * m.elem + b)] = in ? m.base[gr * m.row_bytes + ge * m.elem + b] : 0;
        }
    mbar_complete_tx(bar, m.box[0] * m.box[1] * m.elem);
}

template <int N>
inline void setmaxnreg_dec() {}
template <int N>
inline void setmaxnreg_inc() {}

inline uint64_t sw128_desc(const void* smem_tile) {
    const uint64_t addr = smem_u32(smem_tile);
    return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
// The wgmma instructions are .sync.aligned: a warp's 32 lanes execute each one together, which is what
// keeps a lane from falling a whole stage-ring round behind its warp's lane 0 (the one that releases the
// stage). The emulation's lanes are free-running threads, so each of these waits for its warp.
inline void wgmma_fence() { emu::warp_sync(); }
inline void wgmma_commit() { emu::warp_sync(); }
template <int N>
inline void wgmma_wait() {
    emu::warp_sync();
}
template <int R>
inline void fence_regs(float (&)[R]) {}

// Byte (r, kb) of a K-major operand under a descriptor: 8-row groups SBO apart, rows 128 bytes apart
// inside a group, then the swizzle.
inline uint8_t desc_byte(uint64_t desc, int r, int kb) {
    if ((desc >> 62) != 1) {
        fprintf(stderr, "wgmma: only the 128-byte swizzle is emulated\n");
        abort();
    }
    const uint32_t start = uint32_t(desc & 0x3FFF) << 4, sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
    return emu_smem[sw128(start + (r / 8) * sbo + (r % 8) * 128 + kb)];
}
// this thread's registers of D (64 x N) += A (64 x KB bytes) . B (N x KB bytes), the fragment of
// hopper_ptx.cuh: register i is row 16w + l/4 + 8((i/2)%2), column 8(i/4) + 2(l%4) + i%2
template <int N, class Elem>
inline void wgmma_generic(float* d, uint64_t da, uint64_t db, int scale_d, int elem, Elem value) {
    emu::warp_sync();
    const int w = (threadIdx.x % 128) / 32, l = threadIdx.x % 32;
    for (int i = 0; i < N / 2; ++i) {
        const int row = 16 * w + l / 4 + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * (l % 4) + i % 2;
        float acc = scale_d ? d[i] : 0.f;
        for (int k = 0; k < 32 / elem; ++k) {
            uint32_t a = 0, b = 0;
            for (int j = 0; j < elem; ++j) {
                a |= uint32_t(desc_byte(da, row, k * elem + j)) << (8 * j);
                b |= uint32_t(desc_byte(db, col, k * elem + j)) << (8 * j);
            }
            acc += value(a) * value(b);
        }
        d[i] = acc;
    }
}
template <int N>
inline void wgmma_bf16(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    wgmma_generic<N>(d, da, db, scale_d, 2, [](uint32_t v) { return emu::bf16(v); });
}
template <int N>
inline void wgmma_e4m3(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
    wgmma_generic<N>(d, da, db, scale_d, 1, [](uint32_t v) { return emu::e4m3(v); });
}

}  // namespace kiln_hopper
