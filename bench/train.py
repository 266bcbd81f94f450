"""Training throughput on one GPU: kiln (eager, compiled, compiled + FP8) against HF Llama + SDPA + compile
and a nanoGPT-style model + compile, at 124M, 350M and ~1B Llama shapes, sequence 2048.

    python bench/train.py                                 # the default cases, ~480 s -> bench/results/train.json
    python bench/train.py --profile                       # + the top CUDA ops of one step, kiln vs HF at 350M
                                                          #   (and kiln's FP8 contenders where they run)
    python bench/train.py --shapes 1b --contenders kiln-compiled,kiln-compiled-fp8
    python bench/train.py --case fp8-curve --steps 1000   # bf16 vs FP8 loss curves, <= 200 s -> train-fp8-curve.json
    python bench/train.py --smoke                         # the CPU, tiny shapes, seconds

A step is what `kiln run` does per micro-batch: zero the gradients, the loss forward under bf16 autocast
(fp32 master weights), backward, fused AdamW. Every contender at a shape gets the same (B, T) random-token
batches, so the same tokens per step. Contenders:
  kiln-eager            kiln's model on its Triton kernels; attention by kiln.train.kernels ("auto": kiln's
                        FlashAttention or SDPA, whichever ran the shape's forward + backward faster just now)
  kiln-compiled         the same through torch.compile of the loss module, as --train.compile does
  kiln-compiled-fp8     + KernelConfig.linear="fp8": the block linears' three GEMMs in FP8, tensorwise scales
  kiln-compiled-fp8-rowwise   (not in the default list) the same with rowwise scales
  hf-compiled           transformers' LlamaForCausalLM (attn_implementation="sdpa") with kiln's initial
                        weights (so its first loss must equal kiln's), logits -> F.cross_entropy, compiled whole
  nanogpt-compiled      bench/peers/nanogpt.py: GPT-2's architecture at the shape's width, depth and heads
Times are the median of --rounds rounds of --steps steps after --warmup steps (the compile happens there);
tokens/s = B * T / step time. MFU = tokens/s x the model's training FLOPs per token (6N plus causal
attention, kiln.model.ModelConfig.flops_per_token) over the dense bf16 spec of the H100/H200 SXM
(989.5 TFLOP/s), and over the bf16 matmul rate measured at the start of the run. Peak memory is
torch.cuda.max_memory_allocated over the case. `vs_best_peer` is tokens/s over the faster of HF and
nanoGPT at that shape.

Cases run most important first (350M and 1B: kiln compiled, then HF compiled, ...). A case that would
end after --budget seconds (expected to take as long as the longest case so far) is recorded as skipped. The JSON is rewritten after every case, so a run
cut short keeps what it measured. A case that fails (out of memory, a compile error) is recorded with
its error, and the run goes on.

--case fp8-curve trains kiln's 124M shape (vocab 256: bytes of the bundled Python-stdlib corpus, no
tokenizer to train) for --steps steps three or four times on the same batches: bf16, bf16 from another
init seed (the noise a curve comparison must be read against), FP8 tensorwise, FP8 rowwise when the
budget allows; eagerly, or through torch.compile with --compile (the path the throughput cases
time). It records each curve (the mean loss per 10 steps), the validation loss at the end, and the mean |difference| to the bf16 curve.
--smoke compiles with backend="aot_eager" (Dynamo and AOTAutograd as on the GPU, no inductor codegen,
which takes minutes on 2 CPU cores).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton (kiln.profile.harness)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/peers

from kiln.dist.memory import GIB, estimate
from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.io.atomic import atomic_write_png
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig
from kiln.profile.harness import BenchRun, bench_parser, format_table
from kiln.train.kernels import resolve_kernels
from peers.nanogpt import NanoGPTConfig, build_nanogpt

SPEC_BF16_FLOPS = 989.5e12  # dense bf16 of the H100/H200 SXM datasheet: the figure MFU is quoted against

# Llama-style shapes (untied head, GQA, SwiGLU, vocab 32768, seq 2048) and their batch (sequences/step)
SHAPES: dict[str, tuple[ModelConfig, int]] = {
    # 125.8M parameters: GPT-2 small's width and depth
    "124m": (ModelConfig(arch="llama", vocab_size=32768, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                         ffn_hidden=2048, max_seq_len=2048), 16),
    # 337.6M: the 350M shape
    "350m": (ModelConfig(arch="llama", vocab_size=32768, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=4,
                         ffn_hidden=2816, max_seq_len=2048), 16),
    # 1.10B: TinyLlama-1.1B's shape with a 32768 vocab; 8 x 2048 tokens per step (half the others: memory)
    "1b": (ModelConfig(arch="llama", vocab_size=32768, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4,
                       ffn_hidden=5632, max_seq_len=2048), 8),
}  # fmt: skip
SMOKE_SHAPE = (ModelConfig(arch="llama", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                           ffn_hidden=128, max_seq_len=64), 2)  # fmt: skip
# the fp8-curve runs: (label, --kernels.linear, init seed); bf16 first, the reference the others are read against
CURVE_RUNS = (
    ("bf16", "auto", 0),
    ("bf16-seed1", "auto", 1),
    ("fp8", "fp8", 0),
    ("fp8-rowwise", "fp8_rowwise", 0),
)
CONTENDERS = ("kiln-eager", "kiln-compiled", "kiln-compiled-fp8", "kiln-compiled-fp8-rowwise", "hf-compiled",
              "nanogpt-compiled")  # fmt: skip
PEERS = ("hf-compiled", "nanogpt-compiled")
# the default run, most important first: kiln compiled vs HF compiled at 350M and 1B, then FP8, then the rest
DEFAULT_CASES = [
    ("350m", "kiln-compiled"), ("350m", "hf-compiled"), ("1b", "kiln-compiled"), ("1b", "hf-compiled"),
    ("1b", "kiln-compiled-fp8"), ("350m", "kiln-compiled-fp8"), ("350m", "nanogpt-compiled"),
    ("1b", "nanogpt-compiled"), ("350m", "kiln-eager"), ("1b", "kiln-eager"),
    ("124m", "kiln-compiled"), ("124m", "hf-compiled"), ("124m", "nanogpt-compiled"),
    ("124m", "kiln-compiled-fp8"), ("124m", "kiln-eager"),
]  # fmt: skip
PROFILE_SHAPE = "350m"
PROFILED = (
    "kiln-compiled",
    "hf-compiled",
    "kiln-compiled-fp8",
    "kiln-compiled-fp8-rowwise",
)  # with --profile


class KilnLoss(torch.nn.Module):
    """forward(x, y) -> mean loss: what kiln.train.loop compiles for --train.compile."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


