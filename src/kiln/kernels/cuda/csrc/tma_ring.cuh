// The stage ring of a TMA-fed GEMM (wgmma_kernels.cuh, and mma_kernels.cuh's gemm_tma): its shared-memory
// layout, and its mbarrier protocol: a producer thread fills stage kt % STAGES with TMA copies that
// complete on full[s] by byte count; the consumers hand the stage back with one arrival each on empty[s].
// Kept here, above the PTX wrappers, so that the host emulation (tests/kernels/cuda/emu/hopper_emu.h,
// which replaces the wrappers) runs this protocol as the kernels do.
#pragma once
#include <stdint.h>

#include "hopper_ptx.cuh"

namespace kiln_hopper {

// The dynamic shared memory of such a GEMM: STAGES x (A tile, B tile) of BM and BN rows of 128 bytes of K
// (one 128-byte swizzle span), then the 2 x STAGES mbarriers, plus 1024 bytes of slack to align the tiles
// to the swizzle atom (TMA's 128-byte swizzle is a function of the address bits, so the readers' addresses
// agree with it only on 1024-byte aligned tiles: ring_smem).
template <int BM, int BN, int STAGES>
struct RingSmem {
    static constexpr int A_BYTES = BM * 128;
    static constexpr int B_BYTES = BN * 128;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int BAR_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int BYTES = 1024 + BAR_OFFSET + 2 * STAGES * 8;
    static_assert(A_BYTES % 1024 == 0 && B_BYTES % 1024 == 0, "tiles stay 1024-byte aligned");
    static_assert(BYTES <= 227 * 1024, "at most 227 KiB of shared memory per block on Hopper");
};

// The first 1024-byte aligned address of the block's dynamic shared memory `raw`.
__device__ __forceinline__ unsigned char* ring_smem(unsigned char* raw) {
    return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

// Thread 0 of the block, before a barrier of the whole block: each full[s] completes on the producer's
// one arrival (with its bytes), each empty[s] on `consumer_arrivals` arrivals.
template <int STAGES>
__device__ __forceinline__ void ring_init(uint64_t* full, uint64_t* empty, uint32_t consumer_arrivals) {
    for (int s = 0; s < STAGES; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], consumer_arrivals);
    }
    mbar_fence_init();
}

// The producer's turn at K tile kt: waits until its stage s = kt % STAGES is free (round r = kt / STAGES
// of the stage needs round r - 1's release: the r-th completion of empty[s], parity (r - 1) & 1), then
// announces the `bytes` its TMA copies will bring on full[s]. Returns s; the caller issues the copies.
template <int STAGES>
__device__ __forceinline__ int ring_acquire(uint64_t* full, uint64_t* empty, int kt, uint32_t bytes) {
    const int s = kt % STAGES;
    if (kt >= STAGES) mbar_wait(&empty[s], ((kt / STAGES) + 1) & 1);
    mbar_arrive_expect_tx(&full[s], bytes);
    return s;
}

}  // namespace kiln_hopper
