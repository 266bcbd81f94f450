// Host stand-in for <cuda_bf16.h>: the two types and the one conversion the kernels use.
#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
    uint16_t x;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
inline uint16_t emu_f2bf(float f) {  // round to nearest even (no NaN inputs here)
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return u >> 16;
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {{emu_f2bf(a)}, {emu_f2bf(b)}}; }
