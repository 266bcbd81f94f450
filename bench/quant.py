"""Low-precision inference on the H200: quantized matmuls per Qwen2.5-1.5B projection, and engine decode.

    python bench/quant.py            # on a CUDA GPU, ~3-4 min -> bench/results/quant.json
    python bench/quant.py --smoke    # tiny shapes on the CPU through the interpreter (fp16): end to end

Sections (each result checked against its reference in the same run):
- decode: M = 1, 4, 16 rows x the five projections (qkv 1536->2048 merged, o 1536->1536, gate_up
  1536->17920, down 8960->1536, head 1536->151936): kiln int8, int4-g128 and int4-g32 against kiln's bf16
  decode matmul and cuBLAS (F.linear), GPU time in CUDA graphs over interleaved rounds. Unit: GB/s of
  weight bytes read (quantized values + scales), and the fraction of the copy bandwidth measured in the run;
  the speedup over cuBLAS bf16 is the figure that matters (ideal: bf16 bytes / quantized bytes).
- prefill: 2048 tokens through the same projections (the head too): int8 / int4 tile kernels and FP8
  (fp8_linear: per-row activation quantize + matmul, and the matmul alone) in TFLOP/s against cuBLAS bf16
  and torch._scaled_mm (rowwise scales); plus 8192^3 FP8 against _scaled_mm.
- engine: decode tok/s at batch 1 and 16 (128-token prompts, 128 new tokens, greedy) of a random-init
  Qwen2.5-1.5B shape in bf16, int8, int4-g128 and fp8 (head quantized too), engines alternated over
  rounds, medians.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import json
import os
import random
import statistics
import sys
import traceback
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.infer import bench as infer_bench
from kiln.infer.engine import LLM
from kiln.kernels.dispatch import sm_count, use_backend
from kiln.kernels.fp8_matmul import (
    FP8,
    Fp8Rows,
    fp8_decode_linear,
    fp8_decode_linear_ref,
    fp8_linear,
    fp8_linear_decode_config,
    fp8_matmul,
    fp8_matmul_ref,
    quantize_fp8,
    quantize_fp8_ref,
)
from kiln.kernels.matmul import linear
from kiln.kernels.matmul_decode import DecodeConfig
from kiln.kernels.quant_matmul import wq_linear, wq_matmul_fwd, wq_matmul_ref
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_fp8
from kiln.kernels.swiglu import swiglu, swiglu_fp8
from kiln.model.config import ModelConfig
from kiln.model.quant_linear import QuantLinear
from kiln.model.transformer import build_model
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, default_out, format_table
from kiln.quant import QuantScheme, quantize_model
from kiln.quant.rtn import quantize_weight

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
          "head": (1536, 151936)}  # fmt: skip
ROWS = (1, 4, 16)
PREFILL_M = 2048
FORMATS = {"int8": ("int8", 0), "int4-g128": ("int4", 128), "int4-g32": ("int4", 32)}
SMOKE_SHAPES = {"qkv": (128, 48), "down": (256, 40)}
SMOKE_LAYER = {"qkv": (64, 192), "o": (64, 64), "gate_up": (64, 192), "down": (96, 64)}  # d 64, F 96
SMOKE_ROWS = (1, 4)
ENGINE_SCHEMES = ("bf16", "int8", "int4-g128", "fp8")


def _try(failed: dict[str, str], label: str, fn):
    """fn(), or None with its traceback recorded under `label` (the run goes on; main exits 1)."""
    try:
        return fn()
    except Exception:
        failed[label] = traceback.format_exc()[-3000:]
        print(f"{label} FAILED:\n{failed[label]}", flush=True)
        return None


def _working(fns: dict, failed: dict[str, str], where: str) -> dict:
    """The callables of `fns` that run (each called once: compile), the others recorded as failed."""
    return {n: f for n, f in fns.items() if _try(failed, f"{where} {n}", f) is not None}


def _bytes(res: dict) -> int:
    return sum(t.numel() * t.element_size() for t in res.values() if t is not None)


def decode_section(run: BenchRun, dtype: torch.dtype, failed: dict[str, str]) -> list[dict]:
    dev = run.device
    shapes, row_counts = (SMOKE_SHAPES, SMOKE_ROWS) if run.smoke else (SHAPES, ROWS)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    copy = run.ceilings.get("copy_TBps")
    for name, (K, N) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        quant = {f: quantize_weight(w, kind, group) for f, (kind, group) in FORMATS.items()}
        for M in row_counts:
            x = torch.randn(M, K, device=dev, generator=g).to(dtype)
            fns = {"cublas_bf16": lambda x=x, w=w: F.linear(x, w), "kiln_bf16": lambda x=x, w=w: linear(x, w)}
            errs = {}
            for f, (kind, group) in FORMATS.items():
                q = quant[f]
                bits = 4 if kind == "int4" else 8
                fns[f] = lambda x=x, q=q, bits=bits, group=group: wq_linear(
                    x, q["qweight"], q["scales"], q["zeros"], bits, group
                )
            with use_backend("triton"):
                fns = _working(fns, failed, f"decode {name} M={M}")
                for f, (kind, group) in FORMATS.items():
                    if f in fns:
                        q = quant[f]
                        want = wq_matmul_ref(x.float(), q["qweight"], q["scales"], q["zeros"], 4 if kind == "int4" else 8,
                                             group)  # fmt: skip
                        errs[f] = float((fns[f]().float() - want).abs().max() / want.abs().max())
                t = run.timer.interleaved(fns, graph=True)
            row = {"shape": name, "M": M, "K": K, "N": N}
            base = t["cublas_bf16"]["ms"] if "cublas_bf16" in t else float("nan")
            for f, r in t.items():
                nbytes = N * K * 2 if f.endswith("bf16") else _bytes(quant[f])
                us = r["ms"] * 1e3
                gbps = nbytes / us / 1e3
                row[f] = {"us": round(us, 2), "GBps": round(gbps, 1), "vs_cublas": round(base / r["ms"], 3),
                          "frac_copy": fraction(gbps / 1e3, copy) if copy else None}  # fmt: skip
                if f in errs:
                    row[f]["max_rel_err"] = round(errs[f], 5)
            rows.append(row)
            run.log(f"decode {name} M={M}: " + ", ".join(f"{f} {row[f]['us']} us" for f in t))
    return rows


def prefill_section(run: BenchRun, dtype: torch.dtype, failed: dict[str, str]) -> list[dict]:
    dev = run.device
    shapes = SMOKE_SHAPES if run.smoke else SHAPES
    M = 40 if run.smoke else PREFILL_M
    g = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for name, (K, N) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        x = torch.randn(M, K, device=dev, generator=g).to(dtype)
        fns = {"cublas_bf16": lambda x=x, w=w: F.linear(x, w)}
        for f, (kind, group) in list(FORMATS.items())[:2]:
            q = quantize_weight(w, kind, group)
            bits = 4 if kind == "int4" else 8
            fns[f] = lambda x=x, q=q, bits=bits, group=group: wq_linear(
                x, q["qweight"], q["scales"], q["zeros"], bits, group
            )
        if not run.smoke:  # FP8: the GPU only (module docstring of kernels/fp8_matmul.py)
            wq = quantize_weight(w, "fp8")
            w8, ws = wq["qweight"], wq["scales"].float()
            a8, a_s = quantize_fp8(x, per_row=True)
            ws_row = ws.reshape(1, -1).contiguous()
            fns["fp8_linear"] = lambda x=x, w8=w8, ws=ws: fp8_linear(x, w8, ws)
            fns["fp8_matmul"] = lambda a8=a8, a_s=a_s, w8=w8, ws=ws: fp8_matmul(a8, a_s, w8, ws)
            fns["scaled_mm"] = lambda a8=a8, a_s=a_s, w8=w8, s=ws_row: torch._scaled_mm(
                a8, w8.t(), scale_a=a_s, scale_b=s, out_dtype=torch.bfloat16
            )
        with use_backend("triton"):
            fns = _working(fns, failed, f"prefill {name}")
            t = run.timer.interleaved(fns, graph=not run.smoke)
        flop = 2 * M * N * K
        row = {"shape": name, "M": M, "K": K, "N": N}
        for f, r in t.items():
            row[f] = {"ms": round(r["ms"], 4), "TFLOPs": round(flop / r["ms"] / 1e9, 1),
                      "vs_cublas_bf16": round(t["cublas_bf16"]["ms"] / r["ms"], 3) if "cublas_bf16" in t else None}  # fmt: skip
        rows.append(row)
        run.log(f"prefill {name}: " + ", ".join(f"{f} {row[f]['TFLOPs']} TFLOP/s" for f in t))
    if not run.smoke:
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        a8, a_s = quantize_fp8(a, per_row=True)
        b8, b_s = quantize_fp8(b, per_row=True)
        fns = {"fp8_matmul": lambda: fp8_matmul(a8, a_s, b8, b_s),
               "scaled_mm": lambda: torch._scaled_mm(a8, b8.t(), scale_a=a_s, scale_b=b_s.reshape(1, -1).contiguous(),
                                                     out_dtype=torch.bfloat16),
               "cublas_bf16": lambda: a @ b.t()}  # fmt: skip
        t = run.timer.interleaved(_working(fns, failed, "prefill 8192^3"), graph=True)
        row = {"shape": "8192^3", "M": n, "K": n, "N": n}
        for f, r in t.items():
            row[f] = {"ms": round(r["ms"], 4), "TFLOPs": round(2 * n**3 / r["ms"] / 1e9, 1)}
        rows.append(row)
        run.log("prefill 8192^3: " + ", ".join(f"{f} {row[f]['TFLOPs']} TFLOP/s" for f in t))
    return rows


# FP8 prefill tile candidates (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, tma); the first is the rule's
FP8_PREFILL_CANDIDATES = [(128, 256, 128, 3, 8, False), (128, 128, 128, 3, 8, False), (128, 256, 128, 3, 8, True),
                          (256, 128, 128, 3, 8, True), (128, 256, 64, 4, 8, False), (256, 128, 128, 3, 8, False)]  # fmt: skip


@contextlib.contextmanager
def _fp8_rows_off():
    """The model's FP8 linears quantize their own inputs (the path before the fused producers)."""
    saved = QuantLinear.takes_fp8_rows
    QuantLinear.takes_fp8_rows = lambda self, x: False
    try:
        yield
    finally:
        QuantLinear.takes_fp8_rows = saved


