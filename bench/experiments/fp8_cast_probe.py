"""Experiment: does kiln.kernels.fp8_cast write both layouts right on this GPU, for every input dtype and shape
FP8 training gives it?

    python bench/experiments/fp8_cast_probe.py          # CUDA GPU, ~10 s; prints one line a case, exit 1 on a mismatch

At 866b723 three of the twelve GPU tests of the dual cast and the FP8 training path failed on the H200
(the tensorwise recipe's GEMMs against the emulation and float64), while the cast's own tests cast bf16
tensors only. The training path also casts float32 tensors (the master weights; x and W in the tests),
and FP8 stores at transposed addresses have miscompiled in Triton (triton-lang/triton#11111). Per case:
whether q and qt equal the reference's bytes, how many bytes of qt differ, whether two calls agree (bytes
left unwritten in torch.empty's memory differ between calls).
"""

from __future__ import annotations

import sys

import torch

from kiln.kernels.fp8_cast import E4M3, E5M2, FP8_MAX, cast_dual_ref, cast_dual_triton

CASES = [((4096, 768), torch.float32), ((2048, 768), torch.float32), ((768, 4096), torch.float32),
         ((4096, 2048), torch.bfloat16), ((2816, 2048), torch.float32), ((16384, 5632), torch.bfloat16)]  # fmt: skip


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    ok = True
    for dtype in (E4M3, E5M2):
        for shape, src in CASES:
            t = torch.randn(*shape, device="cuda", generator=g).to(src)
            s = (t.float().abs().amax() / FP8_MAX[dtype]).reshape(())
            q, qt = cast_dual_triton(t, s, dtype)
            q2, qt2 = cast_dual_triton(t, s, dtype)
            rq, rqt = cast_dual_ref(t, s, dtype)
            bad = int((qt.view(torch.uint8) != rqt.view(torch.uint8)).sum())
            row = dict(dtype=str(dtype).split(".")[-1], shape=shape, src=str(src).split(".")[-1], q=same(q, rq),
                       qt=same(qt, rqt), bad_qt_bytes=bad, repeatable=same(q, q2) and same(qt, qt2))  # fmt: skip
            ok &= row["q"] and row["qt"] and row["repeatable"]
            print(row, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
