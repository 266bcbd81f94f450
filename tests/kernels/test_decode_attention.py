"""Paged KV write and split-KV decode attention against references on the gathered cache (float64).

Block tables are random permutations of the page pool, so a sequence's pages are scattered and out of
order; lengths start at 1 and cross page and split boundaries.
"""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import decode_attention as dec
from kiln.kernels.attention import attention_ref
from kiln.kernels.decode_attention import FORMS, decode_attention, decode_attention_ref, gather_kv
from kiln.kernels.dispatch import use_backend
from kiln.kernels.launch import cdiv
from kiln.kernels.paged_kv import paged_kv_write, paged_kv_write_ref, slot_mapping

from ._tolerance import assert_close


def _paged(lens, Hq, Hk, D, page, dtype, device, seed=0, spare=3):
    """A shuffled page pool holding random K/V, a block table into it, and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    max_blocks = max(-(-n // page) for n in lens)
    pool = B * max_blocks + spare
    table = torch.randperm(pool, generator=g)[: B * max_blocks].view(B, max_blocks).to(device, torch.int32)
    k_cache = torch.randn(pool, page, Hk, D, generator=g).to(device, dtype)
    v_cache = torch.randn(pool, page, Hk, D, generator=g).to(device, dtype)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32, device=device)


def _ref64(q, k_cache, v_cache, table, seq_lens, **kw):
    kw = {a: (b.cpu().double() if torch.is_tensor(b) else b) for a, b in kw.items()}
    return decode_attention_ref(
        q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), table.cpu(), seq_lens.cpu(), **kw
    )


@pytest.mark.parametrize(
    "lens,Hq,Hk,page",
    [
        ([1], 2, 2, 16),
        ([1, 2, 15, 16, 17, 100], 4, 2, 16),  # GQA 2, lengths around the page size
        ([300, 5, 129], 8, 2, 16),  # GQA 4
        ([257, 64], 8, 1, 8),  # MQA (GQA 8), small pages
        ([200, 33], 16, 2, 32),  # GQA 8
    ],
)
def test_decode_matches_gathered_reference(lens, Hq, Hk, page, device):
    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, 16, page, torch.float32, device)
    with use_backend("triton"):
        got = decode_attention(q, kc, vc, table, seq_lens)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,sinks", [(None, True), (50, False), (50, True)])
def test_decode_splits_window_sinks(num_splits, window, sinks, device):
    q, kc, vc, table, seq_lens = _paged([400, 1, 60, 333], 8, 2, 16, 16, torch.float32, device, seed=1)
    s = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(device) if sinks else None
    with use_backend("triton"):
        got = decode_attention(q, kc, vc, table, seq_lens, window=window, sinks=s, num_splits=num_splits)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens, window=window, sinks=s))


def test_decode_fp16_hd64(device):
    q, kc, vc, table, seq_lens = _paged([1, 90, 200], 8, 2, 64, 16, torch.float16, device, seed=3)
    with use_backend("triton"):
        got = decode_attention(q, kc, vc, table, seq_lens, softmax_scale=0.2)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.2))


def test_reference_gathers_like_dense_attention(device):
    # The gathered reference itself agrees with prefill attention's last row on a dense copy.
    q, kc, vc, table, seq_lens = _paged([37], 4, 2, 16, 8, torch.float64, device, seed=4)
    k = gather_kv(kc, table, 0, 37)[None]
    v = gather_kv(vc, table, 0, 37)[None]
    dense = attention_ref(q[:, None], k, v, causal=False)[:, 0]
    assert_close(decode_attention_ref(q, kc, vc, table, seq_lens), dense)


def test_paged_write_matches_reference(device):
    q, kc, vc, table, seq_lens = _paged([40, 7, 100], 4, 2, 16, 16, torch.float16, device, seed=5)
    g = torch.Generator().manual_seed(6)
    seq_ids = torch.tensor([0, 1, 2, 2, 0, 1], device=device)
    positions = torch.tensor([3, 6, 99, 0, 39, 0], device=device)
    slots = slot_mapping(table, seq_ids, positions, kc.shape[1])
    slots[5] = -1  # padding: skipped
    k = torch.randn(6, 2, 16, generator=g).to(device, torch.float16)
    v = torch.randn(6, 2, 16, generator=g).to(device, torch.float16)
    want_k, want_v = kc.clone(), vc.clone()
    paged_kv_write_ref(want_k, want_v, k, v, slots)
    with use_backend("triton"):
        paged_kv_write(kc, vc, k, v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(gather_kv(kc, table, 2, 100)[99], k[2])


def test_write_then_decode_equals_prefill(device):
    # Fill an empty paged cache token by token from dense K/V, then decode: equals dense attention.
    g = torch.Generator().manual_seed(7)
    B, T, Hq, Hk, D, page = 2, 45, 4, 2, 16, 8
    k = torch.randn(B, T, Hk, D, generator=g).to(device)
    v = torch.randn(B, T, Hk, D, generator=g).to(device)
    q = torch.randn(B, Hq, D, generator=g).to(device)
    blocks = -(-T // page)
    table = torch.randperm(B * blocks, generator=g).view(B, blocks).to(device, torch.int32)
    kc = torch.zeros(B * blocks, page, Hk, D, device=device)
    vc = torch.zeros_like(kc)
    seq_ids = torch.arange(B, device=device).repeat_interleave(T)
    positions = torch.arange(T, device=device).repeat(B)
    with use_backend("triton"):
        paged_kv_write(
            kc, vc, k.reshape(-1, Hk, D), v.reshape(-1, Hk, D), slot_mapping(table, seq_ids, positions, page)
        )
        got = decode_attention(q, kc, vc, table, torch.full((B,), T, dtype=torch.int32, device=device))
    want = attention_ref(q[:, None].double(), k.double(), v.double(), causal=True)[:, 0]
    assert_close(got, want)


def test_bad_inputs(device):
    q, kc, vc, table, seq_lens = _paged([5, 9], 4, 2, 16, 8, torch.float32, device)
    with pytest.raises(TypeError, match="int32"):
        decode_attention(q, kc, vc, table.long(), seq_lens)
    with pytest.raises(ValueError, match="block_table"):
        decode_attention(q, kc, vc, table[:1], seq_lens)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(q[:, :3], kc, vc, table, seq_lens)
    with pytest.raises(ValueError, match=r"\(N, Hk, D\)"):
        paged_kv_write(
            kc,
            vc,
            torch.zeros(2, 3, 16, device=device),
            torch.zeros(2, 3, 16, device=device),
            torch.zeros(2, dtype=torch.int64, device=device),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "lens,Hq,Hk,D,page", [([1, 4096, 77, 1000], 32, 4, 128, 16), ([40000], 16, 2, 128, 64)]
)
def test_gpu_bf16_decode(lens, Hq, Hk, D, page, form):
    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, page, torch.bfloat16, "cuda", seed=8)
    got = decode_attention(q, kc, vc, table, seq_lens, form=form)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens))


@pytest.mark.parametrize(
    "config",
    [
        dict(BLOCK_N=32, num_warps=4, num_stages=1),
        dict(BLOCK_N=16, num_warps=4, num_stages=1, per_sm=1, align=16),
        dict(BLOCK_N=64, num_warps=4, num_stages=1, per_sm=2, align=16),
    ],
    ids=["explicit", "page-aligned-1-per-sm", "page-aligned-wide-tiles"],
)
def test_decode_sweep_configs(config, device):
    # The variants bench/sweep_attention.py measures: explicit tile configs, split chunks aligned to
    # pages only (so a split's last tile is ragged), tiles wider than a chunk.
    from kiln.kernels.decode_attention import decode_attention_triton

    q, kc, vc, table, seq_lens = _paged([400, 1, 60, 333], 8, 2, 16, 16, torch.float32, device, seed=9)
    got = decode_attention_triton(q, kc, vc, table, seq_lens, 0.25, None, None, None, config)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.25))


def _wide(lens, Hq, Hk, D, page, width, dtype, device, seed):
    """_paged with a block table `width` pages wide (the capacity a graph captures), most of it unused."""
    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, page, dtype, device, seed=seed, spare=0)
    pad = torch.zeros(len(lens), width - table.shape[1], dtype=torch.int32, device=device)
    return q, kc, vc, torch.cat([table, pad], dim=1), seq_lens


@pytest.mark.parametrize(
    "num_splits,window,sinks,form",
    [(None, None, False, "two_pass"), (1, None, True, "two_pass"), (1, 40, True, "two_pass"),
     (7, None, True, "two_pass"), (7, 40, False, "two_pass"), (24, None, False, "two_pass"),
     (None, None, True, "one_pass"), (7, 40, True, "one_pass")],
)  # fmt: skip
def test_decode_live_chunks_on_a_wide_table(num_splits, window, sinks, form, device):
    # A table 64 pages wide (1024 keys of capacity) holding 0-300 live keys: each sequence's splits share
    # its live keys (chunk from seq_lens on the device), more splits than tiles leave some empty, one
    # split writes the output itself (no reduction), and a sequence with no keys gives 0 (or 0 with sinks).
    q, kc, vc, table, seq_lens = _wide([300, 1, 0, 17, 129], 6, 2, 16, 16, 64, torch.float32, device, 10)
    s = torch.randn(6, generator=torch.Generator().manual_seed(11)).to(device) if sinks else None
    with use_backend("triton"):
        got = decode_attention(
            q, kc, vc, table, seq_lens, window=window, sinks=s, num_splits=num_splits, form=form
        )
    assert_close(got, _ref64(q, kc, vc, table, seq_lens, window=window, sinks=s))
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    _assert_counters_zero(device)


def test_split_plan(monkeypatch):
    # The fixed plan (module doc): about one program an SM (num_splits_for) in PRELOAD's 64-key tiles with
    # int32 offsets; KILN_DECODE_PRELOAD=off gives the plan before it (~4 programs an SM, 32-key tiles, the
    # table read per tile; A/B timing of whole steps); a bad value is an error.
    try:
        monkeypatch.delenv("KILN_DECODE_PRELOAD", raising=False)
        dec._preload_switch.cache_clear()
        cfg = dict(BLOCK_N=64, num_warps=4, num_stages=3, ADDR32=True, TMA=False, PRELOAD=True)
        assert dec.split_plan(1, 2, 4096, 132) == (32, cfg)  # at most one split per 128 keys
        assert dec.split_plan(1, 2, 32768, 132) == (66, cfg)
        assert dec.split_plan(8, 2, 4096, 132) == (cdiv(132, 16), cfg)
        assert dec.split_plan(64, 2, 100, 132) == (1, cfg)  # one chunk of capacity
        monkeypatch.setenv("KILN_DECODE_PRELOAD", "off")
        dec._preload_switch.cache_clear()
        cfg = dict(BLOCK_N=32, num_warps=4, num_stages=3, ADDR32=True, TMA=False, PRELOAD=False)
        assert dec.split_plan(1, 2, 4096, 132) == (32, cfg)
        assert dec.split_plan(64, 2, 4096, 132) == (5, cfg)
        monkeypatch.setenv("KILN_DECODE_PRELOAD", "yes")
        dec._preload_switch.cache_clear()
        with pytest.raises(ValueError, match="KILN_DECODE_PRELOAD must be"):
            dec.split_plan(8, 2, 4096, 132)
    finally:
        monkeypatch.undo()
        dec._preload_switch.cache_clear()


def test_chunk_align_from_the_environment(monkeypatch):
    # KILN_DECODE_ALIGN (A/B timing of whole steps) sets the keys of capacity a split stands for: at 64, a
    # batch-1 split of a 1280-key table is one 64-key tile (20 splits, each its early tile), at 128 two
    try:
        monkeypatch.delenv("KILN_DECODE_ALIGN", raising=False)
        dec.chunk_align.cache_clear()
        assert dec.chunk_align() == dec.CHUNK_ALIGN == 128
        assert dec.split_plan(1, 2, 1280, 132, dec.chunk_align())[0] == 10
        monkeypatch.setenv("KILN_DECODE_ALIGN", "64")
        dec.chunk_align.cache_clear()
        assert dec.split_plan(1, 2, 1280, 132, dec.chunk_align())[0] == 20
        monkeypatch.setenv("KILN_DECODE_ALIGN", "100")
        dec.chunk_align.cache_clear()
        with pytest.raises(ValueError, match="KILN_DECODE_ALIGN must be"):
            dec.chunk_align()
    finally:
        monkeypatch.undo()
        dec.chunk_align.cache_clear()


def test_decode_default_launch_does_not_specialize_on_capacity(monkeypatch):
    # The engine's warm-up compiles decode attention once per split count on a one-page table; a served step
    # with a wider table must reuse those kernels, so the launch passes one MAX_PAGES value whatever the
    # table (PRELOAD, the default, loads fixed windows of page indices).
    seen = []
    kernel = dec._decode_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["MAX_PAGES"])
                return kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(dec, "_decode_split_kernel", Spy())
    for width in (1, 8, 64):
        q, kc, vc, table, seq_lens = _wide([5, 9], 4, 2, 16, 16, width, torch.float32, "cpu", seed=80)
        with use_backend("triton"):
            decode_attention(q, kc, vc, table, seq_lens, num_splits=2)
    assert seen == [dec.PRELOAD_PAGES] * 3


def test_decode_split_count_follows_the_gpu_and_capacity():
    from kiln.kernels.decode_attention import num_splits_for

    assert num_splits_for(1, 2, 4096, 132) == 32  # 4096 / 128 keys caps the 264 the SMs would take
    assert num_splits_for(64, 2, 65536, 132) == 5  # cdiv(4 x 132, 128 programs)
    assert num_splits_for(512, 2, 65536, 132) == 1  # B x Hk fills the GPU: one kernel, no reduction
    assert num_splits_for(1, 8, 100, 132) == 1  # one chunk of capacity
    assert num_splits_for(1, 1, 1 << 20, 132) == 128  # MAX_SPLITS


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("B,L,width", [(64, 300, 256), (1, 450, 256), (300, 200, 64)])
def test_gpu_bf16_decode_live_chunks(B, L, width, form):
    # Qwen2.5-1.5B heads (12 / 2 x 128), short live contexts in a wide table; (300, ...) takes one split.
    lens = [1 + (L * (i + 1)) // B for i in range(B)]
    q, kc, vc, table, seq_lens = _wide(lens, 12, 2, 128, 16, width, torch.bfloat16, "cuda", 12)
    got = decode_attention(q, kc, vc, table, seq_lens, form=form)
    assert_close(got, _ref64(q, kc, vc, table, seq_lens))
    _assert_counters_zero("cuda")


# ------------------------------------------------------------------------------ one launch (form="one_pass")
def _assert_counters_zero(device):
    """Every one-pass counter buffer on `device` is back at zero (each launch zeroes what it counted)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    for buf in dec._COUNTERS.get((device.type, device.index), []):
        assert int(buf.count_nonzero()) == 0, "a one-pass launch left a split counter non-zero"


