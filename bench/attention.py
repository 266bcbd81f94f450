"""Attention benchmark on the H200: kiln's Triton FlashAttention and paged decode vs SDPA and FlexAttention.

    python bench/attention.py                  # the H200 run (about 110 s) -> bench/results/attention.json
    python bench/attention.py --smoke          # CPU: tiny shapes through the interpreter (seconds)
    python bench/attention.py --table bench/results/attention.json   # the docs/perf/attention.md tables

Prefill/training grid (bf16, batch x seqlen = 16k tokens): seqlen 1k..16k, head dim 64 (32 heads) and
128 (16 heads), causal and not, plus GQA 32q/8kv at head dim 128 causal. Each point measures kiln's
forward and backward and, in the same process, SDPA's cuDNN and flash backends (backward timed alone,
from a retained graph; the three forwards interleaved in rounds, then the three backwards) and, while the time budget lasts, torch.compile'd flex_attention. FLOPs follow
FlashAttention's convention: forward 4 B H Tq Tk D (halved when causal), backward 2.5x the forward.

Decode: one query per sequence over a paged bf16 cache (page 16, shuffled block table), GQA 64q/8kv,
head dim 128, at batch 64 x 4k and batch 1 x 64k context, and Qwen2.5-1.5B's 12q/2kv at 384 and 1100 live
keys (batch 1) and 1100 (batch 64) in block tables 4096 tokens wide (an engine's captured step); the unit
is K/V bytes read per second, against the copy bandwidth measured at the start of the run
(kiln.profile.ceilings), with SDPA on a dense, contiguous copy of the same cache as the peer. Decode is
timed replayed from a CUDA graph (as an engine runs it; a 64 us kernel is otherwise hidden behind
Python's launch cost), with an L2 flush before each replay, twice: do_bench's (zeroing 256 MB, which
leaves the L2 full of dirty lines that are written back during the timed step) and a read-only flush
that leaves it clean (Bench.clean_ms); the eager time is recorded too. Decode's two forms of a multi-split launch (kiln.kernels.decode_attention
`form`: two_pass = split kernel + reduction kernel, one_pass = the last split program reduces) are timed
side by side on every decode row, their graphs replayed interleaved (kiln_two_pass_* / kiln_one_pass_*,
one_pass_speedup* = two_pass time / one_pass time), and on the Qwen rows also as a graph of 28 calls over 28
separate caches, a decode step's worth of layers (kiln_<form>_stack_us_per_call). kiln_* is the default form.
The split kernel's configs (decode_attention.SPLIT_CONFIGS: int64 and int32 addressing, TMA pages) are also
timed one by one, side by side (kiln_split_<config>_TBps; the "decode split configs" table).

Every case is independent: an error is recorded in the JSON for that case and the run continues.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser
from kiln.profile.report import read_json

SEQLENS = (4096, 8192, 16384, 1024, 2048)  # the goal points (>= 4096) first
TOKENS = 16384
TIME_BUDGET_S = 95.0  # no new case after this; the run's share is ~130 s including imports and exit
FLEX_BUDGET_S = 92.0  # no flex compile after this
QWEN_LAYERS = 28  # Qwen2.5-1.5B's depth: decode attention launches per decode step


def parse_args():
    ap = bench_parser("attention", __doc__)
    ap.add_argument(
        "--no-flex", action="store_true", help="skip FlexAttention (its compiles dominate the time)"
    )
    ap.add_argument("--table", metavar="JSON", help="print the Markdown tables of a results file and exit")
    return ap.parse_args()


def prefill_cases(smoke: bool) -> list[dict]:
    """The grid, goal points first: dicts of B, T, Hq, Hk, D, causal."""
    if smoke:
        return [dict(B=1, T=40, Hq=2, Hk=1, D=16, causal=c) for c in (True, False)]
    cases = []
    for T in SEQLENS:
        for D in (128, 64):
            for causal in (True, False):
                H = 2048 // D
                cases.append(dict(B=TOKENS // T, T=T, Hq=H, Hk=H, D=D, causal=causal))
        cases.append(dict(B=TOKENS // T, T=T, Hq=32, Hk=8, D=128, causal=True))
    return cases


def decode_cases(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(B=2, L=70, Hq=8, Hk=1, D=16, page=16, cap=160)]
    # the last three: Qwen2.5-1.5B's heads with short live contexts in a block table 4096 tokens wide (what
    # the engine's captured decode step passes): the split chunks follow the live keys, not the table's
    # width; also timed as a stack of its 28 layers (decode_forms)
    qwen = dict(Hq=12, Hk=2, D=128, page=16, cap=4096, layers=QWEN_LAYERS)
    return [
        dict(B=64, L=4096, Hq=64, Hk=8, D=128, page=16),
        dict(B=1, L=65536, Hq=64, Hk=8, D=128, page=16),
        dict(B=1, L=384, **qwen),
        dict(B=1, L=1100, **qwen),
        dict(B=64, L=1100, **qwen),
    ]


def case_name(c: dict) -> str:
    if "L" in c:
        cap = f"_table{c['cap']}" if "cap" in c else ""
        return f"decode_B{c['B']}_L{c['L']}_H{c['Hq']}kv{c['Hk']}_D{c['D']}_page{c['page']}{cap}"
    return f"B{c['B']}_T{c['T']}_H{c['Hq']}kv{c['Hk']}_D{c['D']}_{'causal' if c['causal'] else 'full'}"


def attn_flops(c: dict) -> float:
    return 4.0 * c["B"] * c["Hq"] * c["T"] * c["T"] * c["D"] * (0.5 if c["causal"] else 1.0)


class Bench:
    """The run's clock, log and timer; every measurement goes through `measure` or `measure_many`, which
    never raise."""

    def __init__(self, run: BenchRun):
        self.run = run
        self.cuda = run.device.type == "cuda"
        self.timer = run.timer
        self.copy_tbps = run.ceilings["copy_TBps"]
        self.bf16_tflops = run.ceilings["bf16_matmul_TFLOPs"]

    def elapsed(self) -> float:
        return self.run.elapsed()

    def log(self, msg: str) -> None:
        self.run.log(msg)

    def ms(self, fn) -> float:
        return self.timer.ms(fn, rep_ms=30)

    def clean_ms(self, fn, reps: int = 60) -> float:
        """Median ms of fn, each call after an L2 flush that leaves no dirty lines behind.

        do_bench flushes by zeroing 256 MB: the L2 (50 MB) is left full of dirty lines, written back
        to DRAM while the next kernel runs. For a 60-us, 256-MB decode step that write-back is ~20%
        more DRAM traffic that belongs to the flush. Here the flush *reads* 512 MB (a sum), which
        evicts the previous call's K/V as well, and leaves the L2 holding clean lines only."""
        import torch

        flush = torch.ones(2**28, dtype=torch.bfloat16, device="cuda")  # 512 MB
        fn()
        start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            flush.sum()
            start[i].record()
            fn()
            end[i].record()
        torch.cuda.synchronize()
        times = sorted(a.elapsed_time(b) for a, b in zip(start, end))
        return times[reps // 2]

    def capture(self, fns: list):
        """One CUDA graph of the calls fns[0](), fns[1](), ... in order, each called first outside the
        capture (compile, autotune, workspaces) on the current and on a side stream."""
        import torch

        for fn in fns:
            fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
        return graph

    def graph_ms(self, fn, clean: bool = False) -> float:
        """Time fn replayed from a CUDA graph (as a decode engine runs it): no Python launch cost,
        still an L2 flush before every replay (do_bench's, or with `clean` see `clean_ms`)."""
        graph = self.capture([fn])
        return self.clean_ms(graph.replay) if clean else self.ms(graph.replay)

    def measure(self, rec: dict, key: str, fn, graph: bool = False, clean: bool = False) -> float | None:
        """Time fn into rec[key] (ms); on failure record the error instead and carry on."""
        return self.record(rec, key, lambda: self.graph_ms(fn, clean) if graph and self.cuda else self.ms(fn))

    def record(self, rec: dict, key: str, timing) -> float | None:
        """rec[key] = timing(), a time in ms; on failure record the error instead and carry on."""
        try:
            ms = timing()
        except Exception as e:  # noqa: BLE001 - one failing case must not end the run
            rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            self.log(f"  {rec.get('case')} {key} failed: {rec[key + '_error']}")
            if os.environ.get("KILN_BENCH_TRACE"):
                traceback.print_exc()
            return None
        rec[key] = round(ms, 4)
        return ms

    def measure_many(self, rec: dict, fns: dict) -> None:
        """Time the candidates {key: fn} interleaved (rounds in random order, kiln.profile.timing) into
        rec[key] (ms); a candidate whose first call fails records its error and drops out."""
        ok = {}
        for key, fn in fns.items():
            try:
                fn()
                ok[key] = fn
            except Exception as e:  # noqa: BLE001 - one failing candidate must not end the run
                rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                self.log(f"  {rec.get('case')} {key} failed: {rec[key + '_error']}")
        try:
            times = self.timer.interleaved(ok, rep_ms=10)
        except Exception as e:  # noqa: BLE001
            for key in ok:
                rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return
        for key, t in times.items():
            rec[key] = round(t["ms"], 4)


def tflops(rec: dict, bf16_tflops: float | None) -> None:
    """<impl>_<phase>_TFLOPs for every <impl>_<phase>_ms, and kiln's ratios to each peer."""
    for key in list(rec):
        for phase in ("fwd", "bwd"):
            if key.endswith(f"_{phase}_ms") and rec[key]:
                rec[key.removesuffix("_ms") + "_TFLOPs"] = round(rec[f"{phase}_flops"] / rec[key] / 1e9, 1)
    for phase in ("fwd", "bwd"):
        mine = rec.get(f"kiln_{phase}_TFLOPs")
        if not mine:
            continue
        rec[f"kiln_{phase}_frac_bf16_peak"] = fraction(mine, bf16_tflops)
        for peer in ("cudnn", "flash", "flex"):
            if rec.get(f"{peer}_{phase}_TFLOPs"):
                rec[f"kiln_vs_{peer}_{phase}"] = round(mine / rec[f"{peer}_{phase}_TFLOPs"], 3)


def prefill_case(bench: Bench, c: dict, rec: dict, dev: str, dtype, sdpa_backends: dict):
    """kiln and SDPA forward/backward at one grid point; returns the tensors for the flex pass."""
    import torch

    from kiln.kernels.attention import attention
    from kiln.kernels.dispatch import use_backend

    g = torch.Generator(device=dev).manual_seed(0)
    B, T, Hq, Hk, D, causal = c["B"], c["T"], c["Hq"], c["Hk"], c["D"], c["causal"]
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(B, T, Hk, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(B, T, Hk, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(B, T, Hq, D, device=dev, dtype=dtype, generator=g)

    def kiln():
        with use_backend("triton"):
            return attention(q, k, v, causal=causal)

    fwd = {"kiln_fwd_ms": kiln}
    # SDPA takes (B, H, T, D): transposed views of the same memory, as a model would pass them.
    qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))
    for name, backend in sdpa_backends.items():
        from torch.nn.attention import sdpa_kernel

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=Hq != Hk
                )

        fwd[f"{name}_fwd_ms"] = sdpa
    bench.measure_many(rec, fwd)
    bwd = {}
    for key, f in fwd.items():
        if key not in rec:  # the forward failed: no backward to time
            continue
        o = f()
        backend = "triton" if key.startswith("kiln") else "auto"  # kiln's backward as its forward ran
        grad_out = do if key.startswith("kiln") else dot

        def back(o=o, grad_out=grad_out, backend=backend):
            with use_backend(backend):
                return torch.autograd.grad(o, (q, k, v), grad_out, retain_graph=True)

        bwd[key.replace("_fwd_", "_bwd_")] = back
    bench.measure_many(rec, bwd)
    tflops(rec, bench.bf16_tflops)
    rec["kiln_configs"] = chosen_configs()
    return q, k, v, do


