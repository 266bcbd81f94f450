"""Decode MoE kernels (kernels/moe_decode.py), both forms ("pairs" and the deduped "experts"), against
float64: the pair-by-pair reference and, as an outside oracle, the model's eager per-expert loop
(kiln.model.moe.Experts.forward); odd shapes (one expert, every token or half the tokens on one expert, an
expert twice in one token, ragged d and I, int64 ids, fp16, more tokens than one pass holds); errors; the
custom op; bf16 and a CUDA graph on the GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_decode import (
    DecodeTiles,
    add_shared_slots,
    by_expert_grid,
    expert_rows,
    moe_decode,
    moe_decode_fwd,
    moe_decode_op,
    moe_decode_ref,
    preload_down,
    shared_mlp_as_experts,
    stack_shared_experts,
    use_decode,
)
from kiln.model.moe import Experts

from ._tolerance import assert_close


def _case(T, k, E, d, I, seed=0, same_expert=False, device="cpu", dtype=torch.float32, idx_dtype=torch.int32):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, generator=g, device=device).to(dtype)
    w1 = (torch.randn(E, 2 * I, d, generator=g, device=device) / d**0.5).to(dtype)
    w2 = (torch.randn(E, d, I, generator=g, device=device) / I**0.5).to(dtype)
    if same_expert:  # every token's first slot on expert E - 1, the rest distinct
        idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
        idx[:, 0] = E - 1
        idx[:, 1:] = torch.where(idx[:, 1:] == E - 1, 0, idx[:, 1:])
    else:
        idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g, device=device), -1)
    return x, idx.to(idx_dtype), wts, w1, w2


def _loop(x, idx, wts, w1, w2):
    """The model's eager loop, float64."""
    ex = SimpleNamespace(gate_up_proj=w1.double(), down_proj=w2.double())
    with use_backend("reference"):  # torch ops only (its SwiGLU too), also on the GPU
        return Experts.forward(ex, x.double(), idx.long(), wts.double())


@pytest.mark.parametrize(
    "T, k, E, d, I",
    [(1, 1, 1, 16, 8), (1, 2, 8, 40, 24), (3, 2, 8, 33, 20), (2, 3, 7, 50, 37), (4, 1, 4, 24, 9)],
    ids=["E1", "mixtral-like", "ragged", "k3-odd", "k1"],
)
def test_moe_decode_matches_loop(T, k, E, d, I):
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, seed=T * 10 + k)
    with use_backend("triton"):
        got = moe_decode(x, idx, wts, w1, w2)
    want = _loop(x, idx, wts, w1, w2)
    # float32 vs float64: the reference rounds gate and up to float32 as the kernel does (a few ulps)
    assert_close(got, want)
    # the float64 reference against the loop, whose combine multiplies in float32 (y.float() * w)
    assert_close(moe_decode_ref(x.double(), idx, wts.double(), w1.double(), w2.double()), want, torch.float32)


def test_moe_decode_one_expert_holds_all_tokens_and_int64_ids():
    # every token's first slot on the last expert (pairs sharing an expert), ids as int64, T > E / k
    x, idx, wts, w1, w2 = _case(5, 2, 6, 20, 12, seed=3, same_expert=True, idx_dtype=torch.int64)
    with use_backend("triton"):
        got = moe_decode(x, idx, wts, w1, w2)
    assert_close(got, _loop(x, idx, wts, w1, w2))


def test_moe_decode_tiles_and_fp16():
    # explicit tiles: several column tiles with a ragged last one, several K steps, a 2-stage loop
    x, idx, wts, w1, w2 = _case(2, 2, 5, 37, 19, seed=4)
    tiles = (DecodeTiles(8, 16, 1, 2), DecodeTiles(4, 8, 1, 1))
    with use_backend("triton"):
        got = moe_decode_fwd(x, idx, wts, w1, w2, config=tiles)
    assert_close(got, _loop(x, idx, wts, w1, w2))
    x16, w116, w216 = x.half(), w1.half(), w2.half()
    with use_backend("triton"):
        got16 = moe_decode(x16, idx, wts, w116, w216)
    assert_close(got16, moe_decode_ref(x16, idx, wts, w116, w216).double())
    # against the float64 loop on the fp16 inputs: gate, up and h are rounded to fp16 on the way (three
    # roundings of products of unit scale), so twice the table's single-rounding fp16 bound
    assert_close(got16, _loop(x16, idx, wts, w116, w216), torch.float16, scale=2.0)