def fp8_prefill_section(run: BenchRun, failed: dict[str, str]) -> dict:
    """FP8 weight + activation at prefill (2048 tokens, Qwen2.5-1.5B), against bf16 in the same run:
    1. tiles: each projection's FP8 matmul over FP8_PREFILL_CANDIDATES, beside torch._scaled_mm and cuBLAS
       bf16 (each checked against _scaled_mm); the winners that beat the rule by > 2% fill FP8_PREFILL_TABLE
       for what follows;
    2. layer: what FP8 changes in a dense layer (add + RMSNorm -> qkv, o, add + RMSNorm -> gate_up, SwiGLU ->
       down) in bf16, in FP8 with fp8_linear quantizing every input, and with the norms and the SwiGLU
       quantizing their own rows (rmsnorm_fp8, swiglu_fp8), at the rule's tiles, the swept tiles, and with
       torch._scaled_mm as the GEMM; GPU time from CUDA graphs;
    3. model: the decoder's hidden states over a 2048-token sequence (attention included, the head not: a
       prefill computes logits for its last token), bf16 against FP8 before and after the fused producers."""
    dev = run.device
    dtype = torch.float16 if run.smoke else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    M = 40 if run.smoke else PREFILL_M
    shapes = SMOKE_LAYER if run.smoke else {k: v for k, v in SHAPES.items() if k != "head"}
    cands = [(16, 16, 32, 1, 4, False)] if run.smoke else FP8_PREFILL_CANDIDATES
    g = torch.Generator(device=dev).manual_seed(11)
    out: dict = {"M": M, "tiles": [], "layer": None, "model": None, "table": {}}
    weights = {}
    for name, (K, N) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        x = torch.randn(M, K, device=dev, generator=g).to(dtype)
        wq = quantize_weight(w, "fp8")
        w8, ws = wq["qweight"], wq["scales"].float()
        weights[name] = (w, w8, ws)
        a8, a_s = quantize_fp8(x, per_row=True)
        want = fp8_matmul_ref(a8, a_s, w8, ws) if run.smoke else torch._scaled_mm(
            a8, w8.t(), scale_a=a_s, scale_b=ws.reshape(1, -1).contiguous(), out_dtype=dtype)  # fmt: skip
        fns = {"cublas_bf16": lambda x=x, w=w: F.linear(x, w)}
        if not run.smoke:
            ws_row = ws.reshape(1, -1).contiguous()
            fns["scaled_mm"] = lambda a8=a8, a_s=a_s, w8=w8, s=ws_row: torch._scaled_mm(
                a8, w8.t(), scale_a=a_s, scale_b=s, out_dtype=dtype)  # fmt: skip
        for c in cands:

            def call(c=c, a8=a8, a_s=a_s, w8=w8, ws=ws):
                return fp8_matmul(a8, a_s, w8, ws, config=c)

            with use_backend("triton"):
                err = _try(failed, f"fp8 tile {name} {c}", lambda call=call, want=want: float(
                    (call().double() - want.double()).abs().max() / want.double().abs().max()))  # fmt: skip
            if err is not None and err < 2e-2:  # bf16 outputs of the same fp8 products: rounding apart
                fns[str(c)] = call
            elif err is not None:
                failed[f"fp8 tile {name} {c}"] = f"max error {err:.3g} of the output's max against _scaled_mm"
        with use_backend("triton"):
            t = run.timer.interleaved(fns, graph=not run.smoke)
        flop = 2 * M * N * K
        row = {"shape": name, "M": M, "K": K, "N": N,
               **{f: {"ms": round(r["ms"], 4), "TFLOPs": round(flop / r["ms"] / 1e9, 1)} for f, r in t.items()}}  # fmt: skip
        tiles = [f for f in t if f.startswith("(")]
        if tiles:
            best = min(tiles, key=lambda f: t[f]["ms"])
            rule = str(cands[0])
            row["best"] = best
            row["best_vs_rule"] = round(t[rule]["ms"] / t[best]["ms"], 3) if rule in t else None
            row["best_vs_scaled_mm"] = (
                round(t["scaled_mm"]["ms"] / t[best]["ms"], 3) if "scaled_mm" in t else None
            )
            row["best_vs_cublas_bf16"] = round(t["cublas_bf16"]["ms"] / t[best]["ms"], 3)
            if rule not in t or row["best_vs_rule"] > 1.02:
                out["table"][f"({N}, {K})"] = best
        out["tiles"].append(row)
        run.log(f"fp8 prefill {name}: best {row.get('best')} {row.get('best_vs_scaled_mm')}x _scaled_mm, "
                f"{row.get('best_vs_cublas_bf16')}x cuBLAS bf16, {row.get('best_vs_rule')}x the rule")  # fmt: skip
    with use_backend("triton"):
        out["layer"] = _fp8_layer_chain(run, weights, M, dtype, out["table"], failed)
        out["model"] = _fp8_model_prefill(run, M, dtype, out["table"], failed)
    return out


