"""Experiment: where decode attention's time goes at batch 1, from timer stamps inside the kernels.

    python bench/experiments/decode_attn_timeline.py      # H200, ~1 min; $OUT/attn_probe.json

The fused q/k/v kernel (each program's start, its wait's return and its end), decode attention's split kernel
(start, its wait's return, the first tile folded in, the loop done, the partials stored) and its reduction
(start, wait, end) are compiled from their own source with %globaltimer stamps added (the source is edited as
text: an assert fails if a kernel no longer has the line a stamp goes after), and patched into the modules
before a random-init Qwen2.5-1.5B engine (bf16, CUDA graphs, 1k-token context) captures its batch-1 step.
One replay fills the stamps; per layer, every time is relative to the q/k/v kernel's last program's end,
and the medians over layers 2-26 are printed. The stamps (an atomic a program for its record slot, stores)
lengthen the step (1.27 against 1.13 ms a replay at b3a8e10): read the phases' order and sizes, not their
sum."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import statistics
import tempfile

import torch

from kiln.kernels import decode_attention as da
from kiln.kernels import rope
from kiln.kernels.launch import CachedLaunch

N_REC = 1 << 16  # record slots a kernel kind
LAYERS = 28
STAMP = """
@triton.jit
def _now(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False,
                                     pack=1)

@triton.jit
def _slot(KIND: tl.constexpr):
    c = tl.full([], {CA}, tl.int64).to(tl.pointer_type(tl.int32))
    return tl.atomic_add(c + KIND, 1)

@triton.jit
def _put(KIND: tl.constexpr, slot, k, v):
    r = tl.full([], {RA}, tl.int64).to(tl.pointer_type(tl.int64))
    tl.store(r + KIND * {NR} * 8 + slot.to(tl.int64) * 8 + k, v.to(tl.int64))
