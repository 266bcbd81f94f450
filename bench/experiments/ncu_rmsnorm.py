"""One-off H200 experiment: kiln's and Liger's RMSNorm forward kernels (32768 x 4096 bf16) under Nsight
Compute, for the last 1% between them (each launched twice; profile the launches with ncu, e.g.

    ncu --clock-control none -k regex:"rmsnorm_fwd|rms_norm_forward" -c 4 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --csv --page details \\
        python3 bench/experiments/ncu_rmsnorm.py
"""

import sys

import torch

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels.rmsnorm import rmsnorm  # noqa: E402

mk = kn.Inputs("cuda", False)
x, w = mk.randn(32768, 4096), mk.randn(4096, scale=0.1) + 1
with torch.no_grad():
    for _ in range(2):
        rmsnorm(x, w, 1e-6)
        kn.LigerRMSNormFunction.apply(x, w, 1e-6)
torch.cuda.synchronize()