class HFLoss(torch.nn.Module):
    """forward(x, y) -> mean cross-entropy of a transformers causal LM's logits against y (no shift: y is
    already the next token)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=x, use_cache=False).logits  # (B, T, V); no KV cache in training
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), y.view(-1))


def hf_llama(model) -> torch.nn.Module:
    """transformers' LlamaForCausalLM, SDPA attention, float32, holding a copy of kiln `model`'s weights."""
    import transformers

    from kiln.model.hf import state_to_hf
    from kiln.model.hf_config import config_to_hf

    d = config_to_hf(model.config, "float32")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(model.head_weight.device):
        hf = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, attn_implementation="sdpa", dtype=torch.float32
        )
    missing, unexpected = hf.load_state_dict(state_to_hf(model.config, model.state_dict()), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"HF peer: weights do not match: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    return hf.train()


def warm_rope(model, device: torch.device) -> None:
    """Fill RoPE's per-device frequency memo before compiling, as kiln.train.loop does: traced empty, the
    memo's guard fails on the second call and the whole model compiles twice."""
    if model.rope is not None:
        model.rope(torch.zeros((1, 1), dtype=torch.long, device=device))


def decay_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    ps = list(module.parameters())
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def autocast(device: torch.device, dtype: torch.dtype | None):
    """bf16 autocast on the GPU; nothing (float32) in a CPU smoke run."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


class Contender:
    """One model at one shape: its loss module (compiled or not), optimizer, parameter count and FLOPs."""

    def __init__(self, name: str, cfg: ModelConfig, B: int, T: int, device: torch.device, smoke: bool,
                 attention_cache: dict):  # fmt: skip
        self.name, self.info = name, {}
        compiled = "compiled" in name
        if name.startswith("kiln"):
            linear = {"kiln-compiled-fp8": "fp8", "kiln-compiled-fp8-rowwise": "fp8_rowwise"}.get(
                name, "auto"
            )
            # one attention measurement per shape, shared by its cases
            key = (cfg.d_model, cfg.n_layers, B, T)
            if key not in attention_cache:
                attention_cache[key] = resolve_kernels(
                    KernelConfig(attention="auto"), cfg, B, T, device, torch.bfloat16
                )
            resolved, why = attention_cache[key]
            kernels = dataclasses.replace(resolved, linear=linear)
            model = build_model(cfg, device=device, seed=0, kernels=kernels).train()
            warm_rope(model, device)
            module = KilnLoss(model)
            groups = model.param_groups(0.1)
            self.flops_per_token = cfg.flops_per_token(T)
            dims = ParallelDims.resolve(ParallelConfig(), 1)
            est = estimate(cfg, dims, B, T, "none", compute_bytes=2)
            self.info = {"kernels": dataclasses.asdict(kernels), "attention_choice": why,
                         "mem_estimate_gib": round(est["total"] / GIB, 2)}  # fmt: skip
        elif name == "hf-compiled":
            kiln_model = build_model(cfg, device=device, seed=0)
            module = HFLoss(hf_llama(kiln_model))
            del kiln_model
            groups = decay_groups(module, 0.1)
            self.flops_per_token = cfg.flops_per_token(T)
        elif name == "nanogpt-compiled":
            ncfg = NanoGPTConfig(cfg.vocab_size, cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.max_seq_len)
            model = build_nanogpt(ncfg, device, seed=0).train()
            module = KilnLoss(model)
            groups = model.param_groups(0.1)
            self.flops_per_token = ncfg.flops_per_token(T)
            self.info = {"nanogpt_shape": dataclasses.asdict(ncfg)}
        else:
            raise ValueError(f"unknown contender {name!r}: choose from {', '.join(CONTENDERS)}")
        self.module = module
        self.params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        self.loss_fn = module
        if compiled:
            self.loss_fn = torch.compile(module, backend="aot_eager" if smoke else "inductor")
        fused = device.type == "cuda"
        self.opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=fused or None)
        self.device = device
        self.amp = torch.bfloat16 if device.type == "cuda" else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        with autocast(self.device, self.amp):
            loss = self.loss_fn(x, y)
        loss.backward()
        self.opt.step()
        return loss.detach()


def top_ops(prof, n: int = 40) -> list[dict]:
    """The n events of a torch.profiler run with the most self device time (kernels, mostly)."""

    def dev(e, total: bool) -> float:
        for attr in (
            ("device_time_total", "cuda_time_total")
            if total
            else ("self_device_time_total", "self_cuda_time_total")
        ):
            if hasattr(e, attr):
                return float(getattr(e, attr))
        return 0.0

    events = list(prof.key_averages())
    on_device = sum(dev(e, False) for e in events)
    key = (lambda e: dev(e, False)) if on_device else (lambda e: float(e.self_cpu_time_total))
    rows = []
    for e in sorted(events, key=key, reverse=True)[:n]:
        rows.append({"name": e.key[:120], "count": e.count, "self_device_ms": round(dev(e, False) / 1e3, 3),
                     "device_total_ms": round(dev(e, True) / 1e3, 3),
                     "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3)})  # fmt: skip
    return [{"step_self_device_ms": round(on_device / 1e3, 3)}, *rows]


def run_case(run: BenchRun, shape: str, name: str, cfg: ModelConfig, B: int, args, cache: dict) -> dict:
    dev = run.device
    T = cfg.max_seq_len
    _free(dev)
    gen = torch.Generator().manual_seed(1234)
    batches = [
        tuple(t.to(dev) for t in torch.randint(0, cfg.vocab_size, (2, B, T), generator=gen)) for _ in range(2)
    ]
    t0 = time.perf_counter()
    c = Contender(name, cfg, B, T, dev, run.smoke, cache)
    first = float(c.step(*batches[0]))
    for i in range(1, args.warmup):
        c.step(*batches[i % 2])
    _sync(dev)
    warmup_s = time.perf_counter() - t0
    rounds = []
    for _ in range(args.rounds):
        _sync(dev)
        t = time.perf_counter()
        for i in range(args.steps):
            c.step(*batches[i % 2])
        _sync(dev)
        rounds.append((time.perf_counter() - t) / args.steps)
    step_s = statistics.median(rounds)
    tps = B * T / step_s
    flops = tps * c.flops_per_token
    measured = run.ceilings.get("bf16_matmul_TFLOPs")
    out = {
        "shape": shape, "contender": name, "params": c.params, "batch": B, "seq_len": T,
        "tokens_per_step": B * T, "flops_per_token": c.flops_per_token,
        "first_step_loss": round(first, 5), "warmup_s": round(warmup_s, 1), "step_ms": round(step_s * 1e3, 2),
        "rounds_ms": [round(r * 1e3, 2) for r in rounds], "tokens_per_s": round(tps),
        "mfu_spec": round(flops / SPEC_BF16_FLOPS, 4) if dev.type == "cuda" else None,
        "mfu_measured": round(flops / (measured * 1e12), 4) if measured else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / GIB, 2) if dev.type == "cuda" else None,
        **c.info,
    }  # fmt: skip
    if args.profile and shape == args.profile_shape and name in PROFILED:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            c.step(*batches[0])
            _sync(dev)
        out["profile_top_ops"] = top_ops(prof)
    del c, batches
    _free(dev)
    return out


def pick_cases(args) -> list[tuple[str, str]]:
    shapes = args.shapes.split(",") if args.shapes else None
    names = args.contenders.split(",") if args.contenders else None
    for s in shapes or []:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    for n in names or []:
        if n not in CONTENDERS:
            raise SystemExit(f"--contenders: unknown contender {n!r}; choose from {', '.join(CONTENDERS)}")
    if shapes or names:  # every combination asked for, in the default order where it has one
        want = [(s, n) for s in (shapes or SHAPES) for n in (names or CONTENDERS)]
        order = {case: i for i, case in enumerate(DEFAULT_CASES)}
        return sorted(want, key=lambda case: order.get(case, len(order)))
    return list(DEFAULT_CASES)


def add_ratios(cases: list[dict]) -> None:
    for shape in {c["shape"] for c in cases}:
        peers = [c["tokens_per_s"] for c in cases if c["shape"] == shape and c["contender"] in PEERS
                 and c.get("tokens_per_s")]  # fmt: skip
        best = max(peers, default=None)
        for c in cases:
            if c["shape"] == shape and c.get("tokens_per_s"):
                c["vs_best_peer"] = round(c["tokens_per_s"] / best, 4) if best else None


def throughput(run: BenchRun, args) -> None:
    cases: list[dict] = []
    cache: dict = {}
    longest = 0.0
    if run.smoke:
        todo = [("smoke", n) for n in (args.contenders.split(",") if args.contenders else CONTENDERS)]
    else:
        todo = pick_cases(args)
    for shape, name in todo:
        cfg, B = SMOKE_SHAPE if run.smoke else SHAPES[shape]
        B = args.batch_size or B
        # a case is expected to take as long as the longest one so far: skip it if it would end past the budget
        if run.elapsed() + longest > args.budget:
            cases.append({"shape": shape, "contender": name,
                          "skipped": f"would end past the budget of {args.budget:.0f} s"})  # fmt: skip
            run.log(f"{shape} {name}: skipped (budget)")
            continue
        t_case = time.perf_counter()
        try:
            res = run_case(run, shape, name, cfg, B, args, cache)
            run.log(f"{shape} {name}: {res['tokens_per_s']:,} tok/s, MFU {res['mfu_spec']} of spec, "
                    f"peak {res['peak_mem_gib']} GiB, first loss {res['first_step_loss']}, "
                    f"warm-up {res['warmup_s']} s")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one failing contender must not cost the others their run
            res = {"shape": shape, "contender": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            run.log(f"{shape} {name}: FAILED {res['error']}\n{traceback.format_exc()[-2000:]}")
        _free(run.device)  # out here: the exception (and the frames holding the failed case's model) is gone
        longest = max(longest, time.perf_counter() - t_case)
        cases.append(res)
        add_ratios(cases)
        run.write(shapes={k: dataclasses.asdict(v[0]) | {"batch": v[1]} for k, v in SHAPES.items()},
                  spec_bf16_TFLOPs=SPEC_BF16_FLOPS / 1e12, budget_s=args.budget, cases=cases)  # fmt: skip
    shown = [{**c, "tokens_per_s": c.get("tokens_per_s") or ("skipped" if "skipped" in c else "error")}
             for c in cases]  # fmt: skip
    print(format_table(shown, [("shape", "shape"), ("contender", "contender"), ("tokens_per_s", "tok/s"),
                               ("mfu_spec", "MFU spec"), ("mfu_measured", "MFU meas."), ("peak_mem_gib", "peak GiB"),
                               ("vs_best_peer", "vs best peer"), ("first_step_loss", "loss 1")]))  # fmt: skip


# ---------------------------------------------------------------------------------------------- fp8 curve
CURVE_SHAPE = dataclasses.replace(SHAPES["124m"][0], vocab_size=256, max_seq_len=1024)


def corpus_bytes(n: int) -> torch.Tensor:
    """The first n bytes of the bundled corpus (Python stdlib sources + pydoc_data) as a uint8 tensor."""
    from kiln.data.corpus import iter_documents

    parts, total = [], 0
    for doc in iter_documents(None):
        b = doc.encode("utf-8")
        parts.append(b)
        total += len(b)
        if total >= n:
            break
    return torch.frombuffer(bytearray(b"".join(parts)[:n]), dtype=torch.uint8)


def curve_run(label: str, cfg: ModelConfig, linear: str, seed: int, data, val, starts, val_starts, T, dev,
              compiled: bool = False):  # fmt: skip
    model = build_model(cfg, device=dev, seed=seed, kernels=KernelConfig(linear=linear)).train()
    # compiled: the loss module through torch.compile, as --train.compile (and the throughput cases) run it
    backend = "inductor" if dev.type == "cuda" else "aot_eager"  # --smoke: no inductor codegen on the CPU
    loss_fn = torch.compile(KilnLoss(model), backend=backend) if compiled else model.loss
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95),
                            fused=dev.type == "cuda" or None)  # fmt: skip
    steps = starts.shape[0]
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    )
    amp = torch.bfloat16 if dev.type == "cuda" else None
    ar = torch.arange(T + 1, device=dev)
    losses = torch.zeros(steps, device=dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(steps):
        w = data[starts[i][:, None] + ar].long()  # (B, T + 1) windows
        opt.zero_grad(set_to_none=True)
        with autocast(dev, amp):
            loss = loss_fn(w[:, :-1], w[:, 1:])
        loss.backward()
        if i == 0:  # a backward that skipped a GEMM's dX leaves the layers below it without gradients
            no_grad = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.any())]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses[i] = loss.detach()  # on the device: read once at the end, no sync per step
    model.eval()
    with torch.no_grad(), autocast(dev, amp):
        vl = [
            float(model.loss(w[:, :-1], w[:, 1:])) for w in (val[s[:, None] + ar].long() for s in val_starts)
        ]
    del model, opt
    extra = {"params_without_grad_step1": no_grad}
    if dev.type == "cuda":
        extra["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
    return losses.cpu().tolist(), statistics.mean(vl), extra


def fp8_curve(run: BenchRun, args) -> None:
    dev = run.device
    cfg = CURVE_SHAPE if not run.smoke else dataclasses.replace(SMOKE_SHAPE[0], vocab_size=256)
    T = cfg.max_seq_len
    B = args.batch_size or (16 if not run.smoke else 2)
    steps = args.steps or (1000 if not run.smoke else 3)
    raw = corpus_bytes(24_000_000 if not run.smoke else 200_000)
    n_val = len(raw) // 20  # the last 5% held out
    data, val = raw[:-n_val].to(dev), raw[-n_val:].to(dev)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - T - 1, (steps, B), generator=gen).to(dev)
    val_starts = torch.randint(0, len(val) - T - 1, (8 if not run.smoke else 2, B), generator=gen).to(dev)
    runs = [run_ for run_ in CURVE_RUNS if args.curve_runs is None or run_[0] in args.curve_runs.split(",")]
    curves, out, last_s = {}, [], 0.0
    for label, linear, seed in runs:
        if run.elapsed() + last_s > args.budget:
            out.append({"run": label, "skipped": f"would end past the budget of {args.budget:.0f} s"})
            run.log(f"fp8-curve {label}: skipped (budget)")
            continue
        t = time.perf_counter()
        losses, val_loss, extra = curve_run(label, cfg, linear, seed, data, val, starts, val_starts, T, dev,
                                            compiled=args.compile)  # fmt: skip
        last_s = time.perf_counter() - t
        curves[label] = losses
        w = 10  # the curve as the mean of every 10 steps
        means = [statistics.mean(losses[i : i + w]) for i in range(0, len(losses), w)]
        rec = {"run": label, "linear": linear, "seed": seed, "seconds": round(last_s, 1),
               "final_train_loss": round(statistics.mean(losses[-min(50, len(losses)):]), 4),
               "val_loss": round(val_loss, 4), "curve_every_10": [round(m, 4) for m in means], **extra}  # fmt: skip
        if label != "bf16" and "bf16" in curves:
            ref = curves["bf16"]
            rm = [statistics.mean(ref[i : i + w]) for i in range(0, len(ref), w)]
            rec["mean_abs_diff_vs_bf16"] = round(statistics.mean(abs(a - b) for a, b in zip(means, rm)), 4)
            tail = len(means) // 2  # the second half, past the fast initial drop
            rec["mean_abs_diff_vs_bf16_second_half"] = round(
                statistics.mean(abs(a - b) for a, b in zip(means[tail:], rm[tail:])), 4
            )
        out.append(rec)
        run.log(f"fp8-curve {label}: final train {rec['final_train_loss']}, val {rec['val_loss']}, "
                f"{rec.get('mean_abs_diff_vs_bf16')} mean |diff| vs bf16, {last_s:.1f} s")  # fmt: skip
        run.write(case="fp8-curve", shape=dataclasses.asdict(cfg), batch=B, steps=steps, lr=1e-3, compiled=args.compile,
                  data="bytes of the bundled corpus (Python stdlib + pydoc_data), last 5% held out",
                  runs=out)  # fmt: skip
        plot_curves(
            run.out.with_suffix(".png"), out, f"{steps} steps, {'compiled' if args.compile else 'eager'}"
        )


def plot_curves(path: Path, runs: list[dict], title: str) -> Path:
    """The fp8-curve runs' training loss (means of 10 steps) against the step, one line a run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for rec in runs:
        if "curve_every_10" in rec:
            curve = rec["curve_every_10"]
            ax.plot(
                [10 * i + 5 for i in range(len(curve))], curve, label=f"{rec['run']} (val {rec['val_loss']})"
            )
    ax.set(xlabel="step", ylabel="training loss (nats per byte, mean of 10 steps)", yscale="log",
           title=f"kiln 124M shape, bf16 vs FP8 training: {title}")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(path, fig)
    return path