def _fp8_layer_chain(
    run: BenchRun, weights: dict, M: int, dtype, table: dict, failed: dict[str, str]
) -> dict:
    """Section 2 of fp8_prefill_section: the layer's FP8-affected chain, every form in interleaved rounds."""
    dev, d = run.device, weights["o"][0].shape[0]
    g = torch.Generator(device=dev).manual_seed(12)
    h, res, attn = (torch.randn(M, d, device=dev, generator=g).to(dtype) for _ in range(3))
    gamma = 1 + 0.1 * torch.randn(d, device=dev, generator=g).to(dtype)
    W = {k: v[0] for k, v in weights.items()}
    Q = {k: (v[1], v[2]) for k, v in weights.items()}
    Q_row = {k: (v[1], v[2].reshape(1, -1).contiguous()) for k, v in weights.items()}

    def chain(norm, act, linear):
        """add + norm -> qkv, o, add + norm -> gate_up, act -> down, as the layer runs them."""
        x, r = norm(h, gamma, 1e-6, res)
        linear(x, "qkv")
        linear(attn, "o")
        x, _ = norm(h, gamma, 1e-6, r)
        return linear(act(linear(x, "gate_up")), "down")

    def scaled(x, name):  # _scaled_mm on Fp8Rows (x quantized here where it is not)
        rows = x if isinstance(x, Fp8Rows) else Fp8Rows(*quantize_fp8(x, per_row=True), dtype)
        w8, s = Q_row[name]
        return torch._scaled_mm(rows.q, w8.t(), scale_a=rows.scale, scale_b=s, out_dtype=dtype)

    fns = {
        "bf16": lambda: chain(rmsnorm, swiglu, lambda x, n: F.linear(x, W[n])),
        "fp8_unfused": lambda: chain(rmsnorm, swiglu, lambda x, n: fp8_linear(x, *Q[n])),
        "fp8_fused": lambda: chain(rmsnorm_fp8, swiglu_fp8, lambda x, n: fp8_linear(x, *Q[n])),
    }
    if not run.smoke:  # torch._scaled_mm: cuBLAS's FP8 GEMM, on the GPU
        fns["fp8_fused_scaled_mm"] = lambda: chain(rmsnorm_fp8, swiglu_fp8, scaled)
    parts = {  # the producers alone: the 16-bit op, the op + quantize_fp8, the fused op
        "norm": lambda: rmsnorm(h, gamma, 1e-6, res),
        "norm+quantize": lambda: quantize_fp8(rmsnorm(h, gamma, 1e-6, res)[0], per_row=True),
        "norm_fp8": lambda: rmsnorm_fp8(h, gamma, 1e-6, res),
        "swiglu": lambda: swiglu(gate_up),
        "swiglu+quantize": lambda: quantize_fp8(swiglu(gate_up), per_row=True),
        "swiglu_fp8": lambda: swiglu_fp8(gate_up),
        "quantize(o input)": lambda: quantize_fp8(attn, per_row=True),
    }
    gate_up = torch.randn(M, 2 * weights["down"][0].shape[1], device=dev, generator=g).to(dtype)
    tp = run.timer.interleaved(_working(parts, failed, "fp8 producers"), graph=True)
    producers = {f: round(r["ms"] * 1e3, 2) for f, r in tp.items()}
    run.log("fp8 producers (us): " + ", ".join(f"{f} {v}" for f, v in producers.items()))
    fns = _working(fns, failed, "fp8 layer")
    t = run.timer.interleaved(fns, graph=True)
    swept = {}
    if table:  # the swept tiles, timed in their own rounds beside bf16 and the rule's fused form
        with _fp8_table(table):
            t2 = run.timer.interleaved({f: fns[f] for f in ("bf16", "fp8_fused")}, graph=True)
        swept = {"fp8_fused_swept_tiles": t2["fp8_fused"], "bf16_same_rounds": t2["bf16"]}
    ref = t["bf16"]["ms"]
    res_ = {
        f: {"ms": round(r["ms"], 4), "vs_bf16": round(ref / r["ms"], 3), "rounds": r["rounds"]}
        for f, r in t.items()
    }
    for f, r in swept.items():
        res_[f] = {"ms": round(r["ms"], 4), "rounds": r["rounds"],
                   "vs_bf16": round(swept["bf16_same_rounds"]["ms"] / r["ms"], 3)}  # fmt: skip
    run.log("fp8 layer chain: " + ", ".join(f"{f} {r['ms']} ms ({r['vs_bf16']}x)" for f, r in res_.items()))
    return {"M": M, "parts": "add+rmsnorm, qkv, o, add+rmsnorm, gate_up, swiglu, down (attention excluded)",
            **res_, "producers_us": producers}  # fmt: skip


@contextlib.contextmanager
def _fp8_table(table: dict):
    """FP8_PREFILL_TABLE holding the sweep's winners (keys "(N, K)", tiles as their str) for a while."""
    from kiln.kernels import fp8_matmul as f8

    saved = dict(f8.FP8_PREFILL_TABLE)
    f8.FP8_PREFILL_TABLE.update({ast.literal_eval(k): ast.literal_eval(v) for k, v in table.items()})
    try:
        yield
    finally:
        f8.FP8_PREFILL_TABLE.clear()
        f8.FP8_PREFILL_TABLE.update(saved)


def _config(text: str):
    """A table value as the sweep writes it: a tile tuple's repr, or DecodeConfig(kernel=..., ...)'s."""
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DecodeConfig":
        return DecodeConfig(
            *map(ast.literal_eval, node.args), **{k.arg: ast.literal_eval(k.value) for k in node.keywords}
        )
    return ast.literal_eval(node)


@contextlib.contextmanager
def _decode_tables(path: str | None):
    """DECODE_TABLE and FP8_DECODE_TABLE with a decode-sweep JSON's winners merged in (--table), for a
    while: the engine measured with a sweep's table before it is pasted into the source."""
    from kiln.kernels import fp8_matmul as f8
    from kiln.kernels import quant_matmul as qm

    saved = dict(qm.DECODE_TABLE), dict(f8.FP8_DECODE_TABLE)
    if path:
        table = json.loads(Path(path).read_text())["sweep"]["table"]
        for k, v in table.items():
            if k.startswith("fp8 "):
                f8.FP8_DECODE_TABLE[ast.literal_eval(k[4:])] = _config(v)
            else:
                qm.DECODE_TABLE[ast.literal_eval(k)] = _config(v)
        qm._PLANS.clear()  # plans made before hold the old choices
    try:
        yield
    finally:
        for live, old in zip((qm.DECODE_TABLE, f8.FP8_DECODE_TABLE), saved):
            live.clear()
            live.update(old)
        qm._PLANS.clear()