@pytest.mark.parametrize(
    "lens,Hq,Hk,D,num_splits,window,sinks",
    [
        ([33], 2, 2, 16, 3, None, True),  # B=1, GQA 1: a tile + 1 (BLOCK_N 32 here) over 2 of 3 splits
        ([1, 32, 300], 4, 2, 16, 5, None, False),  # GQA 2: 1 key, exactly one tile, 5 full splits
        (
            [5, 0, 129],
            12,
            2,
            16,
            7,
            None,
            True,
        ),  # GQA 6: shorter than the split count (empty splits), no keys
        ([200, 7, 64], 6, 1, 16, 4, 50, True),  # GQA 6 over one KV head, a window
        ([1500, 3], 16, 1, 64, 24, None, True),  # 24 live splits combined 8 a step (combine_step(16, 64))
    ],
    ids=["B1-gqa1-sinks", "B3-gqa2", "B3-gqa6-empty-splits-sinks", "B3-gqa6-window", "B2-gqa16-three-steps"],
)
def test_decode_one_pass_equals_two_pass_and_reference(lens, Hq, Hk, D, num_splits, window, sinks, device):
    # The last split program to arrive reduces (in the interpreter programs run in grid order, so an empty
    # split is the last to arrive for a short sequence, a live one for a long one); its counters end at 0.
    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, 16, torch.float32, device, seed=20)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(21)).to(device) if sinks else None
    kw = dict(window=window, sinks=s, num_splits=num_splits)
    with use_backend("triton"):
        one = decode_attention(q, kc, vc, table, seq_lens, form="one_pass", **kw)
        _assert_counters_zero(device)
        again = decode_attention(q, kc, vc, table, seq_lens, form="one_pass", **kw)
        two = decode_attention(q, kc, vc, table, seq_lens, form="two_pass", **kw)
    want = _ref64(q, kc, vc, table, seq_lens, window=window, sinks=s)
    assert_close(one, want, name="one_pass")
    assert_close(two, want, name="two_pass")
    assert torch.equal(one, again)  # the combine reads partials in a fixed order: bitwise repeatable
    _assert_counters_zero(device)


