"""The CUDA C++ ladder on one GPU: vector add, memory probes, the SGEMM ladder and the tensor-core GEMMs
(mma.sync at every tile configuration; on Hopper, last, the wgmma + TMA GEMMs in bf16 and FP8, each
configuration in a child process so that one that faults or hangs is recorded and skipped), each against
its torch/cuBLAS peer (the measurement is kiln.profile.cuda_ladder; `kiln bench cuda` runs the same code).

    python bench/cuda_ladder.py      # H200: under 3 minutes with a cold build -> bench/results/cuda_ladder.json
                                     # and bench/results/cuda_ladder/*.png
    python bench/cuda_ladder.py --replot bench/results/cuda_ladder.json   # the PNGs again, from the JSON (CPU)

There is no --smoke: the kernels are CUDA C++ and do not run on the CPU. Without a CUDA toolchain the
script says what is missing and exits with status 2 (tests/kernels/cuda tests that path).
"""

from __future__ import annotations

import sys

from kiln.errors import KilnError
from kiln.profile.cuda_ladder import main

if __name__ == "__main__":
    try:
        sys.exit(main(script_file=__file__))
    except KilnError as e:
        print(f"bench/cuda_ladder.py: error: {e}", file=sys.stderr)
        sys.exit(2)
