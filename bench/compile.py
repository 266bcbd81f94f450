"""Training throughput of kiln's model eager against torch.compile, on a preset's model and batch shape.

    python bench/compile.py --preset gpu --out bench/results/compile.json
    python bench/compile.py --preset gpu --batch-size 16 --seq-len 2048 --mode max-autotune-no-cudagraphs

A training step is what `kiln run` does per micro-batch: zero the gradients, the loss forward under bf16
autocast (fp32 parameters), backward, fused AdamW step. The compiled contender wraps the loss exactly as
kiln.train.loop does for --train.compile=true (`torch.compile` of a module whose forward is model.loss;
the kernels enter the graph as custom ops, docs/perf/compile.md). Both start from the same weights,
and the first step's losses are reported side by side (they should agree within bf16 noise). Times are
the median of `--rounds` rounds of `--steps` steps each, after `--warmup` steps (which include the
compile); tokens/s = batch * seq_len / median step time. On a CPU machine it runs the reference ops
(no GPU kernels to measure); numbers there only smoke-test the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kiln.model import build_model
from kiln.profile.provenance import provenance
from kiln.train.config import resolve_config


class LossModule(torch.nn.Module):
    """forward(x, y) -> mean loss, as kiln.train.loop.LossModule (what --train.compile compiles)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name, loss_fn, model, batches, device, amp, warmup: int, steps: int, rounds: int) -> dict:
    """Step times of `loss_fn` (seconds): warm-up (compile), then `rounds` timed rounds of `steps`."""
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, fused=device.type == "cuda" or None)

    def step(i: int) -> torch.Tensor:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    t0 = time.perf_counter()
    first_loss = float(step(0))
    for i in range(1, warmup):
        step(i)
    _sync(device)
    warmup_s = time.perf_counter() - t0
    per_round = []
    for _ in range(rounds):
        _sync(device)
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        _sync(device)
        per_round.append((time.perf_counter() - t) / steps)
    step_s = statistics.median(per_round)
    x = batches[0][0]
    out = {
        "first_step_loss": first_loss,
        "warmup_s": round(warmup_s, 2),
        "step_ms": round(step_s * 1e3, 3),
        "rounds_ms": [round(r * 1e3, 3) for r in per_round],
        "tokens_per_s": round(x.numel() / step_s),
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        torch.cuda.reset_peak_memory_stats(device)
    print(
        f"{name:>9}: {out['step_ms']:9.2f} ms/step  {out['tokens_per_s']:>10,} tok/s  warm-up {warmup_s:.1f} s"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpu", help="config preset for the model and batch shape")
    p.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--mode", default=None, help="torch.compile mode (default: its default)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (the compile happens here)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/compile.json", help="where the JSON goes")
    # any other argument is a config override, as for `kiln run`: --model.n_layers=4
    args, overrides = p.parse_known_args()
    cfg = resolve_config(args.preset, None, overrides)
    B = args.batch_size or cfg.train.batch_size
    T = args.seq_len or cfg.train.seq_len
    if T > cfg.model.max_seq_len:
        raise SystemExit(f"--seq-len {T} exceeds model.max_seq_len {cfg.model.max_seq_len}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = torch.bfloat16 if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    V = cfg.model.vocab_size
    batches = [
        tuple(torch.randint(0, V, (B, T), generator=gen).to(device) for _ in range(2)) for _ in range(4)
    ]
    results = {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        model = build_model(cfg.model, device=device, seed=0).train()
        n_params = sum(p.numel() for p in model.parameters())
        loss_module = LossModule(model)
        fn = torch.compile(loss_module, mode=args.mode) if name == "compiled" else loss_module
        results[name] = measure(name, fn, model, batches, device, amp, args.warmup, args.steps, args.rounds)
        del model, loss_module, fn
        torch._dynamo.reset()
    speedup = results["eager"]["step_ms"] / results["compiled"]["step_ms"]
    print(f"compiled / eager tokens/s: {speedup:.3f}")
    out = {
        **provenance(),
        "preset": args.preset,
        "model": {"arch": cfg.model.arch, "params": n_params, "d_model": cfg.model.d_model,
                  "n_layers": cfg.model.n_layers, "vocab_size": V},
        "batch_size": B,
        "seq_len": T,
        "autocast": str(amp),
        "compile_mode": args.mode or "default",
        "steps": args.steps,
        "rounds": args.rounds,
        "eager": results["eager"],
        "compiled": results["compiled"],
        "compiled_over_eager": round(speedup, 4),
    }  # fmt: skip
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)  # atomic: a half-written result never replaces the last one
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
