// Host stand-in for <cuda.h>: the emulated tensor map (what tma_load_2d of hopper_emu.h reads). The real
// CUtensorMap is an opaque 128-byte blob encoded by the driver; here it holds the encode arguments.
#pragma once
#include <cstdint>
struct CUtensorMap {
    const unsigned char* base;  // global address
    uint64_t dims[2];           // innermost first: elements per row, rows
    uint64_t row_bytes;         // the row stride
    uint32_t box[2];            // elements per box row, box rows
    int elem;                   // bytes per element
};