def test_one_pass_counters_shared_across_shapes(device):
    # Consecutive one-pass calls of different (B, Hk) on one device share the counter buffer; each leaves it
    # zero for the next. A request for more counters than the buffer holds gets a larger one, and the old one
    # stays referenced (a CUDA graph may have captured its address).
    cases = [([40, 3, 90], 4, 2, 3), ([17], 6, 1, 2), ([1, 65], 2, 2, 4)]
    with use_backend("triton"):
        for i, (lens, Hq, Hk, splits) in enumerate(cases):
            q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, 16, 8, torch.float32, device, seed=30 + i)
            got = decode_attention(q, kc, vc, table, seq_lens, num_splits=splits, form="one_pass")
            assert_close(got, _ref64(q, kc, vc, table, seq_lens), name=str(lens))
            _assert_counters_zero(device)
    first = dec.split_counters(torch.device(device), 3)
    bigger = dec.split_counters(torch.device(device), first.numel() + 1)
    assert bigger.numel() > first.numel() and dec.split_counters(torch.device(device), 5) is bigger
    assert any(b is first for b in dec._COUNTERS[(first.device.type, first.device.index)])


def test_decode_form_is_checked(device):
    q, kc, vc, table, seq_lens = _paged([5, 9], 4, 2, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="form must be one of"):
        decode_attention(q, kc, vc, table, seq_lens, form="fused")


