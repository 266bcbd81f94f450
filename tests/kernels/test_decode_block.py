"""One token's decoder block in one launch (kiln.kernels.decode_block): against float64 (the separate ops'
references in the model's order) on odd shapes, both RoPE layouts, with and without the q/k/v bias and a
sliding window, contexts that leave splits empty and that give a split several tiles; the K/V write lands
in its slot only; a padding slot writes nothing; the shapes it does not take are refused. On the GPU (bf16, the
Qwen2.5-1.5B shape): the one-launch form (grid barriers) bit-equal to the five-launch form, both against a
float32 reference, repeated launches and a CUDA-graph replay giving the same bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from kiln.kernels.decode_block import block_plan, decode_block, decode_block_ref, decode_block_supported
from kiln.kernels.dispatch import use_backend

from ._sm90 import RESOURCES
from ._tolerance import assert_close

SRC = Path(__file__).resolve().parents[2] / "src"


def _inputs(d, F, Hq, Hk, D, page, n_keys, dtype, device, seed, bias=True, pages=None, slot=None):
    """A block's weights (at init-like scales, so activations stay O(1)), a random cache of `pages` pages
    holding n_keys - 1 keys of one sequence through a shuffled block table, and the token's slot."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(device, dtype)  # noqa: E731
    N = (Hq + 2 * Hk) * D
    w = dict(
        h=r(1, d), norm1=(1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype),
        w_qkv=r(N, d, scale=d**-0.5), b_qkv=r(N, scale=0.1) if bias else None,
        w_o=r(d, Hq * D, scale=(Hq * D) ** -0.5), norm2=(1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype),
        w_gate_up=r(2 * F, d, scale=d**-0.5), w_down=r(d, F, scale=F**-0.5),
    )  # fmt: skip
    ang = torch.rand(n_keys + 3, D // 2, generator=g, dtype=torch.float64) * 6.3
    pages = pages or -(-n_keys // page) + 2
    table = torch.randperm(pages, generator=g)[None].to(device, torch.int32)
    pos = n_keys - 1
    slot = int(table[0, pos // page]) * page + pos % page if slot is None else slot
    cache = dict(
        cos=ang.cos().float().to(device), sin=ang.sin().float().to(device),
        rows=torch.tensor([pos], device=device), k_cache=r(pages, page, Hk, D), v_cache=r(pages, page, Hk, D),
        slots=torch.tensor([slot], device=device), block_table=table,
        seq_lens=torch.tensor([n_keys], device=device, dtype=torch.int32),
    )  # fmt: skip
    return w, cache


def _run(fn, w, cache, Hq, **kw):
    return fn(w["h"], w["norm1"], w["w_qkv"], w["b_qkv"], w["w_o"], w["norm2"], w["w_gate_up"], w["w_down"], 1e-6,
              cache["cos"], cache["sin"], cache["rows"], cache["k_cache"], cache["v_cache"], cache["slots"],
              cache["block_table"], cache["seq_lens"], Hq, **kw)  # fmt: skip


def _float64(w, cache):
    to = lambda t: None if t is None else (t.cpu().double() if t.is_floating_point() else t.cpu())  # noqa: E731
    return {k: to(v) for k, v in w.items()}, {k: to(v) for k, v in cache.items()}


CASES = [  # d, F, Hq, Hk, D, page, n_keys
    (40, 36, 4, 2, 16, 4, 13),  # 5 of 12 programs own no o/down rows; 13 keys over pages of 4
    (72, 100, 3, 1, 8, 8, 150),  # one kv head, several 64-key splits, ragged last tile
    (24, 20, 2, 2, 16, 16, 1),  # the token alone: every split but one empty
    (40, 36, 4, 2, 16, 16, 500),  # 6 splits a kv head over 500 keys: each split strides over several tiles
]


@pytest.mark.parametrize(
    "bias,interleaved,window", [(True, False, None), (False, True, None), (True, False, 7)],
    ids=["bias-half", "nobias-interleaved", "window7"],
)  # fmt: skip
@pytest.mark.parametrize("d,F,Hq,Hk,D,page,n_keys", CASES)
def test_matches_float64(d, F, Hq, Hk, D, page, n_keys, bias, interleaved, window, device):
    w, cache = _inputs(d, F, Hq, Hk, D, page, n_keys, torch.float32, device, d + n_keys, bias)
    w64, cache64 = _float64(w, cache)
    want = _run(decode_block_ref, w64, cache64, Hq, window=window, interleaved=interleaved)
    k_before = cache["k_cache"].clone()
    with use_backend("triton"):
        got = _run(decode_block, w, cache, Hq, window=window, interleaved=interleaved)
    assert got.shape == (1, d) and got.dtype == torch.float32
    assert_close(got, want, name="h_out")
    assert_close(cache["k_cache"], cache64["k_cache"], name="k cache")
    assert_close(cache["v_cache"], cache64["v_cache"], name="v cache")
    slot = int(cache["slots"])
    others = torch.ones(k_before.shape[0] * k_before.shape[1], dtype=torch.bool)
    others[slot] = False
    assert torch.equal(cache["k_cache"].view(-1, Hk, D).cpu()[others], k_before.view(-1, Hk, D).cpu()[others])


def test_padding_slot_writes_nothing(device):
    w, cache = _inputs(40, 36, 4, 2, 16, 4, 9, torch.float32, device, 5, slot=-1)
    k_before, v_before = cache["k_cache"].clone(), cache["v_cache"].clone()
    w64, cache64 = _float64(w, cache)
    want = _run(decode_block_ref, w64, cache64, 4)
    with use_backend("triton"):
        got = _run(decode_block, w, cache, 4)
    assert torch.equal(cache["k_cache"], k_before) and torch.equal(cache["v_cache"], v_before)
    assert_close(got, want, name="h_out")


def test_plan_covers_every_row():
    """Each phase's programs x rows cover its rows, the q/k/v pairs fit the programs, splits <= programs /
    Hk."""
    for d, F, Hq, Hk, D, cap, P in [(1536, 8960, 12, 2, 128, 4096, 132), (4096, 14336, 32, 8, 128, 8192, 132),
                                    (40, 36, 4, 2, 16, 20, 12), (896, 4864, 14, 2, 64, 128, 78)]:  # fmt: skip
        p = block_plan(d, F, Hq, Hk, D, cap, P)
        assert p.rows_o * P >= d and p.rows_d * P >= d and p.feats * P >= F
        assert p.r_o >= p.rows_o and p.r_d >= p.rows_d and p.r_gu >= 2 * p.feats
        assert (Hq + 2 * Hk) * (D // 2) <= p.pairs * P and (D // 2) % p.pairs == 0
        assert 1 <= p.splits <= P // Hk


def test_refuses_what_it_does_not_take(device):
    w, cache = _inputs(40, 36, 4, 2, 16, 4, 9, torch.float32, device, 5)
    h, kc = w["h"], cache["k_cache"]
    args = (w["w_qkv"], w["w_o"], w["w_gate_up"], w["w_down"], kc)
    assert decode_block_supported(h, *args, 4)
    assert not decode_block_supported(h.expand(2, -1), *args, 4)  # two tokens
    assert not decode_block_supported(h, *args, 3)  # q heads that do not match W_qkv / the kv heads
    wt = w["w_o"].t().contiguous().t()
    assert not decode_block_supported(
        h, w["w_qkv"], wt, w["w_gate_up"], w["w_down"], kc, 4
    )  # not K-contiguous
    assert not decode_block_supported(h.double(), *args, 4)  # dtypes differ
    with pytest.raises(ValueError, match="decode_block_supported"):
        _run(decode_block, w, cache, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_keys", [1, 300, 1100])
def test_qwen_shape_bf16_on_gpu(n_keys):
    """Qwen2.5-1.5B's block (d 1536, 12 / 2 heads of 128 with q/k/v bias, FFN 8960), bf16: the one-launch form
    equal bit for bit to the five-launch form (the grid barriers order what the kernel boundaries order),
    both within bf16 rounding of a float32 reference; ten launches in a row and a CUDA-graph replay give
    the same bits (the counters are left zero)."""
    d, F, Hq, Hk, D, page = 1536, 8960, 12, 2, 128, 16
    w, cache = _inputs(d, F, Hq, Hk, D, page, n_keys, torch.bfloat16, "cuda", 0, pages=260)
    c2 = {k: v.clone() for k, v in cache.items()}
    fused = _run(decode_block, w, cache, Hq, phased=False)
    phased = _run(decode_block, w, c2, Hq, phased=True)
    assert torch.equal(fused, phased)
    assert torch.equal(cache["k_cache"], c2["k_cache"]) and torch.equal(cache["v_cache"], c2["v_cache"])
    w32 = {k: None if v is None else v.float() for k, v in w.items()}
    c32 = {k: v.float() if v.is_floating_point() else v for k, v in cache.items()}
    want = _run(decode_block_ref, w32, c32, Hq)
    assert_close(fused, want, name="h_out vs float32")
    for _ in range(10):
        assert torch.equal(_run(decode_block, w, cache, Hq), fused)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _run(decode_block, w, cache, Hq)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused)


SM90_SCRIPT = (
    RESOURCES
    + r"""
import json
import torch
from kiln.kernels import decode_block as db


class Caught(Exception):
    pass


def launch(fn, *args, grid, warmup, **kw):
    raise Caught(args, kw)


# the H200's launch at the Qwen2.5-1.5B shape, caught before it runs: Triton's own specialization of its
# arguments (PER_SM programs an SM of 132, the default tiles, the one-launch form)
db._decode_block_kernel.run = lambda *a, **kw: launch(db._decode_block_kernel, *a, **kw)
db._block_launch.fast = False
db.block_programs = lambda device: db.PER_SM * 132
db.use_triton = lambda *t: True
d, F, Hq, Hk, D, page = 1536, 8960, 12, 2, 128, 16
z = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt)
kc = z(300, page, Hk, D)
try:
    db.decode_block(z(1, d), z(d), z((Hq + 2 * Hk) * D, d), z((Hq + 2 * Hk) * D), z(d, Hq * D), z(d), z(2 * F, d),
                    z(d, F), 1e-6, z(64, D // 2, dt=torch.float32), z(64, D // 2, dt=torch.float32),
                    torch.zeros(1, dtype=torch.long), kc, kc.clone(), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, 256, dtype=torch.int32), torch.ones(1, dtype=torch.int32), Hq, phased=False)
except Caught as e:
    args, kw = e.args
r = resources(db._decode_block_kernel, args, kw)
print(json.dumps(dict(regs=r["regs"], spill=r["spill_stores"], smem=r["smem"], warps=kw["num_warps"],
                      per_sm=db.PER_SM, cooperative=kw["launch_cooperative_grid"],
                      cp_async=r["ptx"].count("cp.async.cg"), acquire=r["ptx"].count(".acquire"))))
"""
)


@pytest.mark.slow  # one compile and ptxas run: ~10 s on the shared 2-core machine
def test_compiles_for_sm90_every_program_resident():
    """Compiled for the H200 on the CPU machine, as its launch at the Qwen2.5-1.5B shape specializes it: no
    spills; registers and shared memory that leave PER_SM programs of WARPS warps an SM resident (the grid
    barriers need every program resident: 65536 registers, 228 KB an SM); the weight loads pipelined
    (cp.async) and the barriers' spins acquire loads; launched cooperatively."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache  # a fresh cache: compile for real, touch nothing shared
        proc = subprocess.run([sys.executable, "-c", SM90_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["spill"] == 0 and r["regs"] * 32 * r["warps"] * r["per_sm"] <= 65536, r
    assert r["smem"] * r["per_sm"] <= 228 * 1024 and r["cooperative"], r
    assert r["cp_async"] > 0 and r["acquire"] > 0, r