def _fp8_model_prefill(run: BenchRun, M: int, dtype, table: dict, failed: dict[str, str]) -> dict:
    """Section 3 of fp8_prefill_section: hidden states of an M-token sequence, 16-bit against FP8."""
    dev = run.device
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_hidden=96, max_seq_len=M, qkv_bias=True)  # fmt: skip
    else:
        cfg = infer_bench.qwen2_1p5b_config(max_seq_len=M)
    gen = torch.Generator(device=dev).manual_seed(13)
    ids = torch.randint(0, cfg.vocab_size, (1, M), device=dev, generator=gen)
    bf16 = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    fp8 = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    quantize_model(fp8, QuantScheme.parse("fp8"))

    def fwd(model, rows_off=False):
        def call():
            with torch.inference_mode(), _fp8_rows_off() if rows_off else contextlib.nullcontext():
                return model.hidden_states(ids)[0]

        return call

    fns = {"bf16": fwd(bf16), "fp8_unfused": fwd(fp8, rows_off=True), "fp8_fused": fwd(fp8)}
    with torch.inference_mode():
        a, b = fns["fp8_unfused"](), fns["fp8_fused"]()
    same = bool(torch.equal(a, b))  # the fused producers give the same bits
    fns = _working(fns, failed, "fp8 model")
    try:  # GPU time from CUDA graphs where the forward captures; else launches (host time shows)
        graph = not run.smoke and run.timer.graph(fns["bf16"]) is not None
    except Exception:  # noqa: BLE001 - a capture that fails: time with launches
        graph = False
    t = run.timer.interleaved(fns, rep_ms=100, graph=graph)
    if table:
        with _fp8_table(table):
            t2 = run.timer.interleaved(
                {"bf16": fns["bf16"], "fp8_fused": fns["fp8_fused"]}, rep_ms=100, graph=graph
            )
        t["fp8_fused_swept_tiles"] = {**t2["fp8_fused"], "vs": t2["bf16"]["ms"]}
    ref = t["bf16"]["ms"]
    res = {f: {"ms": round(r["ms"], 3), "vs_bf16": round(r.get("vs", ref) / r["ms"], 3), "rounds": r["rounds"]}
           for f, r in t.items()}  # fmt: skip
    run.log(f"fp8 model prefill (fused == unfused bits: {same}): "
            + ", ".join(f"{f} {r['ms']} ms ({r['vs_bf16']}x)" for f, r in res.items()))  # fmt: skip
    del bf16, fp8
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": M, "cuda_graphs": graph, "fused_bits_equal_unfused": same, **res}


def engine_section(run: BenchRun, prompt: int, new: int, rounds: int, failed: dict[str, str]) -> dict:
    dev = run.device
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_hidden=256, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
        batches, prompt, new, rounds, schemes = [1, 4], 8, 4, 1, ("bf16", "int8", "int4-g128")
    else:
        cfg = infer_bench.qwen2_1p5b_config(max_seq_len=prompt + new + 16)
        batches, schemes = [1, 16], ENGINE_SCHEMES
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    blocks = max(batches) * (prompt + new + 32) // 16 + 64
    engines, weight_bytes = {}, {}

    def build(s: str) -> LLM:
        model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
        if s != "bf16":
            quantize_model(model, QuantScheme.parse(s))
        weight_bytes[s] = sum(
            m.weight_bytes() if isinstance(m, QuantLinear) else sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
            for m in model.modules()
        )  # fmt: skip
        return LLM(
            model, device=str(dev), max_num_seqs=max(batches), block_size=16, num_blocks=blocks, log=None
        )

    for s in schemes:
        llm = _try(failed, f"engine {s}", lambda s=s: build(s))
        if llm is not None:
            engines[s] = llm
        gc.collect()
    schemes = [s for s in schemes if s in engines]
    out = {"model": "tiny (smoke)" if run.smoke else "random-init Qwen2.5-1.5B shape", "prompt": prompt, "new": new,
           "weight_GB": {s: round(b / 1e9, 3) for s, b in weight_bytes.items()}, "batches": []}  # fmt: skip
    for B in batches:
        live = []  # warm-up: compiles every kernel of this batch size (and captures its graphs)
        for s in schemes:
            warm = _try(failed, f"engine {s} batch {B}",
                        lambda s=s, B=B: infer_bench.measure(engines[s].engine, B, prompt, min(new, 8), seed=-B))  # fmt: skip
            if warm is not None:
                live.append(s)
        tps: dict[str, list[float]] = {s: [] for s in live}
        for r in range(rounds):  # alternated: host noise hits every scheme alike
            for s in live:
                tps[s].append(
                    infer_bench.measure(engines[s].engine, B, prompt, new, seed=1000 * B + r)["decode_tok_s"]
                )
        med = {s: statistics.median(v) for s, v in tps.items()}
        ref = med.get("bf16")
        row = {"batch": B, **{s: {"decode_tok_s": med[s], "rounds": v, "vs_bf16": round(med[s] / ref, 3) if ref else None}
                              for s, v in tps.items()}}  # fmt: skip
        out["batches"].append(row)
        run.log(f"engine batch {B}: " + ", ".join(f"{s} {med[s]} tok/s ({row[s]['vs_bf16']}x)" for s in live))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)


@torch.no_grad()
def logit_section(run: BenchRun) -> list[dict]:
    """Random-init Qwen2.5-1.5B shape: each scheme's logits against bf16's on 4 x 256 random tokens (relative
    L2 error, and how often the argmax agrees)."""
    dev = run.device
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_hidden=256, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
    else:
        cfg = infer_bench.qwen2_1p5b_config(max_seq_len=512)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ids = torch.randint(
        0, cfg.vocab_size, (4, 32 if run.smoke else 256), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(dev)
    ref = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()(ids).float()
    rows = []
    for s in ENGINE_SCHEMES[1:]:
        model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
        quantize_model(model, QuantScheme.parse(s))
        got = model(ids).float()
        rows.append({"scheme": s, "logits_rel_err": _rel(got, ref),
                     "top1_agree": round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4)})  # fmt: skip
        run.log(f"logits {s}: {rows[-1]}")
        del model, got
    return rows