def test_moe_decode_empty_and_errors():
    x, idx, wts, w1, w2 = _case(1, 2, 4, 16, 8)
    with use_backend("triton"):
        assert moe_decode(x[:0], idx[:0], wts[:0], w1, w2).shape == (0, 16)
        with pytest.raises(RuntimeError, match="forward only"):
            moe_decode(x.requires_grad_(), idx, wts, w1, w2)
    x = x.detach()
    with pytest.raises(ValueError, match=r"w1 must be \(E, 2I, d\)"):
        moe_decode_ref(x, idx, wts, w1, w2[:, :, :5])
    with pytest.raises(ValueError, match=r"both be \(T, k\)"):
        moe_decode_ref(x, idx, wts[:, :1], w1, w2)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe_decode_ref(x, idx.float(), wts, w1, w2)
    # measured on the H200: the decode kernels up to 64 tokens, past T*k > E too (the experts form)
    assert use_decode(1) and use_decode(64) and not use_decode(65) and not use_decode(0)


def test_moe_decode_opcheck():
    x, idx, wts, w1, w2 = _case(2, 2, 4, 16, 8, seed=5)
    with use_backend("triton"):
        for form in ("auto", "experts"):
            torch.library.opcheck(
                moe_decode_op, (x, idx, wts, w1, w2, form), test_utils=("test_schema", "test_faketensor")
            )


# ------------------------------------------------------------------------------------ the experts form
def _routed(T, k, E, d, I, seed, hot):
    """A case whose routing puts `hot` of the T tokens' first slot on expert E - 1 (the rest distinct)."""
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, seed=seed)
    for t in range(hot):
        row = idx[t]
        row[row == E - 1] = row[0]  # keep the token's k experts distinct
        row[0] = E - 1
    return x, idx, wts, w1, w2


@pytest.mark.parametrize(
    "T, k, E, d, I, hot",
    [(3, 1, 1, 20, 9, 3), (1, 4, 8, 21, 18, 0), (2, 2, 8, 17, 24, 0), (4, 2, 4, 40, 21, 2), (5, 3, 7, 24, 18, 5),
     (4, 4, 8, 18, 11, 4)],
    ids=["E1-all-on-one", "T1-k4", "distinct", "half-on-one", "all-on-one-k3", "all-on-one-k4"],
)  # fmt: skip
def test_moe_decode_forms_match_loop(T, k, E, d, I, hot):
    # d and I are not multiples of the tiles (16 columns / 16-wide K steps for tl.dot, 4 / 16 for the
    # FMAs); T = 1 takes the experts form's one-row kernels (the pairs form's up, a per-pair down), T > 1
    # its deduped tl.dot kernels (float32, IEEE, interpreted); then the fixed-order combine
    x, idx, wts, w1, w2 = _routed(T, k, E, d, I, seed=T * 7 + k, hot=hot)
    want = _loop(x, idx, wts, w1, w2)
    with use_backend("triton"):
        got = {form: moe_decode(x, idx, wts, w1, w2, form=form) for form in ("pairs", "experts")}
        for out in got.values():
            assert_close(out, want)
        # the default ("auto") is the experts form at every batch
        assert torch.equal(moe_decode(x, idx, wts, w1, w2), got["experts"])


def test_moe_decode_experts_expert_twice_in_a_token_and_passes():
    # a token listing one expert twice (no top-k router does, the math allows it): the leader makes one
    # pass per occurrence; rows=1 at T = 3 takes the one-row kernels (per pair); rows=16 at T = 17 makes
    # two tl.dot passes over the hot expert (tokens 0-15, then 16)
    x, idx, wts, w1, w2 = _case(3, 3, 5, 20, 12, seed=6, idx_dtype=torch.int64)
    idx[0] = torch.tensor([2, 4, 2])
    idx[2, 1] = 2
    want = _loop(x, idx, wts, w1, w2)
    with use_backend("triton"):
        assert_close(moe_decode_fwd(x, idx, wts, w1, w2, form="experts"), want)
        assert_close(moe_decode_fwd(x, idx, wts, w1, w2, form="experts", rows=1), want)
        assert_close(moe_decode_fwd(x, idx, wts, w1, w2, form="pairs"), want)
    x, idx, wts, w1, w2 = _routed(17, 1, 2, 16, 16, seed=7, hot=12)
    with use_backend("triton"):
        got = moe_decode_fwd(x, idx, wts, w1, w2, form="experts", rows=16)
    assert_close(got, _loop(x, idx, wts, w1, w2))


