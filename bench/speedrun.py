"""The speed run: wall time to a validation bits-per-byte target, kiln's recipe against a compiled HF baseline.

    python bench/speedrun.py                         # on the H200: both runs, one command (< 600 s)
    python bench/speedrun.py --smoke                 # the same code on the CPU, tiny model, tiny target

Both runs read the same data: the `speedrun` preset's Python-sources corpus (kiln.data.pysources: the
stdlib, pydoc_data and the preset's packages, split by file name), its tokenizer and token shards, made
once in --work and reused by the second run (and by later invocations with the same settings). Both take
the same batches (TokenLoader, same seed: batch_size x seq_len tokens per step), evaluate the same
validation windows every train.eval_interval steps with the same bits-per-byte code
(kiln.train.evaluate), and stop at the first evaluation at or below the target, or once their training
time passes their cap. Training time is wall time from the first step (torch.compile included) with the
evaluations left out, as `kiln run` counts it (train.max_time_s).

- kiln: `kiln run --preset speedrun` itself (kiln.train.run.run): kiln's model on its kernels, compiled,
  Muon for the blocks' matrices + AdamW for the rest, warmup-stable-decay schedule.
- baseline: transformers' LlamaForCausalLM of the same shape, random init from its config (transformers'
  own init, no download), SDPA attention, torch.compile of the loss, fused AdamW over every parameter
  (decay on matrices) with the same warmup-stable-decay schedule over the same steps at --baseline-lr,
  bf16 autocast over fp32 parameters, gradient clipping at the preset's train.grad_clip.

The budget: --budget seconds for the whole command; the baseline's cap is the smaller of --baseline-cap
and what is left of the budget after kiln's run (less a reserve for its final evaluation). A run that has
not reached the target by its cap is recorded as such, with the cap and the bpb it reached; nothing is
extrapolated. When both reach the target, ratio = baseline time / kiln time; when only kiln does,
`ratio_at_least` = the baseline's training time at its last evaluation / kiln's time (a measured bound).

Writes JSON (both curves, times, corpus fingerprint, provenance) to --out and a PNG of validation
bits-per-byte against training time, both runs, beside it (same name, .png).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import json
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.data.loader import TokenLoader
from kiln.data.shards import load_meta
from kiln.profile.harness import BenchRun, bench_parser
from kiln.tokenizer import Tokenizer
from kiln.train.config import RunConfig, resolve_config
from kiln.train.evaluate import evaluate, token_byte_lengths
from kiln.train.optim import WarmupCosine
from kiln.train.run import prepare_tokenizer_and_data, run

# the smoke run's model and data: a few seconds a step on a loaded 2-core CPU
SMOKE = [
    '--data.packages=["jinja2"]',
    "--data.max_bytes=300000",
    "--data.val_fraction=0.2",
    "--tokenizer.vocab_size=300",
    "--tokenizer.train_bytes=100000",
    "--model.d_model=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--model.ffn_hidden=64",
    "--model.max_seq_len=32",
    "--train.steps=40",
    "--train.batch_size=4",
    "--train.seq_len=32",
    "--train.warmup_steps=2",
    "--train.eval_interval=4",
    "--train.eval_batches=2",
    "--train.log_interval=4",
    "--train.compile=false",
    "--train.target_val_bpb=6.2",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    """Drop the finished run's compiled graphs (they hold its model), then its memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kiln_run(cfg: RunConfig, cap: float, log) -> dict:
    """`kiln run` with the preset (cap: train.max_time_s); its curve read back from metrics.jsonl."""
    cfg.train.max_time_s = min(cap, cfg.train.max_time_s or cap)
    t0 = time.perf_counter()
    try:
        summary = run(cfg, progress=False, overwrite=True)
    except Exception as e:  # recorded, so the baseline still runs and the JSON says what failed
        log(f"kiln run failed: {type(e).__name__}: {e}")
        metrics = Path(cfg.out_dir) / "metrics.jsonl"
        curve = _curve(metrics)[0] if metrics.exists() else []
        return {
            "error": f"{type(e).__name__}: {e}",
            "curve": curve,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    curve, recs = _curve(Path(cfg.out_dir) / "metrics.jsonl")
    tps = [r["tokens_per_s"] for r in recs if r["kind"] == "train" and r["step"] > cfg.train.log_interval]
    return {
        "params": summary["params"],
        "reached": summary["stop"] == "target",
        "time_to_target_s": round(summary["train_time_s"], 2) if summary["stop"] == "target" else None,
        "cap_s": cfg.train.max_time_s,
        "stop": summary["stop"] or "steps",
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "final_val_bpb": summary["val_bpb"],
        "train_time_s": summary["train_time_s"],
        "tokens_per_s_median": sorted(tps)[len(tps) // 2] if tps else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "curve": curve,
    }


def _curve(metrics: Path) -> tuple[list[dict], list[dict]]:
    """The validation points (step, tokens, training seconds, bpb) of a run's metrics.jsonl, and all records."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curve = [
        {
            "step": r["step"],
            "tokens": r["tokens"],
            "train_time_s": round(r["train_time_s"], 3),
            "val_bpb": r["val_bpb"],
        }
        for r in recs
        if r["kind"] == "val"
    ]
    return curve, recs


class _HFLoss(torch.nn.Module):
    """forward(x, y) -> mean next-token cross-entropy of a transformers causal LM (y already shifted)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        logits = self.hf(input_ids=x, use_cache=False).logits  # (B, T, V)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction=reduction
        )


def baseline_run(
    cfg: RunConfig,
    device: torch.device,
    lr: float,
    wd: float,
    cap: float,
    deadline: float,
    compile_: bool,
    log,
) -> dict:
    """HF LlamaForCausalLM + SDPA + torch.compile + fused AdamW on kiln's shards, kiln's clock. It stops
    at the target, at `cap` seconds of training, or at the first evaluation past the wall-clock `deadline`
    (a time.perf_counter() value: the command's budget, evaluations included)."""
    import transformers

    from kiln.model.hf_config import config_to_hf

    t0 = time.perf_counter()
    tc, run_dir = cfg.train, Path(cfg.out_dir)
    meta = load_meta(run_dir / "data")
    shards = {s: [run_dir / "data" / n for n in meta["splits"][s]["shards"]] for s in ("train", "val")}
    byte_lengths = token_byte_lengths(Tokenizer.load(run_dir / "tokenizer"))
    loader = TokenLoader(shards["train"], tc.batch_size, tc.seq_len, seed=tc.seed)  # kiln's batches
    val_loader = TokenLoader(shards["val"], tc.batch_size, tc.seq_len, shuffle=False)
    val_batches = [val_loader.next_batch() for _ in range(min(tc.eval_batches, val_loader.batches_per_epoch))]

    d = config_to_hf(cfg.model, "float32")
    hf_cfg = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(tc.seed)
    with torch.device(device):  # transformers' own init: N(0, initializer_range)
        hf = transformers.AutoModelForCausalLM.from_config(
            hf_cfg, attn_implementation="sdpa", dtype=torch.float32
        )
    loss_mod = _HFLoss(hf).train()
    step_fn = torch.compile(loss_mod) if compile_ else loss_mod
    params = [p for p in hf.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(tc.beta1, tc.beta2),
        eps=tc.eps,
        fused=device.type == "cuda" or None,
    )
    sched = WarmupCosine(opt, lr, tc.warmup_steps, tc.steps, tc.min_lr_ratio, tc.schedule, tc.cooldown_frac)
    amp = torch.bfloat16 if device.type == "cuda" else None

    def summed(x, y):
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            return loss_mod(x, y, reduction="sum").float()  # eager, as kiln evaluates

    curve, stop, step, train_time = [], None, 0, 0.0
    log(f"baseline: HF LlamaForCausalLM {sum(p.numel() for p in params) / 1e6:.2f}M, lr {lr}, cap {cap:.0f}s")
    t_fit, paused = time.perf_counter(), 0.0
    try:
        while step < tc.steps and stop is None:
            x, y = loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                loss = step_fn(x, y)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % tc.eval_interval == 0 or step == tc.steps:
                _sync(device)
                t_eval = time.perf_counter()
                train_time = t_eval - t_fit - paused
                hf.eval()
                val = evaluate(summed, val_batches, byte_lengths, device)
                hf.train()
                tokens = step * tc.batch_size * tc.seq_len
                curve.append(
                    {
                        "step": step,
                        "tokens": tokens,
                        "train_time_s": round(train_time, 3),
                        "val_bpb": val["val_bpb"],
                    }
                )
                log(f"baseline step {step}: val bpb {val['val_bpb']:.4f} after {train_time:.1f}s")
                if tc.target_val_bpb is not None and val["val_bpb"] <= tc.target_val_bpb:
                    stop = "target"
                elif train_time >= cap:
                    stop = "time"
                elif time.perf_counter() >= deadline:
                    stop = "budget"
                paused += time.perf_counter() - t_eval
    except Exception as e:
        log(f"baseline failed at step {step}: {type(e).__name__}: {e}")
        return {
            "error": f"{type(e).__name__}: {e}",
            "curve": curve,
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    steps_timed = curve[-1]["step"] if curve else 0
    return {
        "params": sum(p.numel() for p in params),
        "lr": lr,
        "reached": stop == "target",
        "time_to_target_s": round(train_time, 2) if stop == "target" else None,
        "cap_s": round(cap, 1),
        "stop": stop or "steps",
        "steps": step,
        "tokens": step * tc.batch_size * tc.seq_len,
        "final_val_bpb": curve[-1]["val_bpb"] if curve else None,
        "train_time_s": train_time,
        "tokens_per_s_mean": round(steps_timed * tc.batch_size * tc.seq_len / train_time)
        if train_time
        else None,
        "wall_s": round(time.perf_counter() - t0, 1),
        "curve": curve,
    }


def plot(path: Path, runs: dict, target: float | None, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in runs.items():
        pts = res.get("curve") or []
        if pts:
            ax.plot([p["train_time_s"] for p in pts], [p["val_bpb"] for p in pts], marker=".", label=name)
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
    ax.set_xlabel("training time, s (torch.compile included, evaluations excluded)")
    ax.set_ylabel("validation bits per byte")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def main() -> None:
    p = bench_parser("speedrun", __doc__)
    p.add_argument("--work", default=None, help="run directory (tokenizer and shards cached there)")
    p.add_argument("--budget", type=float, default=560.0, help="seconds for the whole command")
    p.add_argument("--kiln-cap", type=float, default=200.0, help="kiln's training-time cap, s")
    p.add_argument("--baseline-cap", type=float, default=300.0, help="the baseline's training-time cap, s")
    p.add_argument("--baseline-lr", type=float, default=1.5e-3, help="the baseline's AdamW peak lr")
    p.add_argument(
        "--baseline-wd", type=float, default=0.1, help="the baseline's AdamW weight decay (matrices)"
    )
    p.add_argument("--target", type=float, default=None, help="override the preset's train.target_val_bpb")
    p.add_argument(
        "--reserve", type=float, default=25.0, help="seconds kept back for the baseline's last eval"
    )
    p.add_argument("--no-compile", action="store_true", help="neither run compiles (the smoke run's default)")
    p.add_argument("--only", choices=("kiln", "baseline"), help="run one side only")
    # anything else: --section.key=value overrides of the speedrun preset, for both runs
    args, extra = p.parse_known_args()
    bench = BenchRun("speedrun", __file__, args, rounds=1)
    device = bench.device
    work = Path(args.work or ("/tmp/kiln-speedrun-smoke" if bench.smoke else "/tmp/kiln-speedrun"))
    overrides = [f"--out_dir={work}", f"--device={device.type}", "--sample.max_new_tokens=0"]
    overrides += SMOKE if bench.smoke else []
    overrides += extra
    if args.target is not None:
        overrides.append(f"--train.target_val_bpb={args.target}")
    compile_ = not (args.no_compile or bench.smoke)
    if not compile_:
        overrides.append("--train.compile=false")
    cfg = resolve_config("speedrun", overrides=overrides)
    bench.log(f"preset speedrun, overrides {overrides}")

    # data: once, reused by both runs (run() finds stages.json matching and skips it)
    t0 = time.perf_counter()
    work.mkdir(parents=True, exist_ok=True)
    prepare_tokenizer_and_data(cfg, work, progress=False)
    data_s = time.perf_counter() - t0
    meta = load_meta(work / "data")
    bench.log(f"data ready in {data_s:.1f}s: {meta.get('corpus')}")

    runs: dict = {}
    if args.only != "baseline":
        runs["kiln"] = kiln_run(cfg, args.kiln_cap, bench.log)
        bench.log(f"kiln: {json.dumps({k: v for k, v in runs['kiln'].items() if k != 'curve'})}")
        _free(device)
    if args.only != "kiln":
        left = args.budget - bench.elapsed() - args.reserve
        cap = max(1.0, min(args.baseline_cap, left))
        deadline = time.perf_counter() + args.budget - bench.elapsed() - 10.0  # 10 s to write the results
        runs["baseline"] = baseline_run(
            cfg, device, args.baseline_lr, args.baseline_wd, cap, deadline, compile_, bench.log
        )
        bench.log(f"baseline: {json.dumps({k: v for k, v in runs['baseline'].items() if k != 'curve'})}")
        _free(device)

    k, b = runs.get("kiln", {}), runs.get("baseline", {})
    ratio = ratio_at_least = None
    if k.get("reached") and b.get("reached"):  # the unrounded training times at the target
        ratio = round(b["train_time_s"] / max(k["train_time_s"], 1e-9), 3)
    elif k.get("reached") and b.get("curve") and not b.get("error"):
        ratio_at_least = round(b["train_time_s"] / max(k["train_time_s"], 1e-9), 3)
    png = bench.out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    title = f"kiln speedrun vs HF Llama + SDPA + compile + AdamW ({bench.meta.get('gpu') or 'cpu'})"
    plot(png, runs, cfg.train.target_val_bpb, title)
    tc, mc = cfg.train, cfg.model
    bench.write(
        target_val_bpb=tc.target_val_bpb,
        corpus=meta.get("corpus"),
        data={
            "train_tokens": meta["splits"]["train"]["tokens"],
            "val_tokens": meta["splits"]["val"]["tokens"],
            "vocab_size": meta["vocab_size"],
            "prep_s": round(data_s, 1),
        },
        model={
            "arch": mc.arch,
            "d_model": mc.d_model,
            "n_layers": mc.n_layers,
            "n_heads": mc.n_heads,
            "n_kv_heads": mc.n_kv_heads,
            "ffn_hidden": mc.ffn_hidden,
            "vocab_size": mc.vocab_size,
        },  # fmt: skip
        tokens_per_step=tc.batch_size * tc.seq_len * tc.grad_accum,
        eval={"interval": tc.eval_interval, "batches": tc.eval_batches},
        compile=compile_,
        overrides=overrides,
        runs=runs,
        ratio=ratio,
        ratio_at_least=ratio_at_least,
        png=png.name,
    )
    if args.work is None and bench.smoke:
        shutil.rmtree(work, ignore_errors=True)
    verdict = (
        f"ratio {ratio}x"
        if ratio
        else f"baseline not at target by its cap: ratio >= {ratio_at_least}x"
        if ratio_at_least
        else "no ratio (a run did not reach the target)"
    )
    bench.log(
        f"speedrun: kiln {k.get('time_to_target_s')}s, baseline {b.get('time_to_target_s')}s; {verdict}"
    )


if __name__ == "__main__":
    main()