def test_decode_default_form_from_the_environment(monkeypatch, device):
    # KILN_DECODE_FORM picks the form of calls that name none (the model's): a one-pass call is the one
    # that takes counters, so a fresh counter cache shows which form ran. A bad value is an error naming it.
    q, kc, vc, table, seq_lens = _paged([40, 3], 4, 2, 16, 8, torch.float32, device, seed=50)
    monkeypatch.setattr(dec, "_COUNTERS", {})
    try:
        monkeypatch.setenv("KILN_DECODE_FORM", "one_pass")
        dec.default_form.cache_clear()
        with use_backend("triton"):
            got = decode_attention(q, kc, vc, table, seq_lens, num_splits=3)
        assert dec._COUNTERS, "KILN_DECODE_FORM=one_pass did not run the one-pass form"
        assert_close(got, _ref64(q, kc, vc, table, seq_lens))
        _assert_counters_zero(device)
        monkeypatch.setenv("KILN_DECODE_FORM", "fused")
        dec.default_form.cache_clear()
        with use_backend("triton"), pytest.raises(ValueError, match="KILN_DECODE_FORM must be one of"):
            decode_attention(q, kc, vc, table, seq_lens, num_splits=3)
    finally:
        monkeypatch.undo()
        dec.default_form.cache_clear()  # the next call reads the restored environment


