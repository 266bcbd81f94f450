// Host stand-in for <cuda_runtime.h>: the emulated kernels need nothing from it.
