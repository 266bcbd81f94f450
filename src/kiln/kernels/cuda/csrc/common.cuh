// Helpers shared by the .cu files: launch-error reporting and integer ceil division.
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace kiln {

// NULL when the last launch succeeded, else CUDA's message for the error (a static string).
inline const char* launch_status() {
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Streaming multiprocessors of the current device (grid sizes for grid-stride loops).
inline int sm_count() {
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms > 0 ? sms : 1;
}

}  // namespace kiln