@torch.no_grad()
def perplexity_section(run: BenchRun, model_path: str, text_path: str, tokens: int) -> list[dict]:
    """A model kiln trained (a run directory or any model source) on held-out text: perplexity and bits per
    byte in bf16 and each scheme; GPTQ (int4-g128) calibrated on a separate first part of the text."""
    import math

    from kiln.model.checkpoint import load_source, tokenizer_dir
    from kiln.tokenizer import Tokenizer

    dev = run.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok_dir = tokenizer_dir(model_path)
    if tok_dir is None:
        raise SystemExit(f"--quality-model {model_path}: no tokenizer found with it")
    tok = Tokenizer.load(tok_dir)
    ids = tok.encode_ordinary(Path(text_path).read_text(encoding="utf-8"))
    T = min(1024, load_source(model_path, "cpu", torch.float32)[0].config.max_seq_len)
    calib_ids, held = ids[: 64 * T][: len(ids) // 2], ids[len(ids) // 2 :][:tokens]
    n = len(held) // T
    if n == 0 or len(calib_ids) < T:
        raise SystemExit(f"--quality-text {text_path}: too short for {T}-token windows")
    held_t = torch.tensor(held[: n * T], device=dev).view(n, T)
    n_bytes = len(tok.decode(held[: n * T]).encode("utf-8"))
    calib = list(torch.tensor(calib_ids[: len(calib_ids) // T * T], device=dev).view(-1, T).split(8))
    # label -> (scheme, options): the schemes as shipped (head quantized), GPTQ with and without act-order,
    # and int4 with the head left in float, which separates the head's share of the loss from the blocks'
    schemes = {
        "bf16": None,
        "int8": ("int8", {}),
        "int4-g128": ("int4-g128", {}),
        "int4-g128-gptq": ("int4-g128", {"method": "gptq"}),
        "int4-g128-gptq-act-order": ("int4-g128", {"method": "gptq", "act_order": True}),
        "int4-g128 (head float)": ("int4-g128", {"head": False}),
        "int4-g128-gptq (head float)": ("int4-g128", {"method": "gptq", "head": False}),
        "fp8": ("fp8", {}),
    }
    rows = []
    for s, spec in schemes.items():
        model = load_source(model_path, dev, torch.float32)[0].eval()
        if spec is not None:
            sch = QuantScheme.parse(spec[0], **spec[1])
            quantize_model(model, sch, calib if sch.method == "gptq" else None)
        model = model.to(dtype)
        nats = 0.0
        for w in held_t.split(4):
            logits = model(w).float()
            nats += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                          reduction="sum"))  # fmt: skip
        count = held_t.shape[0] * (T - 1)
        rows.append({"scheme": s, "ppl": round(math.exp(nats / count), 4),
                     "bits_per_byte": round(nats / math.log(2) / n_bytes * n * T / count, 5)})  # fmt: skip
        run.log(f"perplexity {s}: {rows[-1]}")
        del model
    return rows


# ------------------------------------------------------------------------------------ the decode sweep
SWEEP_FORMATS = {"int4-g128": ("int4", 128, False), "int8": ("int8", 0, False),
                 "int4-g128-asym": ("int4", 128, True), "fp8": ("fp8", 0, False)}  # fmt: skip
SWEEP_L2_BYTES = 160e6  # weights cycled through per timed pass: > 3x the H200's 50 MB L2, as a decode step is


def _split(N: int, K: int, bn: int, bk: int, sms: int) -> int:
    """A K split (1, 2, 4 or 8) giving about two programs per SM when N / bn column blocks do not, with
    every slice at least two K steps."""
    blocks = -(-N // bn)
    sk = 1
    while sk < 8 and blocks * sk < 2 * sms and K // (2 * sk * bk) >= 2:
        sk *= 2
    return sk


def sweep_candidates(fmt: str, M: int, N: int, K: int, sms: int, smoke: bool) -> list[tuple[str, object]]:
    """(label, config) per candidate: "rule" (the launcher's own choice, config None) first, then decode
    configs of every form that can take (fmt, M). fp8 configs are fp8_matmul tile tuples
    (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). The same list on every process (the warm-up workers)."""
    kind, group, _ = SWEEP_FORMATS[fmt]
    out: list[tuple[str, object]] = [("rule", None)]
    if kind == "fp8":  # fp8_matmul's tile kernel with narrower tiles, and its decode kernel with a K split
        if not smoke:
            out.append(("tile (64, 64, 128, 4, 4)", (64, 64, 128, 4, 4)))
            for bn, bk, w, st in [
                (64, 128, 4, 3),
                (64, 256, 4, 3),
                (32, 128, 4, 4),
                (16, 256, 4, 4),
                (128, 128, 8, 3),
            ]:
                sk = _split(N, K, bn, bk, sms)
                out.append((f"dot {bn}x{bk} w{w} s{st} sk{sk}", DecodeConfig("dot", bn, bk, sk, w, st)))
        return out
    if smoke:  # interpreter-sized tiles: every form once, with a K split
        if M == 1:
            return out + [("fma", DecodeConfig("fma", 8, 64)), ("fma sk", DecodeConfig("fma", 8, 64, 2))]
        return out + [("mma", DecodeConfig("mma", 16, 32)), ("mma sk", DecodeConfig("mma", 16, 32, 2))]
    if M == 1:
        # (BLOCK_N, BLOCK_K, warps, stages); the K split from the shape
        # 16 x 256 and 32 x 256 at 2 warps give a thread 2 and 8 rows of the same words' columns (fewer SASS
        # instructions a weight: 7.2 and 6.9 against 8.0 at 8 x 256, compiled for sm_90)
        # 128-wide K steps hold one int4-g128 group, 256-wide two: one scale a row per group and step
        # instead of one a word (4.5-5.1 instructions a weight at 32 x 128 / 16-32 x 256 on 2 warps)
        tiles = [(4, 256, 2, 3), (8, 256, 2, 3), (8, 256, 4, 4), (16, 256, 4, 3), (8, 512, 4, 3),
                 (16, 128, 4, 4), (32, 128, 4, 3), (16, 256, 2, 3), (32, 256, 2, 3),
                 (16, 128, 2, 4), (32, 128, 2, 3), (32, 128, 2, 4), (64, 128, 4, 4),
                 (16, 128, 2, 6), (16, 128, 2, 8), (32, 128, 2, 6), (32, 128, 4, 6), (8, 128, 1, 8)]  # fmt: skip
        for bn, bk, w, st in tiles:
            sk = _split(N, K, bn, bk, sms)
            out.append((f"fma {bn}x{bk} w{w} s{st} sk{sk}", DecodeConfig("fma", bn, bk, sk, w, st)))
        sk = _split(N, K, 4, 256, sms)
        out.append((f"gemv 4x256 w2 s3 sk{sk}", DecodeConfig("gemv", 4, 256, sk, 2, 3)))
        # tensor cores at one row too: fewer instructions per int4 weight than the FMAs
        mma = [(64, 128, 4, 3), (32, 128, 4, 3)] + (
            [(16, 128, 4, 3), (128, 128, 8, 3)] if kind == "int4" else []
        )
    elif kind == "int4":
        mma = [
            (64, 128, 4, 3),
            (64, 64, 4, 4),
            (32, 128, 4, 3),
            (16, 128, 4, 3),
            (16, 64, 4, 4),
            (128, 128, 8, 3),
        ]
    else:  # int8: mma (bytes as two nibbles), then the old dot tiles
        mma = [(64, 128, 4, 3), (64, 256, 4, 3), (32, 128, 4, 3), (16, 128, 4, 3), (128, 128, 8, 3)]
    for bn, bk, w, st in mma:
        bk = min(bk, group) if kind == "int4" else bk  # int4: one group (or part of one) per K step
        sk = _split(N, K, bn, bk, sms)
        out.append((f"mma {bn}x{bk} w{w} s{st} sk{sk}", DecodeConfig("mma", bn, bk, sk, w, st)))
        if M > 1 and sk > 1 and bn == 64 and bk == 128:
            out.append((f"mma {bn}x{bk} w{w} s{st} sk1", DecodeConfig("mma", bn, bk, 1, w, st)))
    if M > 1 and kind == "int8":
        for bn, bk, w, st in [
            (64, 128, 4, 3),
            (32, 128, 4, 3),
            (16, 128, 4, 3),
            (16, 256, 1, 4),
            (64, 64, 4, 4),
        ]:
            sk = _split(N, K, bn, bk, sms)
            out.append((f"dot {bn}x{bk} w{w} s{st} sk{sk}", DecodeConfig("dot", bn, bk, sk, w, st)))
    return out


def _sweep_weights(fmt: str, w: torch.Tensor) -> dict:
    kind, group, asym = SWEEP_FORMATS[fmt]
    return quantize_weight(w, kind, group, asymmetric=asym)


def _sweep_call(fmt: str, x: torch.Tensor, q: dict, config) -> torch.Tensor:
    kind, group, _ = SWEEP_FORMATS[fmt]
    if kind == "fp8":  # as fp8_linear (the engine's path), with a chosen config
        w8 = q["qweight"].view(FP8)
        if config is None:  # the rule: fp8_linear itself, as the engine calls it
            return fp8_linear(x, w8, q["scales"])
        if isinstance(config, DecodeConfig):  # the decode kernel quantizes x itself
            return fp8_decode_linear(x, w8, q["scales"], None, config)
        a8, a_s = quantize_fp8(x, per_row=True)
        return fp8_matmul(a8, a_s, w8, q["scales"], None, x.dtype, config=config)
    bits = 4 if kind == "int4" else 8
    return wq_matmul_fwd(x, q["qweight"], q["scales"], q["zeros"], bits, group, config=config)


def _sweep_ref(fmt: str, x: torch.Tensor, q: dict, config=None) -> torch.Tensor:
    """The product a candidate computes, in float32; for FP8, with x quantized as that candidate (the rule:
    as fp8_linear) quantizes it."""
    kind, group, _ = SWEEP_FORMATS[fmt]
    if kind == "fp8" and config is None:  # the rule is fp8_linear, which may take a decode config itself
        config = fp8_linear_decode_config(x.shape[0], q["qweight"].shape[0], x.shape[1])
    if kind == "fp8" and isinstance(config, DecodeConfig):  # x quantized per (row, K slice) of the split
        return fp8_decode_linear_ref(x, q["qweight"].view(FP8), q["scales"], None, config, torch.float32)
    if kind == "fp8":  # x quantized per row, then the float32 product
        a8, a_s = quantize_fp8_ref(x, per_row=True)
        return fp8_matmul_ref(a8, a_s, q["qweight"].view(FP8), q["scales"], None, torch.float32)
    return wq_matmul_ref(x.float(), q["qweight"], q["scales"], q["zeros"], 4 if kind == "int4" else 8, group)


@functools.lru_cache(maxsize=2)
def _warm_tensors(fmt: str, M: int, K: int, N: int) -> tuple[torch.Tensor, dict]:
    """x and the quantized weight of one (format, shape, M), on the GPU (a warm-up worker's)."""
    w = torch.randn(N, K, device="cuda").div_(K**0.5).to(torch.bfloat16)
    return torch.randn(M, K, device="cuda", dtype=torch.bfloat16), _sweep_weights(fmt, w)


def _warm_worker(task: tuple[str, int, int, int, object]) -> bool:
    """In a spawned process: run one candidate (format, M, K, N, config) once on random tensors of the
    real shape, so that Triton compiles it into the on-disk cache that the timing process then reads."""
    fmt, M, K, N, cfg = task
    x, q = _warm_tensors(fmt, M, K, N)
    try:
        _sweep_call(fmt, x, q, cfg)
        torch.cuda.synchronize()
        return True
    except Exception:  # the timing process records the failure with its traceback
        return False


def _precompile(tasks: list, jobs: int, deadline_s: float, run: BenchRun) -> dict:
    """Compile every candidate in `jobs` spawned processes at once (Triton compiles one kernel at a time
    per process; ~300 variants would take the whole budget serially), for at most `deadline_s` seconds.
    Best effort: what is not compiled by then (or on any failure) the timing loop compiles itself."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = run.elapsed()
    info: dict = {"jobs": jobs, "kernels": len(tasks)}
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
    try:
        futures = [pool.submit(_warm_worker, t) for t in tasks]
        done, pending = cf.wait(futures, timeout=deadline_s)
        info.update(ran=sum(1 for f in done if f.exception() is None and f.result()), unfinished=len(pending))
    except Exception:
        info["error"] = traceback.format_exc()[-2000:]
    finally:  # workers still compiling finish their one kernel in the background; queued ones are dropped
        pool.shutdown(wait=False, cancel_futures=True)
    info["s"] = round(run.elapsed() - t0, 1)
    run.log(f"sweep: precompile {info}")
    return info


def _rotating(make, nbytes: int, smoke: bool) -> list:
    """Enough copies of a weight (make() -> one copy) that cycling through them misses the L2 cache."""
    n = 1 if smoke else max(1, min(64, int(-(-SWEEP_L2_BYTES // nbytes))))
    return [make() for _ in range(n)]


class _GraphTimer:
    """One candidate's calls, each on its own weight copy, captured in a CUDA graph repeated to about
    `target_ms` of GPU time; `us()` replays it once between CUDA events: microseconds per call."""

    def __init__(self, calls: list, target_ms: float = 1.0):
        for c in calls:
            c()
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for c in calls:
            c()
        t1.record()
        torch.cuda.synchronize()
        per = max(t0.elapsed_time(t1) / len(calls), 1e-3)  # eager ms per call: launch-bound, an upper bound
        self.reps = max(1, min(200, int(target_ms / per / len(calls)) + 1))
        self.n = self.reps * len(calls)
        self.graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:  # warm-up on the capture stream, as torch.cuda.graphs recommends
                c()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph):
            for _ in range(self.reps):
                for c in calls:
                    c()
        self.graph.replay()
        torch.cuda.synchronize()
        self.t0, self.t1 = t0, t1

    def us(self) -> float:
        self.t0.record()
        self.graph.replay()
        self.t1.record()
        self.t1.synchronize()
        return self.t0.elapsed_time(self.t1) * 1e3 / self.n


def sweep_section(
    run: BenchRun, budget_s: float, jobs: int, failed: dict[str, str], save, rounds: int = 5,
    rows: tuple[int, ...] | None = None, formats: tuple[str, ...] | None = None,
) -> dict:  # fmt: skip
    """Every candidate decode config of each format on each Qwen2.5-1.5B projection at 1, 4 and 16 rows,
    against cuBLAS bf16 (F.linear) and kiln's bf16 decode matmul in the same run: GPU time per call in
    CUDA graphs, each call reading its own weight copy (the working set past L2, as in a decode step),
    candidates interleaved in a fresh order over `rounds` rounds, medians. Stops starting new cases when
    `budget_s` seconds of the run have passed (cases ordered 1 row, 16 rows, 4 rows); `save(out)` after
    every case, so a run cut short keeps what it measured. rows / formats: only these row counts and
    formats (--rows, --formats)."""
    dev = run.device
    smoke = run.smoke
    shapes, row_counts = (SMOKE_SHAPES, (1, 4)) if smoke else (SHAPES, (1, 16, 4))
    row_counts = tuple(m for m in row_counts if rows is None or m in rows)
    fmts = [f for f in SWEEP_FORMATS if not (smoke and f == "fp8") and (formats is None or f in formats)]
    sms = sm_count(dev)
    dtype = torch.float16 if smoke else torch.bfloat16
    copy = run.ceilings.get("copy_TBps")
    cases = [(M, name, fmt) for M in row_counts for name in shapes for fmt in fmts]
    out: dict = {"budget_s": budget_s, "rounds": rounds, "l2_rotation_bytes": SWEEP_L2_BYTES, "sms": sms,
                 "cases": [], "not_run": []}  # fmt: skip
    if not smoke and jobs > 1:
        # One task per distinct kernel: Triton specializes ints by == 1 and % 16, which M = 1, 4 and 16
        # tell apart and the five shapes do not (N, K and the row strides are multiples of 16 in all, the
        # int4 scale rows 12 and 70 in both), so a config runs once per format and row count; the rule's
        # choice depends on the shape, so it runs per shape.
        tasks, seen = [], set()
        for M, name, fmt in cases:
            K, N = shapes[name]
            for _, cfg in sweep_candidates(fmt, M, N, K, sms, smoke):
                key = (fmt, M, name if cfg is None else cfg)
                if key not in seen:
                    seen.add(key)
                    tasks.append((fmt, M, K, N, cfg))
        out["precompile"] = _precompile(tasks, jobs, budget_s / 2, run)
    g = torch.Generator(device=dev).manual_seed(0)
    weights = {
        name: (torch.randn(N, K, device=dev, generator=g) / K**0.5).to(dtype)
        for name, (K, N) in shapes.items()
    }
    base: dict[tuple[str, int], dict] = {}  # (shape, M) -> bf16 peers' timers
    xs: dict[tuple[str, int], torch.Tensor] = {}
    for M, name, fmt in cases:
        if run.elapsed() > budget_s:
            out["not_run"].append(f"{fmt} {name} M={M}")
            continue
        K, N = shapes[name]
        w = weights[name]
        if (name, M) not in xs:  # one x per (shape, rows): every format sees the same activations
            xs[(name, M)] = torch.randn(M, K, device=dev, generator=g).to(dtype)
        x = xs[(name, M)]
        label = f"sweep {fmt} {name} M={M}"
        try:
            q0 = _sweep_weights(fmt, w)
            nbytes = _bytes(q0)
            qs = _rotating(
                lambda q0=q0: {k: None if t is None else t.clone() for k, t in q0.items()}, nbytes, smoke
            )
            want = _sweep_ref(fmt, x, q0)
            scale = float(want.abs().max())
            timers, errs = {}, {}
            if (name, M) not in base and not smoke:
                ws = _rotating(w.clone, N * K * 2, smoke)
                base[(name, M)] = {
                    "cublas_bf16": _GraphTimer([lambda x=x, w=w_: F.linear(x, w) for w_ in ws]),
                    "kiln_bf16": _GraphTimer([lambda x=x, w=w_: linear(x, w) for w_ in ws]),
                }
            configs = dict(sweep_candidates(fmt, M, N, K, sms, smoke))
            with use_backend("triton"):
                for lab, cfg in configs.items():
                    try:
                        got = _sweep_call(fmt, x, q0, cfg)
                        # against the candidate's own quantization (a split FP8 one quantizes x per K
                        # slice), relative to the output's max
                        ref = _sweep_ref(fmt, x, q0, cfg) if fmt == "fp8" else want
                        errs[lab] = float((got.float() - ref).abs().max()) / scale
                        if not errs[lab] < 0.05:  # a wrong kernel is a failure, never a winner
                            raise AssertionError(f"max error {errs[lab]:.4g} of the output's max")
                        if not smoke:
                            timers[lab] = _GraphTimer(
                                [lambda f=fmt, x=x, q=q, c=cfg: _sweep_call(f, x, q, c) for q in qs]
                            )
                    except Exception:
                        failed[f"{label} {lab}"] = traceback.format_exc()[-3000:]
            if smoke:
                times = {lab: float("nan") for lab in errs if f"{label} {lab}" not in failed}
            else:
                everyone = {**base[(name, M)], **timers}
                samples: dict[str, list[float]] = {k: [] for k in everyone}
                order = list(everyone)
                rng = random.Random(M * 7919 + len(out["cases"]))
                for _ in range(rounds):
                    rng.shuffle(order)
                    for k in order:
                        samples[k].append(everyone[k].us())
                times = {k: statistics.median(v) for k, v in samples.items() if k in timers}
                peers = {k: statistics.median(samples[k]) for k in base[(name, M)]}
                del timers, everyone
            ref_us = None if smoke else peers["cublas_bf16"]
            cands = []
            for lab, us in times.items():
                gbps = nbytes / us / 1e3 if us == us else None
                cands.append({"candidate": lab, "config": repr(configs[lab]), "us": round(us, 3) if us == us else None,
                              "GBps": round(gbps, 1) if gbps else None,
                              "frac_copy": fraction(gbps / 1e3, copy) if gbps and copy else None,
                              "vs_cublas_bf16": round(ref_us / us, 3) if ref_us else None,
                              "max_rel_err": round(errs[lab], 5)})  # fmt: skip
            cands.sort(key=lambda c: c["us"] if c["us"] is not None else float("inf"))
            row = {"format": fmt, "shape": name, "M": M, "N": N, "K": K, "weight_bytes": nbytes,
                   "candidates": cands, "best": cands[0] if cands else None}  # fmt: skip
            if not smoke:
                row["cublas_bf16_us"] = round(peers["cublas_bf16"], 3)
                row["kiln_bf16_us"] = round(peers["kiln_bf16"], 3)
                row["rule"] = next((c for c in cands if c["candidate"] == "rule"), None)
            out["cases"].append(row)
            best = row["best"]
            run.log(f"{label}: best {best['candidate'] if best else None} {best['us'] if best else None} us"
                    + (f" ({best['vs_cublas_bf16']}x cuBLAS bf16 {row['cublas_bf16_us']} us; rule "
                       f"{row['rule']['us'] if row['rule'] else None} us)" if best and not smoke else ""))  # fmt: skip
            del qs
        except Exception:
            failed[label] = traceback.format_exc()[-3000:]
        out["table"] = sweep_table(out["cases"])
        save(out)
    out["table"] = sweep_table(out["cases"])
    return out


def sweep_table(cases: list[dict]) -> dict[str, str]:
    """The winners where they beat the rule by more than 2% (a tie keeps the rule): for the int formats
    quant_matmul.DECODE_TABLE entries, '("fmt", M, N, K)' -> the DecodeConfig's repr, ready to paste;
    for fp8, "fp8 (M, N, K)" -> a tile tuple or DecodeConfig, fp8_matmul.FP8_DECODE_TABLE's entries."""
    table = {}
    for c in cases:
        best, rule = c.get("best"), c.get("rule")
        if not best or best["candidate"] == "rule" or best["us"] is None:
            continue
        if rule and rule["us"] and rule["us"] <= best["us"] * 1.02:
            continue
        fp8 = c["format"] == "fp8"
        key = repr((c["M"], c["N"], c["K"]) if fp8 else (c["format"], c["M"], c["N"], c["K"]))
        table[("fp8 " if fp8 else "") + key] = best["config"]
    return table


def quality_main(args) -> int:
    """--case quality: what each scheme costs in accuracy, apart from any timing. The numbers are the
    quantization's own (the kernels equal their references, tests/kernels), so a machine without a GPU
    computes them at full size: float32 there, which isolates the quantization error from bf16's rounding
    (on a GPU the model runs in bf16, as the engine does)."""
    if args.quality_model and not args.quality_text:
        raise SystemExit("--quality-model needs --quality-text (held-out text)")
    if not args.out and not args.smoke:
        args.out = str(default_out("quant_quality", __file__, False))
    run = BenchRun("quant", __file__, args, rounds=1, allow_cpu=True)
    failed: dict[str, str] = {}
    result: dict = {"dtype": "bfloat16" if run.device.type == "cuda" else "float32"}
    for name, fn in (
        ("logits", lambda: logit_section(run)),
        ("perplexity", lambda: perplexity_section(run, args.quality_model, args.quality_text, args.quality_tokens)),
    ):  # fmt: skip
        if name == "perplexity" and not args.quality_model:
            continue
        out = _try(failed, name, fn)
        if out is not None:
            result[name] = out
        run.write(complete=False, failed=failed, **result)
    run.write(complete=True, failed=failed, **result)
    return 1 if failed else 0


def main() -> int:
    ap = bench_parser("quant", __doc__)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="alternating engine rounds")
    ap.add_argument(
        "--skip", default="", help="comma-separated sections to skip: decode,prefill,logits,engine"
    )
    ap.add_argument(
        "--quality-model", help="a model kiln trained (e.g. a gpu-preset run): perplexity per scheme"
    )
    ap.add_argument(
        "--quality-text", help="held-out UTF-8 text for --quality-model (first half: GPTQ calibration)"
    )
    ap.add_argument("--quality-tokens", type=int, default=262144, help="held-out tokens to score")
    ap.add_argument("--case", choices=("all", "decode-sweep", "quality", "fp8-prefill"), default="all",
                    help="decode-sweep: only the decode config sweep, to bench/results/quant_sweep.json; "
                    "fp8-prefill: FP8 prefill tiles, layer and model against bf16, to "
                    "bench/results/quant_fp8_prefill.json; "
                    "quality: only the logit error and (with --quality-model) perplexity, on a GPU or at full "
                    "size on the CPU (float32 there), to bench/results/quant_quality.json")  # fmt: skip
    ap.add_argument(
        "--budget", type=float, default=120.0, help="decode-sweep: seconds before it stops starting cases"
    )
    ap.add_argument("--rows", help="decode-sweep: only these row counts, comma-separated (of 1,16,4)")
    ap.add_argument(
        "--formats", help=f"decode-sweep: only these formats, comma-separated (of {','.join(SWEEP_FORMATS)})"
    )
    ap.add_argument(
        "--table",
        help="a decode-sweep JSON whose winners the engine section runs with, merged "
        "over DECODE_TABLE / FP8_DECODE_TABLE (a sweep's table measured before it is pasted)",
    )
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                    help="decode-sweep: processes compiling the candidates ahead of the timing (1: none)")  # fmt: skip
    args = ap.parse_args()
    if args.case == "decode-sweep" and not args.out and not args.smoke:
        args.out = str(default_out("quant_sweep", __file__, False))
    if args.case == "quality":
        return quality_main(args)
    if args.case == "fp8-prefill" and not args.out and not args.smoke:
        args.out = str(default_out("quant_fp8_prefill", __file__, False))
    run = BenchRun("quant", __file__, args, rounds=3)
    if args.case == "fp8-prefill":
        failed = {}
        res = _try(failed, "fp8-prefill", lambda: fp8_prefill_section(run, failed))
        run.write(timing="GPU time: tiles and layer from CUDA graphs, the model with launches (do_bench), "
                  "interleaved rounds, medians", complete=res is not None, failed=failed, fp8_prefill=res)  # fmt: skip
        if res and res["table"]:
            print(
                "FP8_PREFILL_TABLE entries:\n" + "\n".join(f"    {k}: {v}," for k, v in res["table"].items())
            )
        return 1 if failed else 0
    if args.case == "decode-sweep":
        failed: dict[str, str] = {}
        timing = ("GPU time per call in CUDA graphs, each call on its own weight copy (L2-cold), candidates "
                  "interleaved over rounds, medians")  # fmt: skip
        rows = tuple(int(m) for m in args.rows.split(",")) if args.rows else None
        formats = tuple(args.formats.split(",")) if args.formats else None
        if formats and set(formats) - set(SWEEP_FORMATS):
            ap.error(
                f"--formats: unknown {sorted(set(formats) - set(SWEEP_FORMATS))}; of {list(SWEEP_FORMATS)}"
            )
        sweep = _try(failed, "decode-sweep", lambda: sweep_section(
            run, args.budget, args.jobs, failed, lambda part: run.write(timing=timing, complete=False, failed=failed, sweep=part),
            rows=rows, formats=formats))  # fmt: skip
        run.write(
            timing=timing, complete=sweep is not None and not sweep["not_run"], failed=failed, sweep=sweep
        )
        if sweep:  # the entries to paste into quant_matmul.DECODE_TABLE and fp8_matmul.FP8_DECODE_TABLE
            table = sweep["table"]
            print(
                "DECODE_TABLE entries:\n"
                + "\n".join(f"    {k}: {v}," for k, v in table.items() if k[0] == "(")
            )
            print(
                "FP8_DECODE_TABLE entries:\n"
                + "\n".join(f"    {k[4:]}: {v}," for k, v in table.items() if k[0] != "(")
            )
        return 1 if failed else 0
    skip = set(filter(None, args.skip.split(",")))
    # the interpreter's bf16 tl.dot is wrong (PLATFORM.md): the smoke run checks fp16
    dtype = torch.float16 if run.smoke else torch.bfloat16
    result: dict = {}
    failed: dict[str, str] = {}  # what raised: its traceback; the run goes on, writes its JSON, exits 1

    def save(done: bool) -> None:  # after every section: a run cut short keeps what it measured
        run.write(timing="decode/prefill: do_bench_cudagraph medians over interleaved rounds (GPU time); engine: "
                  "host-timed steps, medians over alternated rounds", complete=done, failed=failed,
                  cases=result.get("decode", []), **{k: v for k, v in result.items() if k != "cases"})  # fmt: skip

    def section(name: str, fn) -> None:
        if name not in skip:
            out = _try(failed, name, fn)
            if out is not None:
                result[name] = out
            save(done=False)

    section("decode", lambda: decode_section(run, dtype, failed))
    if result.get("decode"):
        table = [{"shape": r["shape"], "M": r["M"], **{f: r.get(f, {}).get("vs_cublas") for f in ("kiln_bf16", *FORMATS)},
                  "int4_GBps": r.get("int4-g128", {}).get("GBps")} for r in result["decode"]]  # fmt: skip
        cols = [("shape", "shape"), ("M", "rows"), ("kiln_bf16", "kiln bf16 x"), ("int8", "int8 x"),
                ("int4-g128", "int4-g128 x"), ("int4-g32", "int4-g32 x"), ("int4_GBps", "int4-g128 GB/s")]  # fmt: skip
        print(format_table(table, cols))
    section("prefill", lambda: prefill_section(run, dtype, failed))
    section("logits", lambda: logit_section(run))
    if args.quality_model:
        if not args.quality_text:
            raise SystemExit("--quality-model needs --quality-text (held-out text)")
        section(
            "perplexity",
            lambda: perplexity_section(run, args.quality_model, args.quality_text, args.quality_tokens),
        )
    with _decode_tables(args.table):
        section("engine", lambda: engine_section(run, args.prompt, args.new, args.rounds, failed))
    save(done=True)
    if failed:
        run.log(f"parts that failed (tracebacks in the JSON's 'failed'): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