@pytest.mark.parametrize("T, k, E, hot", [(5, 3, 4, 5), (3, 2, 8, 2), (6, 2, 3, 0)])
def test_moe_decode_experts_grid_by_expert_or_slot(T, k, E, hot):
    # one program row per expert (its default where E < T*k) or per slot (non-leaders return): the same
    # passes in the same order, so the same bits; both the float64 loop's sums, an unused expert included
    x, idx, wts, w1, w2 = _routed(T, k, E, 19, 13, seed=T + E, hot=hot)
    assert idx.unique().numel() < E or T * k > E  # E = 8: experts no token holds (rows with nothing to do)
    with use_backend("triton"):
        got = {g: moe_decode_fwd(x, idx, wts, w1, w2, form="experts", by_expert=g) for g in (True, False)}
        auto = moe_decode_fwd(x, idx, wts, w1, w2, form="experts")
    assert torch.equal(got[True], got[False])
    assert torch.equal(auto, got[by_expert_grid(T * k, E)])
    assert_close(got[True], _loop(x, idx, wts, w1, w2))
    assert by_expert_grid(17 * 8, 128) and not by_expert_grid(16 * 8, 128) and by_expert_grid(5 * 2, 8)


@pytest.mark.parametrize("I", [24, 37])
def test_moe_decode_one_row_down_preload(I):
    # one token, the experts form: the down kernel reading its whole weight slice before the wait (I not a
    # power of two: the slice is masked) or walking it in K steps; both the float64 loop's sums
    x, idx, wts, w1, w2 = _case(1, 3, 7, 40, I, seed=I)
    want = _loop(x, idx, wts, w1, w2)
    with use_backend("triton"):
        for preload in (True, False):
            assert_close(moe_decode_fwd(x, idx, wts, w1, w2, form="experts", preload=preload), want)
    assert preload_down(2048) and not preload_down(2049)  # where the slice fits a program's registers


def test_moe_decode_experts_tiles_fp16_and_determinism():
    # explicit tiles: a ragged 16-column tile over d = 37 and I = 19, several 16-wide K steps, 2 stages
    x, idx, wts, w1, w2 = _routed(3, 2, 5, 37, 19, seed=8, hot=2)
    tiles = (DecodeTiles(16, 16, 1, 2), DecodeTiles(32, 16, 1, 1))
    with use_backend("triton"):
        got = moe_decode_fwd(x, idx, wts, w1, w2, config=tiles, form="experts")
        again = moe_decode_fwd(x, idx, wts, w1, w2, config=tiles, form="experts")
    assert_close(got, _loop(x, idx, wts, w1, w2))
    assert torch.equal(got, again)  # fixed order, no atomics
    x16, w116, w216 = x.half(), w1.half(), w2.half()
    with use_backend("triton"):
        got16 = moe_decode(x16, idx, wts, w116, w216, form="experts")
    assert_close(got16, moe_decode_ref(x16, idx, wts, w116, w216).double())
    # as in test_moe_decode_tiles_and_fp16: gate, up and h rounded to fp16 on the way, twice the bound
    assert_close(got16, _loop(x16, idx, wts, w116, w216), torch.float16, scale=2.0)


