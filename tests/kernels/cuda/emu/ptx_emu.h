// Host versions of the PTX wrappers of csrc/ptx.cuh (included first, it takes ptx.cuh's include guard).
// Warp-collective instructions exchange their operands through per-warp scratch between two warp
// barriers. Fragment layouts are transcribed from the PTX ISA ("Matrix fragments for mma.m16n8k16" with
// .bf16, "mma.m16n8k32" with .e4m3, "ldmatrix"): an error in reading the ISA would be shared with the
// kernels, which is why the GPU tests compare against torch.
#pragma once
#define KILN_PTX_CUH
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_emu.h"

namespace emu {
inline int lane() { return threadIdx.x % 32; }
inline int warp() { return threadIdx.x / 32; }
inline void warp_sync() { g_warp_barriers[warp()]->arrive_and_wait(); }
inline const void* addr[32][32];
inline uint32_t a_regs[32][32][4], b_regs[32][32][2];
inline float bf16(uint32_t bits) {
    uint32_t u = bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float e4m3(uint32_t b) {
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    const float v = e == 0 ? ldexpf(m / 8.f, -6) : ldexpf(1 + m / 8.f, e - 7);
    return s ? -v : v;
}
}  // namespace emu

namespace kiln_ptx {
inline void cp_async16(void* s, const void* g, bool full) {
    if (full)
        memcpy(s, g, 16);
    else
        memset(s, 0, 16);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}

// lane l gets, of matrix i (row addresses from lanes 8i..8i+7), row l/4, elements 2(l%4), 2(l%4)+1
inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    const int w = emu::warp(), l = emu::lane();
    if (reinterpret_cast<uintptr_t>(p) % 16) {
        fprintf(stderr, "ldmatrix: row address not 16-byte aligned\n");
        abort();
    }
    emu::addr[w][l] = p;
    emu::warp_sync();
    for (int i = 0; i < 4; ++i) {
        const uint16_t* row = static_cast<const uint16_t*>(emu::addr[w][i * 8 + l / 4]);
        r[i] = row[(l % 4) * 2] | (uint32_t(row[(l % 4) * 2 + 1]) << 16);
    }
    emu::warp_sync();
}
// transposed: lane l gets rows 2(l%4), 2(l%4)+1 of column l/4
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    const int w = emu::warp(), l = emu::lane();
    emu::addr[w][l] = p;
    emu::warp_sync();
    for (int i = 0; i < 4; ++i) {
        const uint32_t v0 = static_cast<const uint16_t*>(emu::addr[w][i * 8 + (l % 4) * 2])[l / 4];
        const uint32_t v1 = static_cast<const uint16_t*>(emu::addr[w][i * 8 + (l % 4) * 2 + 1])[l / 4];
        r[i] = v0 | (v1 << 16);
    }
    emu::warp_sync();
}

// A (16 x K) and B (K x 8) gathered from the warp's registers; this lane's 4 results of D (16 x 8):
// rows l/4 and l/4 + 8, columns 2(l%4) and 2(l%4) + 1.
template <class AFn, class BFn>
inline void mma_generic(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], int K, AFn A, BFn B) {
    const int w = emu::warp(), l = emu::lane();
    memcpy(emu::a_regs[w][l], a, 16);
    memcpy(emu::b_regs[w][l], b, 8);
    emu::warp_sync();
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >= 2), col = 2 * t + (i % 2);
        float s = 0;
        for (int k = 0; k < K; ++k) s += A(w, row, k) * B(w, k, col);
        d[i] += s;
    }
    emu::warp_sync();
}
// bf16 m16n8k16: a0 (g, 2t..) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..); b0 k 2t.., b1 k 2t+8.., n g
inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    auto A = [](int w, int row, int k) {
        const uint32_t reg = emu::a_regs[w][(row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
        return emu::bf16((reg >> (16 * (k % 2))) & 0xffff);
    };
    auto B = [](int w, int k, int n) {
        const uint32_t reg = emu::b_regs[w][n * 4 + (k % 8) / 2][k >= 8];
        return emu::bf16((reg >> (16 * (k % 2))) & 0xffff);
    };
    mma_generic(d, a, b, 16, A, B);
}
// e4m3 m16n8k32: a0 (g, 4t..) a1 (g+8, 4t..) a2 (g, 4t+16..) a3 (g+8, 4t+16..); b0 k 4t.., b1 k 4t+16.., n g
inline void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    auto A = [](int w, int row, int k) {
        const uint32_t reg = emu::a_regs[w][(row % 8) * 4 + (k % 16) / 4][(row >= 8) + 2 * (k >= 16)];
        return emu::e4m3((reg >> (8 * (k % 4))) & 0xff);
    };
    auto B = [](int w, int k, int n) {
        const uint32_t reg = emu::b_regs[w][n * 4 + (k % 16) / 4][k >= 16];
        return emu::e4m3((reg >> (8 * (k % 4))) & 0xff);
    };
    mma_generic(d, a, b, 32, A, B);
}
}  // namespace kiln_ptx
