"""Run metrics: one JSON line per record, the one-line step log, and the loss-curve PNG."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from kiln.io.atomic import append_text, atomic_write_png, atomic_write_text


class MetricsLog:
    """Appends records to metrics.jsonl (rank 0 only; other ranks pass path=None)."""

    def __init__(self, path: Path | None):
        self.path = path

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        append_text(self.path, json.dumps(record) + "\n")  # whole lines only, even on a full disk

    def truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint's step (they belong to the lost tail of a run)."""
        if self.path is None or not self.path.exists():
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        atomic_write_text(self.path, "".join(ln + "\n" for ln in keep))


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_step(rec: dict) -> str:
    parts = [
        f"step {rec['step']:>6d}/{rec['total_steps']}",
        "loss n/a (all skipped)" if rec["loss"] is None else f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.2e}",
        f"grad {rec['grad_norm']:.3f}",
        f"{rec['tokens_per_s'] / 1e3:.1f}k tok/s",
    ]
    if rec.get("skipped"):
        parts.append(f"skipped {rec['skipped']}")
    if rec.get("mfu") is not None:
        parts.append(f"mfu {100 * rec['mfu']:.1f}%")
    parts.append(f"mem {rec['mem_gib']:.2f} GiB")
    return " | ".join(parts)


def plot_losses(metrics_path: Path, png_path: Path, title: str = "kiln run") -> None:
    """Train and validation loss against step, as a PNG beside the metrics (nothing before the first record)."""
    if not metrics_path.exists():  # a checkpoint before the first log line (ckpt_interval < log_interval)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind") == "train" and rec.get("loss") is not None:
            train.append((rec["step"], rec["loss"]))
        elif rec.get("kind") == "val":
            val.append((rec["step"], rec["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_png(png_path, fig, dpi=fig.dpi)