@pytest.mark.parametrize("form", ["pairs", "experts"])
@pytest.mark.parametrize("T, n_groups, gated", [(1, 2, False), (3, 1, True), (2, 3, False)])
def test_moe_decode_shared_experts_fused_as_slots(T, n_groups, gated, form):
    """A shared SwiGLU MLP of n_groups * I features, split into experts of I and run as more slots of the
    routed kernels, equals the routed experts plus the MLP computed on its own (float64), with a weight of
    1 (DeepSeek) or a per-token gate (Qwen2-MoE's sigmoid gate)."""
    k, E, d, I = 2, 6, 24, 10
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, seed=7 + T)
    g = torch.Generator().manual_seed(T)
    F = n_groups * I
    s_gate_up = torch.randn(2 * F, d, generator=g) / d**0.5
    s_down = torch.randn(d, F, generator=g) / F**0.5
    gate = torch.sigmoid(torch.randn(T, 1, generator=g)) if gated else None
    s1, s2 = shared_mlp_as_experts(s_gate_up, s_down, I)
    assert s1.shape == (n_groups, 2 * I, d) and s2.shape == (n_groups, d, I)
    W1, W2 = stack_shared_experts(w1, w2, s1, s2)
    ids, ws = add_shared_slots(idx, wts, E, n_groups, None if gate is None else gate.expand(T, n_groups))
    assert ids.shape == (T, k + n_groups) and (ids[:, k:] == torch.arange(E, E + n_groups)).all()
    with use_backend("triton"):
        got = moe_decode_fwd(x, ids, ws, W1, W2, form=form)
    h = s_gate_up.double() @ x.double().T  # (2F, T)
    shared = (torch.nn.functional.silu(h[:F]) * h[F:]).T @ s_down.double().T
    want = _loop(x, idx, wts, w1, w2) + (shared if gate is None else gate.double() * shared)
    assert_close(got, want)
    with pytest.raises(ValueError, match="multiple of the routed experts' 10 features"):
        shared_mlp_as_experts(s_gate_up[:-2], s_down[:, :-1], I)
    with pytest.raises(ValueError, match="must have the routed experts' shapes"):
        stack_shared_experts(w1, w2, s1[:, :-2], s2)


