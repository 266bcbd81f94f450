"""CUDA C++ kernels compiled at first use: the thread/warp/block model, the memory hierarchy measured, a
fp32 matmul taken step by step towards cuBLAS, and tensor-core GEMMs (bf16 mma.sync, FP8 e4m3).

    build.py    the one extension: toolchain check, source-hash cache, torch.utils.cpp_extension.load
    ops.py      vector_add, sgemm (the ladder), mma_bf16, mma_fp8 on torch tensors
    probes.py   strided reads, bank conflicts, pointer-chasing latency, occupancy vs registers
    ladder.py   the SGEMM ladder's steps and what each teaches
    csrc/       the .cu sources (standalone: plain kernels and extern "C" launchers, api.h) and the
                torch binding (binding.cpp)

Nothing is compiled or imported from CUDA at import time; docs/cuda.md is the guide.
"""