@pytest.mark.gpu
def test_gpu_one_pass_in_a_cuda_graph():
    """The one-pass form as a decode engine runs it: called once eagerly (autotuning, counters), captured in
    a CUDA graph, replayed with new lengths written into the same buffers; every replay matches the
    reference, is bitwise equal to the eager call on the same inputs, and leaves the counters at zero."""
    lens = [1, 1100, 63, 700]  # Qwen2.5-1.5B heads (12 / 2 x 128) in a table 4096 tokens wide
    q, kc, vc, table, seq_lens = _wide(lens, 12, 2, 128, 16, 256, torch.bfloat16, "cuda", 40)
    with use_backend("triton"):
        eager = decode_attention(q, kc, vc, table, seq_lens, form="one_pass")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_attention(q, kc, vc, table, seq_lens, form="one_pass")
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        _assert_counters_zero("cuda")
    assert_close(out, _ref64(q, kc, vc, table, seq_lens))
    seq_lens.copy_(torch.tensor([900, 2, 1024, 64], dtype=torch.int32))  # the next step's lengths
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, _ref64(q, kc, vc, table, seq_lens))
    _assert_counters_zero("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_one_pass_is_deterministic(B):
    # On the GPU the splits of a (sequence, KV head) arrive in a different order from call to call; the
    # combine reads them in split order, so every call gives the same bits.
    lens = [1 + (1100 * (i + 1)) // B for i in range(B)]
    q, kc, vc, table, seq_lens = _wide(lens, 12, 2, 128, 16, 256, torch.bfloat16, "cuda", 41)
    first = decode_attention(q, kc, vc, table, seq_lens, form="one_pass")
    for _ in range(20):
        assert torch.equal(decode_attention(q, kc, vc, table, seq_lens, form="one_pass"), first)
    assert_close(first, _ref64(q, kc, vc, table, seq_lens))


@pytest.mark.gpu
def test_gpu_one_pass_capture_without_warm_up_is_an_error(monkeypatch):
    # No counter buffer yet (a fresh cache): a capture cannot allocate and zero one, so it says so.
    monkeypatch.setattr(dec, "_COUNTERS", {})
    q, kc, vc, table, seq_lens = _wide([300, 20], 12, 2, 128, 16, 64, torch.bfloat16, "cuda", 42)
    decode_attention(q, kc, vc, table, seq_lens, form="two_pass")  # autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="run the same call once before capturing"):
        with torch.cuda.graph(graph):
            decode_attention(q, kc, vc, table, seq_lens, form="one_pass")


# ------------------------------------------------------------------------ int32 K/V offsets (ADDR32 configs)
@pytest.mark.parametrize(
    "lens,Hq,Hk,D,page,block_n,splits,window,sinks,form",
    [
        ([1, 47, 130], 3, 3, 16, 8, 32, 3, None, False, "two_pass"),  # group 1, tiles over 4 pages of 8
        ([200, 9], 8, 1, 32, 16, 16, 5, 60, True, "one_pass"),  # group 8 on one KV head, a window, sinks
        ([75], 6, 2, 64, 32, 64, 1, None, True, "two_pass"),  # group 3, page 32 < tile 64, one split
    ],
    ids=["gqa1-page8", "gqa8-window-one-pass", "gqa3-D64-single"],
)
def test_decode_addr32_and_preload_are_bitwise_the_int64_form(
    lens, Hq, Hk, D, page, block_n, splits, window, sinks, form, device
):
    # The ADDR32 configs only move the K/V address math to int32 offsets: same loads, same math, same bits.
    # Where the offsets do not fit (FITS32 False, faked here: a real cache that large does not fit a test),
    # an ADDR32 config compiles the int64 form.
    from kiln.kernels.decode_attention import decode_attention_triton

    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, page, torch.float32, device, seed=60)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(61)).to(device) if sinks else None
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1)
    args = (q, kc, vc, table, seq_lens, 0.3, window, s, splits)
    old = decode_attention_triton(*args, dict(cfg, ADDR32=False), form=form)
    new = decode_attention_triton(*args, dict(cfg, ADDR32=True), form=form)
    assert torch.equal(new, old)
    # PRELOAD: the chunk's page indices loaded once before the loop (gathered per tile): the same pages,
    # loads and math, so the same bits, with either addressing (the window starts chunks inside a page)
    for addr32 in (False, True):
        pre = decode_attention_triton(*args, dict(cfg, ADDR32=addr32, PRELOAD=True), form=form)
        assert torch.equal(pre, old)
    assert_close(new, _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.3, window=window, sinks=s))
    _assert_counters_zero(device)