def chosen_configs() -> dict:
    """The autotuner's latest pick per kiln kernel (BLOCK_M/BLOCK_N, warps, stages), for tuning notes."""
    from kiln.kernels import attention_bwd, attention_fwd

    kernels = {
        "fwd": attention_fwd._attn_fwd_kernel,
        "dkdv": attention_bwd._attn_bwd_dkdv_kernel,
        "dq": attention_bwd._attn_bwd_dq_kernel,
    }
    return {name: str(getattr(k, "best_config", None)) for name, k in kernels.items()}


def decode_case(bench: Bench, c: dict, rec: dict, dev: str, dtype) -> None:
    import torch

    from kiln.kernels.decode_attention import decode_attention
    from kiln.kernels.dispatch import use_backend

    B, L, Hq, Hk, D, page = c["B"], c["L"], c["Hq"], c["Hk"], c["D"], c["page"]
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = -(-c.get("cap", L) // page)  # the table's width: `cap` tokens, of which L are live
    pool = B * blocks
    table = torch.randperm(pool, device=dev, generator=g).view(B, blocks).to(torch.int32)
    k_cache = torch.randn(pool, page, Hk, D, device=dev, dtype=dtype, generator=g)
    v_cache = torch.randn(pool, page, Hk, D, device=dev, dtype=dtype, generator=g)
    q = torch.randn(B, Hq, D, device=dev, dtype=dtype, generator=g)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    kv_bytes = 2 * B * L * Hk * D * k_cache.element_size()
    rec["kv_bytes"] = kv_bytes

    def kiln(form=None, kc=k_cache, vc=v_cache):  # form None: the default (kiln_* keys)
        with use_backend("triton"):
            return decode_attention(q, kc, vc, table, seq_lens, form=form)

    decode_forms(bench, rec, c, kiln, k_cache)
    decode_configs(bench, rec, (q, k_cache, v_cache, table, seq_lens))
    bench.measure(rec, "kiln_eager_ms", kiln)  # with Python launch overhead: see the graph figure
    ms = bench.measure(rec, "kiln_ms", kiln, graph=True)
    from kiln.kernels import decode_attention as dec

    rec["kiln_splits"], rec["kiln_config"] = dec.split_plan(
        B, Hk, table.shape[1] * page, dec.sm_count(q.device)
    )
    if ms:
        rec["kiln_TBps"] = round(kv_bytes / ms / 1e9, 3)
        rec["kiln_frac_copy"] = fraction(rec["kiln_TBps"], bench.copy_tbps)
    if bench.cuda:  # the same graph after a flush that leaves the L2 clean (see Bench.clean_ms)
        ms = bench.measure(rec, "kiln_clean_l2_ms", kiln, graph=True, clean=True)
        if ms:
            rec["kiln_clean_l2_TBps"] = round(kv_bytes / ms / 1e9, 3)
            rec["kiln_clean_l2_frac_copy"] = fraction(rec["kiln_clean_l2_TBps"], bench.copy_tbps)
    if bench.cuda:  # peer: SDPA over a dense, contiguous (B, Hk, L, D) copy of the same cache
        k = k_cache[table.long()].reshape(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
        v = v_cache[table.long()].reshape(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
        qd = q[:, :, None]

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=True)

        ms = bench.measure(rec, "sdpa_dense_ms", sdpa, graph=True)
        if ms:
            rec["sdpa_dense_TBps"] = round(kv_bytes / ms / 1e9, 3)
            if rec.get("kiln_TBps"):
                rec["kiln_vs_sdpa_dense"] = round(rec["kiln_TBps"] / rec["sdpa_dense_TBps"], 3)
        ms = bench.measure(rec, "sdpa_dense_clean_l2_ms", sdpa, graph=True, clean=True)
        if ms:
            rec["sdpa_dense_clean_l2_TBps"] = round(kv_bytes / ms / 1e9, 3)


def decode_forms(bench: Bench, rec: dict, c: dict, kiln, k_cache) -> None:
    """decode_attention's two forms of a multi-split launch side by side (kernels/decode_attention.py):
    two_pass (split kernel, then a reduction kernel: what kiln_* measures while it is the default) and
    one_pass (the last split program of each (sequence, KV head) reduces). Each is captured in a CUDA graph
    and the two graphs are replayed interleaved (do_bench's flush before each replay): kiln_<form>_ms;
    after a clean-L2 flush: kiln_<form>_clean_l2_ms; and, for rows with `layers`, a graph of that many
    calls over as many separate caches (one per layer, as a decode step reads them; the same table and
    lengths): kiln_<form>_stack_us_per_call. one_pass_speedup*: two_pass time / one_pass time (> 1: one
    launch faster). The ratios are what decides DEFAULT_FORM. one_pass_max_abs_diff: how far the two forms'
    outputs are apart (summation order only)."""
    import torch

    from kiln.kernels.decode_attention import FORMS

    for form in FORMS:
        bench.measure(rec, f"kiln_{form}_eager_ms", lambda form=form: kiln(form))
    try:  # the same values up to the combine's summation order (bf16 output on the GPU)
        rec["one_pass_max_abs_diff"] = float(
            (kiln("one_pass").float() - kiln("two_pass").float()).abs().max()
        )
    except Exception as e:  # noqa: BLE001 - the timings above already recorded a failing form
        rec["one_pass_max_abs_diff_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if not bench.cuda:
        return
    graphs, stacks = {}, {}
    layers = c.get("layers", 0)
    caches = [(torch.randn_like(k_cache), torch.randn_like(k_cache)) for _ in range(layers)]
    for form in FORMS:
        try:
            graphs[form] = bench.capture([lambda form=form: kiln(form)])
            if layers:
                stacks[form] = bench.capture([lambda form=form, kv=kv: kiln(form, *kv) for kv in caches])
        except Exception as e:  # noqa: BLE001 - one failing form must not end the run
            rec[f"kiln_{form}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            bench.log(f"  {rec.get('case')} {form} failed: {rec[f'kiln_{form}_error']}")
    bench.measure_many(rec, {f"kiln_{form}_ms": g.replay for form, g in graphs.items()})
    for form, g in graphs.items():
        bench.record(rec, f"kiln_{form}_clean_l2_ms", lambda g=g: bench.clean_ms(g.replay))
    if stacks:
        bench.measure_many(rec, {f"kiln_{form}_stack_ms": g.replay for form, g in stacks.items()})
        for form in stacks:
            if rec.get(f"kiln_{form}_stack_ms"):
                rec[f"kiln_{form}_stack_us_per_call"] = round(rec[f"kiln_{form}_stack_ms"] * 1e3 / layers, 3)
    for key in ("_ms", "_clean_l2_ms", "_stack_ms"):
        two, one = rec.get(f"kiln_two_pass{key}"), rec.get(f"kiln_one_pass{key}")
        if two and one:
            rec["one_pass_speedup" + key.removesuffix("_ms")] = round(two / one, 3)


def config_name(n: int, w: int, s: int, addr32: bool, tma: bool = False, preload: bool = False) -> str:
    return (
        f"{n}x{w}w{s}s"
        + ("_addr32" if addr32 else "")
        + ("_tma" if tma else "")
        + ("_preload" if preload else "")
    )


def decode_configs(bench: Bench, rec: dict, tensors) -> None:
    """The split kernel at each of its autotuned configs (decode_attention.SPLIT_CONFIGS: the old int64
    ones and the ADDR32 ones with fewer registers), the default form, each a graph replayed interleaved with
    the others (do_bench's flush before each replay): kiln_split_<config>_ms and _TBps, so that one run
    shows old against new side by side (the autotuner's own pick is kiln_config). On the CPU each config
    runs once through the interpreter: kiln_split_<config>_max_abs_diff against the autotuned call."""
    from kiln.kernels import decode_attention as dec

    q, kc, vc, table, seq_lens = tensors
    scale = q.shape[-1] ** -0.5
    fns = {}
    page = kc.shape[1]
    for n, w, s, a, t, pl in dec.SPLIT_CONFIGS:
        if t and n != page:  # a TMA tile is one page: the autotuner prunes the others too
            continue
        cfg = dict(BLOCK_N=n, num_warps=w, num_stages=s, ADDR32=a, TMA=t, PRELOAD=pl)

        def call(cfg=cfg):
            return dec.decode_attention_triton(q, kc, vc, table, seq_lens, scale, None, None, None, cfg)

        fns[f"kiln_split_{config_name(n, w, s, a, t, pl)}_ms"] = call
    if not bench.cuda:  # the interpreter: every config runs (num_warps / num_stages mean nothing there)
        want = dec.decode_attention_triton(q, kc, vc, table, seq_lens, scale, None, None, None)
        for key, fn in fns.items():
            rec[key.removesuffix("_ms") + "_max_abs_diff"] = float((fn() - want).abs().max())
        return
    graphs = {}
    for key, fn in fns.items():
        try:
            graphs[key] = bench.capture([fn]).replay
        except Exception as e:  # noqa: BLE001 - one failing config must not end the run
            rec[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    bench.measure_many(rec, graphs)
    for key in graphs:
        if rec.get(key):
            rec[key.removesuffix("_ms") + "_TBps"] = round(rec["kv_bytes"] / rec[key] / 1e9, 3)


def flex_case(bench: Bench, rec: dict, tensors, flex, create_block_mask) -> None:
    import torch

    q, k, v, do = tensors
    qt, kt, vt, dot = (t.transpose(1, 2) for t in (q, k, v, do))

    def causal_mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    T = rec["T"]
    block_mask = create_block_mask(causal_mask, None, None, T, T, device="cuda") if rec["causal"] else None

    def f():
        return flex(qt, kt, vt, block_mask=block_mask, enable_gqa=rec["Hq"] != rec["Hk"])

    t0 = bench.elapsed()
    o = f()
    torch.autograd.grad(o, (q, k, v), dot, retain_graph=True)  # compile the backward too
    rec["flex_compile_s"] = round(bench.elapsed() - t0, 1)
    bench.measure(rec, "flex_fwd_ms", f)
    bench.measure(rec, "flex_bwd_ms", lambda: torch.autograd.grad(o, (q, k, v), dot, retain_graph=True))


def flex_pass(bench: Bench, records: list[dict], tensors: dict) -> None:
    """torch.compile'd flex_attention at the grid points, goal points first, until the time budget ends."""
    import torch

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # Each shape compiles anew; past the recompile limit dynamo would silently run flex eagerly.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 64)
        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as e:  # noqa: BLE001
        for rec in records:
            rec["flex"] = f"unavailable: {type(e).__name__}: {e}"
        return
    # One compile per (head dim, causality, GQA, length): the goal points (hd128 causal, 4096, 16384) first.
    goal = {4096: 0, 16384: 1}
    order = sorted(
        records,
        key=lambda r: (not (r["D"] == 128 and r["causal"] and r["Hq"] == r["Hk"]), goal.get(r["T"], 2)),
    )
    done = 0
    for rec in order:
        if rec["case"] not in tensors:
            continue
        if bench.elapsed() > FLEX_BUDGET_S or done >= 2:  # a compile takes 5-8 s: at most two, in time
            rec["flex"] = "skipped: time budget"
            continue
        try:
            done += 1
            flex_case(bench, rec, tensors[rec["case"]], flex, create_block_mask)
        except Exception as e:  # noqa: BLE001
            rec["flex_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        tflops(rec, bench.bf16_tflops)
        bench.log(
            f"{rec['case']}: flex {rec.get('flex_fwd_TFLOPs')}/{rec.get('flex_bwd_TFLOPs')} TFLOP/s "
            f"(compile {rec.get('flex_compile_s')} s)"
        )


def markdown_tables(path: str) -> str:
    """The README's tables from a results file: TFLOP/s (fwd / bwd) per point, ratios, decode TB/s."""
    res = read_json(path)
    # the copy bandwidth measured in the run (files before the shared harness: the platform figure)
    ceil = res.get("ceilings", {})
    copy = ceil.get("copy_TBps") or ceil.get("copy_TBps_measured") or ceil.get("copy_TBps_platform")

    def f(x, fmt="{:.0f}"):
        return fmt.format(x) if isinstance(x, (int, float)) else "-"

    lines = [
        f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}, commit {res['commit'][:7]}, {res['date']}",
        "",
        "| B x T, heads, D, mask | kiln fwd / bwd | cuDNN fwd / bwd | flash fwd / bwd | flex fwd / bwd "
        "| kiln / cuDNN | kiln / flash | fwd % of bf16 peak |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["prefill"]:
        heads = f"{r['Hq']}" if r["Hq"] == r["Hk"] else f"{r['Hq']}q/{r['Hk']}kv"
        mask = "causal" if r["causal"] else "full"

        def pair(n, r=r):
            return f"{f(r.get(n + '_fwd_TFLOPs'))} / {f(r.get(n + '_bwd_TFLOPs'))}"

        def ratio(n, r=r):
            return f"{f(r.get('kiln_vs_' + n + '_fwd'), '{:.2f}')} / {f(r.get('kiln_vs_' + n + '_bwd'), '{:.2f}')}"

        lines.append(
            f"| {r['B']} x {r['T']}, {heads}, {r['D']}, {mask} | {pair('kiln')} | {pair('cudnn')} | {pair('flash')} "
            f"| {pair('flex')} | {ratio('cudnn')} | {ratio('flash')} | {f(100 * (r.get('kiln_fwd_frac_bf16_peak') or 0))} |"
        )
    lines += [
        "",
        f"| decode (graph replay) | KV bytes | flush | kiln | % of copy ({copy} TB/s) | SDPA dense | kiln / SDPA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"]:
        for flush, key in (("do_bench (dirty L2)", ""), ("read-only (clean L2)", "_clean_l2")):
            kiln, sdpa = r.get(f"kiln{key}_TBps"), r.get(f"sdpa_dense{key}_TBps")
            lines.append(
                f"| B={r['B']} x {r['L']}, {r['Hq']}q/{r['Hk']}kv, D {r['D']}, page {r['page']} "
                f"| {r['kv_bytes'] / 2**20:.0f} MiB | {flush} | {f(kiln, '{:.2f}')} TB/s "
                f"| {f(100 * kiln / copy if kiln and copy else None)}% | {f(sdpa, '{:.2f}')} TB/s "
                f"| {f(kiln / sdpa if kiln and sdpa else None, '{:.2f}')} |"
            )
    lines += [
        "",
        "| decode forms (graph replay, us) | splits | two_pass | one_pass | speedup | clean L2: two / one "
        "| speedup | per call in a stack of layers: two / one | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["decode"]:
        if "kiln_one_pass_ms" not in r and "kiln_one_pass_eager_ms" not in r:
            continue  # a results file from before the one-pass form

        def us(key, r=r):
            return f(r[key] * 1e3 if r.get(key) else None, "{:.1f}")

        stack = f"{f(r.get('kiln_two_pass_stack_us_per_call'), '{:.1f}')} / "
        stack += f"{f(r.get('kiln_one_pass_stack_us_per_call'), '{:.1f}')}"
        lines.append(
            f"| B={r['B']} x {r['L']}, {r['Hq']}q/{r['Hk']}kv, table {r.get('cap', r['L'])} "
            f"| {r.get('kiln_splits', '-')} | {us('kiln_two_pass_ms')} | {us('kiln_one_pass_ms')} "
            f"| {f(r.get('one_pass_speedup'), '{:.2f}')} "
            f"| {us('kiln_two_pass_clean_l2_ms')} / {us('kiln_one_pass_clean_l2_ms')} "
            f"| {f(r.get('one_pass_speedup_clean_l2'), '{:.2f}')} | {stack} "
            f"| {f(r.get('one_pass_speedup_stack'), '{:.2f}')} |"
        )
    lines += decode_config_table(res)
    return "\n".join(lines)


def decode_config_table(res: dict) -> list[str]:
    """The split kernel's configs side by side (decode_configs): TB/s of K/V read per decode row."""
    from kiln.kernels.decode_attention import SPLIT_CONFIGS

    names = [config_name(*c) for c in SPLIT_CONFIGS]
    rows = [r for r in res["decode"] if any(f"kiln_split_{n}_TBps" in r for n in names)]
    if not rows:
        return []  # a results file from before the per-config timings
    lines = ["", "| decode split configs (graph replay, TB/s) | " + " | ".join(names) + " | autotuned |"]
    lines.append("|---" * (len(names) + 2) + "|")
    for r in rows:
        cells = [
            f"{r[k]:.2f}" if isinstance(r.get(k), float) else "-"
            for k in (f"kiln_split_{n}_TBps" for n in names)
        ]
        lines.append(
            f"| B={r['B']} x {r['L']}, {r['Hq']}q/{r['Hk']}kv, D {r['D']} | "
            + " | ".join(cells)
            + f" | {r.get('kiln_config', '-')} |"
        )
    return lines


PREFLIGHT = """
import torch
from kiln.kernels.attention import attention
from kiln.kernels.dispatch import use_backend
for D in (128, 64):  # the grid's non-causal heads and head dims (its kernels compile here, for the run too)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 1024, 2048 // D, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn_like(q).requires_grad_()
    v = torch.randn_like(q).requires_grad_()
    with use_backend("triton"):
        o = attention(q, k, v, causal=False)
    torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
torch.cuda.synchronize()
"""


def preflight() -> str | None:
    """The non-causal forward and backward in a child process first (an earlier version of the dK/dV
    kernel hit an illegal address without a causal mask, which poisons the whole CUDA context): None
    when it runs, else the child's error, and the run then skips the non-causal points instead of
    losing them all. The child compiles the kernels the run needs into Triton's cache, so it costs
    little more than its start."""
    try:
        out = subprocess.run([sys.executable, "-c", PREFLIGHT], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "timed out"
    return None if out.returncode == 0 else (out.stderr or out.stdout)[-2000:]


def main() -> int:
    args = parse_args()
    if args.table:
        print(markdown_tables(args.table))
        return 0
    if args.smoke:  # before anything imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    # 3 rounds of 10 ms per contender: the 30 ms of do_bench per figure of the runs before the harness,
    # so the grid still fits the time budget
    run = BenchRun("attention", __file__, args, rounds=3)
    bench = Bench(run)
    cuda = bench.cuda
    dev = run.device.type
    dtype = torch.bfloat16 if cuda else torch.float32  # bf16 tl.dot is broken in the interpreter
    result = {"dtype": str(dtype).removeprefix("torch."), "prefill": [], "decode": []}

    sdpa_backends = {}
    if cuda:
        from torch.nn.attention import SDPBackend

        sdpa_backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    tensors = {}
    preflight_error = preflight() if cuda else None
    if preflight_error:
        result["preflight_error"] = preflight_error
        bench.log(f"preflight failed, non-causal points skipped: {preflight_error[-300:]}")
    for c in prefill_cases(args.smoke):
        rec = {"case": case_name(c), **c, "fwd_flops": attn_flops(c), "bwd_flops": 2.5 * attn_flops(c)}
        result["prefill"].append(rec)
        if bench.elapsed() > TIME_BUDGET_S:
            rec["skipped"] = "time budget"
            continue
        if preflight_error and not c["causal"]:
            rec["skipped"] = "preflight failed (see preflight_error)"
            continue
        try:
            tensors[rec["case"]] = prefill_case(bench, c, rec, dev, dtype, sdpa_backends)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        bench.log(
            f"{rec['case']}: kiln {rec.get('kiln_fwd_TFLOPs')}/{rec.get('kiln_bwd_TFLOPs')} "
            f"cudnn {rec.get('cudnn_fwd_TFLOPs')}/{rec.get('cudnn_bwd_TFLOPs')} "
            f"flash {rec.get('flash_fwd_TFLOPs')}/{rec.get('flash_bwd_TFLOPs')} TFLOP/s (fwd/bwd)"
        )

    for c in decode_cases(args.smoke):
        rec = {"case": case_name(c), **c}
        result["decode"].append(rec)
        try:
            decode_case(bench, c, rec, dev, dtype)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        bench.log(
            f"{rec['case']}: kiln {rec.get('kiln_TBps')} TB/s ({rec.get('kiln_frac_copy')} of the copy), "
            f"sdpa dense {rec.get('sdpa_dense_TBps')} TB/s"
        )

    if cuda and not args.no_flex:  # the peer before kiln's own variants
        flex_pass(bench, result["prefill"], tensors)
    else:
        for rec in result["prefill"]:
            rec["flex"] = "skipped: " + ("--no-flex" if cuda else "needs CUDA")

    run.write(**result)
    errors = [r["case"] for r in result["prefill"] + result["decode"] if any("error" in k for k in r)]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