def test_moe_decode_forms_errors_and_rules():
    x, idx, wts, w1, w2 = _case(2, 2, 4, 16, 8)
    with use_backend("triton"):
        with pytest.raises(ValueError, match="form must be one of"):
            moe_decode(x, idx, wts, w1, w2, form="tokens")
        with pytest.raises(ValueError, match="rows must be 1, or a power of two >= 16"):
            moe_decode_fwd(x, idx, wts, w1, w2, form="experts", rows=8)
        with pytest.raises(ValueError, match="rows and by_expert apply to form='experts' only"):
            moe_decode_fwd(x, idx, wts, w1, w2, form="pairs", rows=16)
        with pytest.raises(ValueError, match="tl.dot tiles need block_n and block_k >= 16"):
            moe_decode_fwd(
                x, idx, wts, w1, w2, form="experts", rows=16, config=(DecodeTiles(4, 16, 1, 1),) * 2
            )
    # the default (measured on the H200): one row a pass up to 2 tokens, then 16-64 rows
    assert expert_rows(1, torch.bfloat16) == 1 and expert_rows(2, torch.bfloat16) == 1
    assert expert_rows(3, torch.bfloat16) == 16
    assert expert_rows(40, torch.float16) == 64 and expert_rows(200, torch.float32) == 64
    assert expert_rows(4, torch.float64) == 1  # no tl.dot in float64: FMAs, one token per pass


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["pairs", "experts"])
@pytest.mark.parametrize(
    "T, k, E, d, I",
    [(1, 2, 8, 4096, 14336), (4, 2, 8, 4096, 14336), (1, 8, 128, 2048, 768), (16, 8, 128, 2048, 768),
     (3, 6, 64, 2048, 1408), (12, 2, 8, 4096, 14336), (2, 6, 64, 2048, 1408), (64, 8, 128, 2048, 768)],
)  # fmt: skip
def test_moe_decode_gpu_bf16_and_graph(T, k, E, d, I, form):
    # every token's first slot on the last expert: pairs sharing an expert, which the experts form dedupes
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, device="cuda", dtype=torch.bfloat16, same_expert=True)
    with torch.no_grad():
        got = moe_decode(x, idx, wts, w1, w2, form=form)
        # bf16 inputs against the float64 loop on every token (its float64 matmuls on the GPU): gate, up and
        # h are rounded to bf16 on the way (as the grouped path rounds them), within the bf16 table
        assert_close(got, _loop(x, idx, wts, w1, w2), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # no host sync inside
            out = moe_decode(x, idx, wts, w1, w2, form=form)
        x.copy_(torch.randn_like(x))
        idx.copy_(idx.flip(0))
        graph.replay()
        assert torch.equal(
            out, moe_decode(x, idx, wts, w1, w2, form=form)
        )  # fixed order: bitwise deterministic


# the experts form compiled for the H200 (sm_90) on the CPU machine, in a subprocess without the
# interpreter (as tests/kernels/test_moe_sm90.py does for the pairs form): Qwen3-like bf16 at batch 16
# (tl.dot, 16 rows per pass) and batch 1 (the per-pair down kernel), at the launcher's tiles
SM90_SCRIPT = r"""
import json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import moe_decode as md

def ptx(fn, ptrs, consts, t, nodiv=()):
    names = [p.name for p in fn.params]
    consts = dict(consts, BLOCK_N=t.block_n, BLOCK_K=t.block_k, STAGES=t.stages, PDL=True)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    div = [n for n in names if n not in consts and n not in nodiv]  # as a real launch specializes them
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    p = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=t.warps, num_stages=t.stages)).asm["ptx"]
    return {f: p.count(f) for f in ("mma.sync", "wgmma.mma_async", "cp.async.cg", "griddepcontrol.wait")}

k, d, I, T = 8, 2048, 768, 16
rows = md.expert_rows(T, torch.bfloat16)
meta = dict(TOPK=k, TOPK_P2=8, T_P2=16, ROWS=rows, BY_EXPERT=False, PRECISION="ieee")
out = {
    "up": ptx(md._up_experts_kernel, dict(X_ptr="*bf16", Idx_ptr="*i32", W_ptr="*bf16", H_ptr="*bf16"),
              dict(meta, stride_xc=1, stride_wc=1), md.expert_tiles(d, rows), ("T",)),
    "down": ptx(md._down_experts_kernel,
                dict(H_ptr="*bf16", Idx_ptr="*i32", Wt_ptr="*fp32", W_ptr="*bf16", P_ptr="*fp32"),
                dict(meta, stride_wi=1), md.expert_tiles(I, rows), ("T",)),
    "down_pair": ptx(md._down_pair_kernel,
                     dict(H_ptr="*bf16", Idx_ptr="*i32", Wt_ptr="*fp32", W_ptr="*bf16", P_ptr="*fp32"),
                     dict(stride_wi=1, PRELOAD=False, I_P2=1024), md.expert_tiles(I, 1)),
    "down_pair_preload": ptx(md._down_pair_kernel,
                             dict(H_ptr="*bf16", Idx_ptr="*i32", Wt_ptr="*fp32", W_ptr="*bf16", P_ptr="*fp32"),
                             dict(stride_wi=1, PRELOAD=True, I_P2=1024), md.expert_tiles(I, 1)),
}
names = [p.name for p in md._combine_kernel.params]
consts = dict(TOPK=k, BLOCK=256, PDL=True)
src = ASTSource(fn=md._combine_kernel, signature={n: "constexpr" if n in consts else {"P_ptr": "*fp32", "Y_ptr": "*bf16"}.get(n, "i32") for n in names},
                constexprs={(names.index(a),): v for a, v in consts.items()})
out["combine"] = {"griddepcontrol.wait": triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2)).asm["ptx"].count("griddepcontrol.wait")}
print(json.dumps(out))
"""


@pytest.mark.slow  # 4 compiles: ~10 s
def test_moe_decode_experts_form_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    # the deduped kernels on the tensor cores (64-column W tiles: wgmma, one warpgroup's M) fed by 16-byte
    # cp.async loads through the pipeline; the per-pair down kernel's FMA loop on cp.async loads too
    for kern in ("up", "down"):
        assert res[kern]["wgmma.mma_async"] + res[kern]["mma.sync"] > 0 and res[kern]["cp.async.cg"] > 0, res
    tc = res["down_pair"]["mma.sync"] + res["down_pair"]["wgmma.mma_async"]
    assert tc == 0 and res["down_pair"]["cp.async.cg"] > 0, res
    # the preloading form: plain 16-byte loads (nothing to pipeline), the wait after them
    assert res["down_pair_preload"]["griddepcontrol.wait"] > 0, res
    # launched with programmatic dependent launch on sm_90: each waits for its predecessor in its prologue
    assert all(r["griddepcontrol.wait"] > 0 for r in res.values()), res