@pytest.mark.parametrize(
    "lens,page,block_n,splits,window",
    [([200, 47], 8, 32, 1, None), ([300, 90], 16, 16, 2, 170)],
    ids=["page8-one-split", "page16-window"],
)
def test_decode_preload_windows_are_bitwise_the_plain_loop(
    lens, page, block_n, splits, window, monkeypatch, device
):
    # A chunk longer than one PRELOAD window (made small here: 96 and 48 keys) is walked window by window,
    # each window's page indices loaded before its tiles: the tiles, masks and sums are the plain loop's.
    from kiln.kernels.decode_attention import decode_attention_triton

    monkeypatch.setattr(dec, "PRELOAD_PAGES", 4)
    q, kc, vc, table, seq_lens = _paged(lens, 4, 2, 16, page, torch.float32, device, seed=62)
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1, ADDR32=True)
    args = (q, kc, vc, table, seq_lens, 0.3, window, None, splits)
    assert (dec.preload_pages(block_n, page) - 1) * page < max(lens) // splits  # several windows a chunk
    old = decode_attention_triton(*args, dict(cfg, PRELOAD=False))
    pre = decode_attention_triton(*args, dict(cfg, PRELOAD=True))
    assert torch.equal(pre, old)
    assert_close(pre, _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.3, window=window))


def test_decode_addr32_guard(monkeypatch, device):
    # offsets_fit_int32 is shape/stride arithmetic (meta tensors: no memory): the largest element offset of a
    # cache must be below 2^31. Where it is not, an ADDR32 config (split_plan's, or an explicit one) runs
    # the int64 form (FITS32 False reaches the kernel).
    fits = dec.offsets_fit_int32
    pages = 2**31 // (16 * 2 * 128)  # offsets up to 2^31 - 1 exactly
    assert fits(torch.empty(pages, 16, 2, 128, device="meta"))
    big = torch.empty(pages + 1, 16, 2, 128, device="meta")
    assert not fits(big) and not fits(torch.empty(4, 16, 2, 128, device="meta"), big)  # every cache counts
    assert not fits(big[:, :, :1])  # a view: its strides count, not its size
    seen = []
    monkeypatch.setattr(dec, "offsets_fit_int32", lambda *c: seen.append(len(c)) or False)
    q, kc, vc, table, seq_lens = _paged([70, 3], 4, 2, 16, 8, torch.float32, device, seed=62)
    got = dec.decode_attention_triton(q, kc, vc, table, seq_lens, 0.25, None, None, 2,
                                      dict(BLOCK_N=32, num_warps=4, num_stages=1, ADDR32=True))  # fmt: skip
    assert seen == [2]
    assert_close(got, _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.25))


# --------------------------------------------------------------------- TMA configs: a page a tile, by descriptor
def _dead_rows_nan(kc, vc, table, seq_lens, page):
    """NaN in every cache row no sequence holds (the rest of a last page, the spare pages): what a reused
    page may hold. The pointer forms never load those rows; the TMA form loads whole pages and must zero
    them before they meet p = 0."""
    live = torch.zeros(kc.shape[0] * page, dtype=torch.bool, device=kc.device)
    for b, n in enumerate(seq_lens.tolist()):
        t = torch.arange(n, device=kc.device)
        live[table[b, t // page].long() * page + t % page] = True
    dead = ~live.view(kc.shape[0], page)
    kc[dead], vc[dead] = float("nan"), float("nan")


@pytest.mark.parametrize(
    "lens,Hq,Hk,D,page,block_n,splits,window,sinks,form",
    [
        ([1, 47, 130, 16], 3, 3, 16, 8, 8, 3, None, False, "two_pass"),  # group 1, a tile a page
        ([200, 9], 8, 1, 32, 16, 16, 5, 37, True, "one_pass"),  # a window: chunks start inside a page
        ([75, 300], 6, 2, 64, 32, 64, 1, None, True, "two_pass"),  # chunks of 2 pages, one split
        ([150, 33], 4, 2, 16, 16, 8, 4, None, False, "two_pass"),  # chunks of half a page
    ],
    ids=["gqa1-page8", "window-one-pass", "chunk2pages-single", "chunk-half-page"],
)
def test_decode_tma_pages_match_the_reference(
    lens, Hq, Hk, D, page, block_n, splits, window, sinks, form, device
):
    # The TMA configs load one page of one KV head a tile through a tensor descriptor over the cache's rows;
    # a split's keys may start or end inside a page (a window, chunks not a whole page), and the rows of a
    # page past the live keys hold NaN here (zeroed before the second dot, as a masked load would).
    from kiln.kernels.decode_attention import decode_attention_triton

    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, page, torch.float32, device, seed=70)
    want = _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.3, window=window,
                  sinks=torch.randn(Hq, generator=torch.Generator().manual_seed(71)) if sinks else None)  # fmt: skip
    _dead_rows_nan(kc, vc, table, seq_lens, page)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(71)).to(device) if sinks else None
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1, TMA=True)
    got = decode_attention_triton(q, kc, vc, table, seq_lens, 0.3, window, s, splits, cfg, form=form)
    assert not got.isnan().any()
    assert_close(got, want)
    _assert_counters_zero(device)