def main() -> None:
    p = bench_parser("train", __doc__)
    p.add_argument("--case", default="throughput", choices=("throughput", "fp8-curve"))
    p.add_argument("--budget", type=float, help="seconds; cases that would start later are skipped "
                   "(default 480 for throughput, 200 for fp8-curve)")  # fmt: skip
    p.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--contenders", help=f"comma-separated subset of {', '.join(CONTENDERS)}")
    p.add_argument("--batch-size", type=int, help="sequences per step for every shape (default: the shape's)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the compile happens here)")
    p.add_argument("--steps", type=int, help="timed steps per round (default 8); fp8-curve: training steps "
                   "(default 1000)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="also profile one step of kiln-compiled, hf-compiled and the FP8 contenders at --profile-shape")  # fmt: skip
    p.add_argument("--profile-shape", default=PROFILE_SHAPE, choices=tuple(SHAPES))
    p.add_argument("--compile", action="store_true", help="fp8-curve: train through torch.compile "
                   "(as the throughput cases do) instead of eagerly")  # fmt: skip
    p.add_argument("--curve-runs", help="fp8-curve: comma-separated subset of "
                   f"{', '.join(r[0] for r in CURVE_RUNS)} (default all; bf16 is the reference)")  # fmt: skip
    args = p.parse_args()
    unknown = set((args.curve_runs or "").split(",")) - {"", *(r[0] for r in CURVE_RUNS)}
    if unknown:
        p.error(f"--curve-runs: unknown run(s) {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(r[0] for r in CURVE_RUNS)}")  # fmt: skip
    if args.case == "fp8-curve":
        args.budget = 200.0 if args.budget is None else args.budget
        if args.out is None and not args.smoke:
            args.out = str(Path(__file__).resolve().parent / "results" / "train-fp8-curve.json")
        run = BenchRun("train", __file__, args)
        fp8_curve(run, args)
        return
    args.budget = 480.0 if args.budget is None else args.budget
    args.steps = args.steps or (8 if not args.smoke else 1)
    if args.smoke:
        args.warmup, args.rounds = 1, 1
        args.profile_shape = "smoke"
    run = BenchRun("train", __file__, args)
    throughput(run, args)


if __name__ == "__main__":
    main()
