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

import gc
import os
import statistics
import sys
import traceback

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.infer import bench as infer_bench
from kiln.infer.engine import LLM
from kiln.kernels.dispatch import use_backend
from kiln.kernels.fp8_matmul import fp8_linear, fp8_matmul, quantize_fp8
from kiln.kernels.matmul import linear
from kiln.kernels.quant_matmul import wq_linear, wq_matmul_ref
from kiln.model.config import ModelConfig
from kiln.model.quant_linear import QuantLinear
from kiln.model.transformer import build_model
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, format_table
from kiln.quant import QuantScheme, quantize_model
from kiln.quant.rtn import quantize_weight

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
          "head": (1536, 151936)}  # fmt: skip
ROWS = (1, 4, 16)
PREFILL_M = 2048
FORMATS = {"int8": ("int8", 0), "int4-g128": ("int4", 128), "int4-g32": ("int4", 32)}
SMOKE_SHAPES = {"qkv": (128, 48), "down": (256, 40)}
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
    from pathlib import Path

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
    rows = []
    for s in ("bf16", "int8", "int4-g128", "int4-g128-gptq", "fp8"):
        model = load_source(model_path, dev, torch.float32)[0].eval()
        if s != "bf16":
            gptq = s.endswith("-gptq")
            sch = QuantScheme.parse(s.removesuffix("-gptq"), method="gptq" if gptq else "rtn")
            quantize_model(model, sch, calib if gptq else None)
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
    args = ap.parse_args()
    run = BenchRun("quant", __file__, args, rounds=3)
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
    section("engine", lambda: engine_section(run, args.prompt, args.new, args.rounds, failed))
    save(done=True)
    if failed:
        run.log(f"parts that failed (tracebacks in the JSON's 'failed'): {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