def test_decode_tma_guard():
    ok = dec.tma_pages_ok
    cache = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16, device="meta")
    assert ok(cache) and ok(cache[:, :, 1:])  # one head of the cache: its rows are still a page apart
    assert not ok(cache[::2])  # pages not adjacent: a page's rows are not at page x page-size rows
    assert not ok(torch.empty(10, 12, 2, 128, device="meta"))  # a page size that is no TMA box
    assert not ok(torch.empty(10, 16, 2, 128, device="meta").transpose(2, 3))  # D not contiguous


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [dict(BLOCK_N=16, num_stages=4, TMA=True), dict(BLOCK_N=16, num_stages=6, TMA=True),
     dict(BLOCK_N=32, num_stages=4, ADDR32=True, PRELOAD=True), dict(BLOCK_N=64, num_stages=4, PRELOAD=True)],
    ids=["tma-4", "tma-6", "preload-32-addr32", "preload-64"],
)  # fmt: skip
def test_gpu_bf16_decode_configs_in_a_cuda_graph(cfg):
    # The engine's launch: Qwen2.5-1.5B heads, page 16, a table 4096 wide, 64 sequences of 1-1100 keys, dead
    # rows NaN; eager and replayed from a CUDA graph (TMA: the descriptors' scratch comes from the graph's
    # pool; PRELOAD: the chunk's pages gathered from registers, K/V buffered 3 deep).
    from kiln.kernels.decode_attention import decode_attention_triton, num_splits_for

    lens = [1 + (i * 37) % 1100 for i in range(64)]
    q, kc, vc, table, seq_lens = _wide(lens, 12, 2, 128, 16, 256, torch.bfloat16, "cuda", seed=72)
    want = _ref64(q, kc, vc, table, seq_lens)
    _dead_rows_nan(kc, vc, table, seq_lens, 16)
    assert dec.tma_pages_ok(kc)
    splits = num_splits_for(64, 2, 4096, dec.sm_count(q.device))
    cfg = dict(cfg, num_warps=4)
    call = lambda: decode_attention_triton(q, kc, vc, table, seq_lens, 128**-0.5, None, None, splits, cfg)  # noqa: E731
    eager = call()
    assert_close(eager, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


# ---------------------------------------------------------------- EARLY: the first tile before the PDL wait
@pytest.mark.parametrize(
    "lens,Hq,Hk,D,page,block_n,splits,window,sinks,form,preload",
    [
        ([1, 47, 130, 64, 65], 4, 2, 16, 8, 32, 3, None, False, "two_pass", True),  # tiles over 4 pages
        ([200, 9, 1], 8, 1, 32, 16, 16, 5, 60, True, "one_pass", True),  # window, sinks, empty splits
        ([75, 16], 6, 2, 64, 32, 64, 1, None, True, "two_pass", False),  # one split, per-tile table loads
        ([300, 33], 4, 4, 16, 16, 16, 2, 170, False, "two_pass", False),  # several tiles a chunk
    ],
    ids=["preload-2pass", "preload-1pass-window", "single-table", "window-tiles"],
)
def test_decode_early_first_tile_is_bitwise_the_loop(
    lens, Hq, Hk, D, page, block_n, splits, window, sinks, form, preload, device
):
    # EARLY loads each chunk's first tile (all keys but the newest) before the programmatic-launch wait and
    # the newest key's row after it, then folds the tile in as the loop's first: the same tiles, masks
    # and sums in the same order, so the same bits as the loop alone.
    from kiln.kernels.decode_attention import decode_attention_triton

    q, kc, vc, table, seq_lens = _paged(lens, Hq, Hk, D, page, torch.float32, device, seed=63)
    s = torch.randn(Hq, generator=torch.Generator().manual_seed(64)).to(device) if sinks else None
    cfg = dict(BLOCK_N=block_n, num_warps=4, num_stages=1, ADDR32=True, PRELOAD=preload)
    args = (q, kc, vc, table, seq_lens, 0.3, window, s, splits)
    # explicit: the launcher's rule takes EARLY only where every chunk is one tile; the kernel takes any
    got = {e: decode_attention_triton(*args, dict(cfg, EARLY=e), form=form) for e in (False, True)}
    assert torch.equal(got[True], got[False])
    assert_close(got[True], _ref64(q, kc, vc, table, seq_lens, softmax_scale=0.3, window=window, sinks=s))
    _assert_counters_zero(device)


def test_decode_early_rule(monkeypatch):
    # EARLY where the split count follows the capacity (chunks of at most CHUNK_ALIGN = 128 keys: the early
    # tile and one more), off where chunks are longer or the switch is off; the launch is caught before it
    # runs (no kernel: CPU tensors, no interpreter needed)
    from kiln.kernels.decode_attention import decode_attention_triton

    seen = []

    class Caught(Exception):
        pass

    def run(*args, grid, warmup, **kw):
        seen.append((grid[2], kw["EARLY"]))
        raise Caught

    monkeypatch.setattr(dec._decode_split_kernel, "run", run, raising=False)
    monkeypatch.setattr(dec, "sm_count", lambda device: 132)
    # batch 1, 2 KV heads, pages of 64: 132 pages (8448 keys) are 66 splits of 128 keys, the most that one
    # program an SM gives; 133 pages still get 66 splits, of up to 192 keys
    for width, switch in ((20, True), (132, True), (133, True), (20, False)):
        monkeypatch.setattr(dec, "early_loads", lambda s=switch: s)
        q, kc, vc, table, lens = _wide([100], 12, 2, 16, 64, width, torch.float32, "cpu", seed=65)
        with pytest.raises(Caught):
            decode_attention_triton(q, kc, vc, table, lens, 0.25, None, None, None)
    assert seen == [(10, True), (66, True), (66, False), (10, False)]


def test_decode_early_switch_from_the_environment(monkeypatch):
    from kiln.kernels._common import early_loads

    for value, want in (("", True), ("on", True), ("off", False)):
        early_loads.cache_clear()
        monkeypatch.setenv("KILN_DECODE_EARLY", value)
        assert early_loads() is want
    early_loads.cache_clear()
    monkeypatch.setenv("KILN_DECODE_EARLY", "maybe")
    with pytest.raises(ValueError, match="KILN_DECODE_EARLY"):
        early_loads()
    early_loads.cache_clear()


def test_pdl_first_switch_from_the_environment(monkeypatch):
    from kiln.kernels._common import PDL_FIRST_KERNELS, _pdl_first_set, pdl_first

    for value, want in (("", {"norm", "reduce", "qkv"}), ("none", set()), ("reduce", {"reduce"}),
                        ("norm:split", {"norm", "split"}), ("all", set(PDL_FIRST_KERNELS))):  # fmt: skip
        _pdl_first_set.cache_clear()
        monkeypatch.setenv("KILN_PDL_FIRST", value)
        assert {k for k in PDL_FIRST_KERNELS if pdl_first(k)} == want
    _pdl_first_set.cache_clear()
    monkeypatch.setenv("KILN_PDL_FIRST", "norm,gemv")
    with pytest.raises(ValueError, match="KILN_PDL_FIRST.*gemv"):
        pdl_first("norm")
    _pdl_first_set.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
def test_gpu_early_reads_the_newest_key_after_its_writer(form):
    # The engine's order: the RoPE + K/V write kernel (launched with PDL) writes each sequence's newest key,
    # then decode attention, whose split programs load every older key before their programmatic-launch
    # wait. The newest rows hold NaN before each replay: were one read before its writer finished, the
    # output would be NaN. Qwen2.5-1.5B heads, 16 sequences of 1-1100 keys, 20 replays of one graph.
    from kiln.kernels.rope import rope_kv_write

    lens = [1 + (i * 71) % 1100 for i in range(16)]
    q, kc, vc, table, seq_lens = _wide(lens, 12, 2, 128, 16, 128, torch.bfloat16, "cuda", seed=73)
    g = torch.Generator().manual_seed(74)
    k_new = torch.randn(16, 2, 128, generator=g).to("cuda", torch.bfloat16)
    v_new = torch.randn(16, 2, 128, generator=g).to("cuda", torch.bfloat16)
    pos = seq_lens.long() - 1
    slots = table.gather(1, (pos // 16)[:, None])[:, 0].long() * 16 + pos % 16
    cos = torch.ones(1100, 64, device="cuda", dtype=torch.bfloat16)  # the identity rotation: k as written
    sin = torch.zeros(1100, 64, device="cuda", dtype=torch.bfloat16)
    kc_want, vc_want = kc.clone(), vc.clone()
    kc_want.view(-1, 2, 128)[slots], vc_want.view(-1, 2, 128)[slots] = k_new, v_new
    want = _ref64(q, kc_want, vc_want, table, seq_lens)

    def stale():
        kc.view(-1, 2, 128)[slots] = float("nan")
        vc.view(-1, 2, 128)[slots] = float("nan")

    call = lambda: decode_attention(  # noqa: E731
        rope_kv_write(q, k_new, v_new, cos, sin, pos, kc, vc, slots), kc, vc, table, seq_lens, form=form
    )
    stale()
    assert_close(call(), want)
    stale()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(20):
        stale()
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert_close(out, want)