"""
# (kind 0) split: 3 start, 4 wait returned, 5 first tile folded in, 6 loop done, 7 partials stored
SPLIT_EDITS = [
    (
        "    hk = tl.program_id(1)\n",
        "    hk = tl.program_id(1)\n    _s = _slot(0)\n    _put(0, _s, 3, _now(hk))\n",
    ),
    (
        "        start = lo + BLOCK_N\n        pdl_prologue(PDL, FIRST)\n",
        "        start = lo + BLOCK_N\n        pdl_prologue(PDL, FIRST)\n        _put(0, _s, 4, _now(hk))\n",
    ),
    (
        "        m_i, l_i, acc = _online_tile(q, k0, v0, t0_ok, m_i, l_i, acc, qk_scale)\n",
        "        m_i, l_i, acc = _online_tile(q, k0, v0, t0_ok, m_i, l_i, acc, qk_scale)\n"
        "        _put(0, _s, 5, _now(tl.sum(l_i)))\n",
    ),
    ("    if SINGLE:  # o = acc", "    _put(0, _s, 6, _now(tl.sum(l_i)))\n    if SINGLE:  # o = acc"),
    (
        "        tl.store(LSE_PART + b64 * stride_lb + h * stride_lh + split, lse, mask=live)\n",
        "        tl.store(LSE_PART + b64 * stride_lb + h * stride_lh + split, lse, mask=live)\n"
        "        tl.debug_barrier()\n        _put(0, _s, 7, _now(hk))\n",
    ),
]
# (kind 1) reduction: 3 start, 4 wait returned, 7 stored
REDUCE_EDITS = [
    (
        "    pdl_prologue(PDL, FIRST)\n",
        "    _s = _slot(1)\n    _put(1, _s, 3, _now(_s))\n    pdl_prologue(PDL, FIRST)\n    _put(1, _s, 4, _now(_s))\n",
    ),
    (
        "    tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))\n",
        "    tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))\n"
        "    tl.debug_barrier()\n    _put(1, _s, 7, _now(_s))\n",
    ),
]
# (kind 2) fused q/k/v: 3 start, 4 wait returned, 7 stored
QKV_EDITS = [
    (
        "    pid = tl.program_id(0)\n",
        "    pid = tl.program_id(0)\n    _s = _slot(2)\n    _put(2, _s, 3, _now(pid))\n",
    ),
    (
        "    pdl_prologue(PDL, FIRST)\n    if not EARLY:",
        "    pdl_prologue(PDL, FIRST)\n    _put(2, _s, 4, _now(pid))\n    if not EARLY:",
    ),
]


def stamped(fn, edits, kind: str, stamp: str):
    """fn (a @triton.jit function) recompiled from its source with `edits` applied and the stamp helpers
    beside it, in a module that sees fn's module's names."""
    src = inspect.getsource(fn.fn)
    for old, new in edits:
        assert old in src, f"{kind}: the kernel no longer has {old!r}"
        src = src.replace(old, new, 1)
    path = os.path.join(tempfile.mkdtemp(), f"stamped_{kind}.py")
    with open(path, "w") as f:
        f.write(
            f"import triton\nimport triton.language as tl\nimport {fn.fn.__module__} as _m\n"
            "globals().update({k: v for k, v in vars(_m).items() if not k.startswith('__')})\n" + stamp + src
        )
    spec = importlib.util.spec_from_file_location(f"stamped_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, fn.fn.__name__)


def main() -> None:
    cnt = torch.zeros(8, dtype=torch.int32, device="cuda")
    rec = torch.zeros(3, N_REC, 8, dtype=torch.int64, device="cuda")
    stamp = STAMP.format(CA=cnt.data_ptr(), RA=rec.data_ptr(), NR=N_REC)
    src_q = inspect.getsource(rope._qkv_rope_kernel.fn).rstrip().splitlines()[-1] + "\n"
    qkv_edits = QKV_EDITS + [(src_q, src_q + "    tl.debug_barrier()\n    _put(2, _s, 7, _now(pid))\n")]
    da._decode_split_kernel = stamped(da._decode_split_kernel, SPLIT_EDITS, "split", stamp)
    da._decode_reduce_kernel = stamped(da._decode_reduce_kernel, REDUCE_EDITS, "reduce", stamp)
    rope._qkv_rope_launch = CachedLaunch(stamped(rope._qkv_rope_kernel, qkv_edits, "qkv", stamp))

    from kiln.infer import bench
    from kiln.infer.engine import LLM
    from kiln.model.transformer import build_model

    cfg = bench.qwen2_1p5b_config(max_seq_len=1024 + 256)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    llm = LLM(model, device="cuda", dtype="bf16", block_size=16, num_blocks=200, max_num_seqs=1, max_graph_batch=1,
              max_num_batched_tokens=8192, decode_backend="graphs", enable_prefix_caching=False)  # fmt: skip
    llm.engine.async_scheduling = True
    print("tok/s", bench.steady_decode(llm.engine, 1, 1024, 8, 32, seed=0)["tok_s"])
    B, ms = bench.graph_replay_ms(llm.engine, 1, 20)
    print("replay ms", ms)
    torch.cuda.synchronize()
    cnt.zero_()
    rec.zero_()
    llm.engine.runner.graphs.graphs[B].replay()
    torch.cuda.synchronize()
    counts, R = cnt.tolist(), rec.cpu()

    def launches(kind):  # the records of each of the step's LAYERS launches, in slot order
        per = counts[kind] // LAYERS
        return [R[kind, i * per : (i + 1) * per] for i in range(LAYERS)]

    qk, sp, rd = launches(2), launches(0), launches(1)
    rows = []
    for i in range(LAYERS):
        t0 = int(qk[i][:, 7].max())  # the q/k/v kernel's last program's end
        s, r = sp[i], rd[i]
        rows.append(dict(
            layer=i, qkv_first_start=int(qk[i][:, 3].min()) - t0, qkv_wait_max=int(qk[i][:, 4].max()) - t0,
            split_first_start=int(s[:, 3].min()) - t0, split_wait_min=int(s[:, 4].min()) - t0,
            split_wait_max=int(s[:, 4].max()) - t0, split_tile1_max=int(s[:, 5].max()) - t0,
            split_loop_max=int(s[:, 6].max()) - t0, split_end_max=int(s[:, 7].max()) - t0,
            reduce_start_min=int(r[:, 3].min()) - t0, reduce_wait_min=int(r[:, 4].min()) - t0,
            reduce_wait_max=int(r[:, 4].max()) - t0, reduce_end_max=int(r[:, 7].max()) - t0,
        ))  # fmt: skip
    keys = [k for k in rows[0] if k != "layer"]
    med = {k: statistics.median(r[k] for r in rows[2:-1]) / 1000 for k in keys}
    print(
        "programs a launch: q/k/v",
        counts[2] // LAYERS,
        "split",
        counts[0] // LAYERS,
        "reduce",
        counts[1] // LAYERS,
    )
    for k in keys:
        print(f"{k:20s} {med[k]:8.2f} us")
    out = os.path.join(os.environ.get("OUT", "/tmp"), "attn_probe.json")
    with open(out, "w") as f:
        json.dump(dict(rows=rows, median_us=med, replay_ms=ms), f, indent=1)


if __name__ == "__main__":
    main()
