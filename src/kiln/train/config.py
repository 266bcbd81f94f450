"""The config of a `kiln run`: one dataclass per stage, presets in src/kiln/configs/*.json.

Resolution order: the preset (by --preset, else "cpu" or "gpu" by the device) <- --config FILE <-
--section.key=value overrides. Unknown keys are errors. The resolved config is printed at the start
and saved in config.json and in every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kiln.config import from_dict, merge, parse_overrides, read_json_object, to_dict
from kiln.configs import PRESETS, load_preset
from kiln.dist.parallel_dims import ParallelConfig
from kiln.errors import KilnError
from kiln.model import ModelConfig
from kiln.model.config import KernelConfig


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise KilnError(msg)


@dataclass
class DataConfig:
    path: str | None = None  # None: the bundled corpus (Python stdlib sources + pydoc_data)
    max_bytes: int | None = None  # read at most this much text (None: all)
    val_fraction: float = 0.05  # share of documents held out for validation
    seed: int = 0  # seeds the train/validation split
    # a list (even empty): the Python-sources corpus instead (kiln.data.pysources): the stdlib, pydoc_data
    # and these installed packages' .py files, held out by a hash of each file's name (seed unused)
    packages: list[str] | None = None
    # the Python-sources corpus only: leave out files zlib compresses below this many bits per byte
    # (generated tables a model learns to copy; kiln.data.pysources); 0 keeps every file
    min_zlib_bpb: float = 0.0

    def __post_init__(self) -> None:
        _require(
            self.packages is None or self.path is None,
            "data.packages builds the Python-sources corpus and data.path names another one: set only one",
        )
        _require(
            0.0 < self.val_fraction < 1.0, f"data.val_fraction must be in (0, 1), got {self.val_fraction}"
        )
        _require(self.max_bytes is None or self.max_bytes > 0, "data.max_bytes must be positive or null")
        _require(
            0.0 <= self.min_zlib_bpb < 8.0,
            f"data.min_zlib_bpb must be in [0, 8) bits per byte (0: keep every file), got {self.min_zlib_bpb}",
        )
        _require(
            self.min_zlib_bpb == 0.0 or self.packages is not None,
            "data.min_zlib_bpb filters the Python-sources corpus: set data.packages too, or leave it at 0",
        )


@dataclass
class TokenizerConfig:
    vocab_size: int = 4096
    pattern: str = "gpt4"  # split pattern name (gpt2, gpt4, o200k, qwen2) or a regex
    train_bytes: int | None = 4_000_000  # train the BPE on the first bytes of the train split
    special_tokens: list[str] = field(default_factory=lambda: ["<|endoftext|>"])

    def __post_init__(self) -> None:
        _require(
            self.vocab_size >= 256 + len(self.special_tokens),
            f"tokenizer.vocab_size must be at least 256 + {len(self.special_tokens)} special tokens, got {self.vocab_size}",
        )
        _require(
            "<|endoftext|>" in self.special_tokens, "tokenizer.special_tokens must include '<|endoftext|>'"
        )


@dataclass
class TrainConfig:
    steps: int = 400
    batch_size: int = 16  # sequences per micro-batch per rank
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # adamw, or muon: Muon for the blocks' matrices (muon_* below), AdamW (lr, betas, eps, weight_decay)
    # for embeddings, head, norms and biases (kiln.train.muon)
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95  # Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_weight_decay: float = 0.0
    embed_lr: float | None = None  # muon only: AdamW's peak lr for the embeddings (None: lr)
    schedule: str = "cosine"  # cosine, or wsd: hold lr, then decay linearly over the last cooldown_frac
    cooldown_frac: float = 0.2
    target_val_bpb: float | None = None  # stop at the first evaluation at or below this validation bpb
    max_time_s: float | None = None  # stop at the first evaluation after this many seconds of training
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    max_bad_steps: int = 5  # stop after this many consecutive steps with a non-finite loss or gradient
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 16
    ckpt_interval: int = 100
    keep_checkpoints: int = 2
    checkpoint_format: str = "auto"  # full / dcp (sharded, per rank) / auto: dcp for FSDP2, TP and PP runs
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or fp32 / bf16
    compile: bool = False
    seed: int = 1337

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "seq_len",
            "grad_accum",
            "log_interval",
            "eval_interval",
            "eval_batches",
            "ckpt_interval",
            "max_bad_steps",
        ):
            _require(getattr(self, name) > 0, f"train.{name} must be positive, got {getattr(self, name)}")
        _require(self.warmup_steps >= 0, "train.warmup_steps must be >= 0")
        _require(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]")
        _require(self.grad_clip >= 0, "train.grad_clip must be >= 0")
        _require(
            self.optimizer in ("adamw", "muon"),
            f"train.optimizer must be adamw or muon, got {self.optimizer!r}",
        )
        _require(self.muon_lr > 0, f"train.muon_lr must be positive, got {self.muon_lr}")
        _require(
            0 <= self.muon_momentum < 1, f"train.muon_momentum must be in [0, 1), got {self.muon_momentum}"
        )
        _require(self.muon_ns_steps >= 1, f"train.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")
        _require(self.muon_weight_decay >= 0, "train.muon_weight_decay must be >= 0")
        _require(
            self.embed_lr is None or (self.embed_lr > 0 and math.isfinite(self.embed_lr)),
            f"train.embed_lr must be positive or null, got {self.embed_lr}",
        )
        _require(
            self.embed_lr is None or self.optimizer == "muon",
            "train.embed_lr applies to train.optimizer=muon only (AdamW alone takes train.lr for every group): "
            "pass --train.embed_lr=null with train.optimizer=adamw",
        )
        _require(
            self.schedule in ("cosine", "wsd"), f"train.schedule must be cosine or wsd, got {self.schedule!r}"
        )
        _require(
            0 <= self.cooldown_frac <= 1, f"train.cooldown_frac must be in [0, 1], got {self.cooldown_frac}"
        )
        _require(
            self.target_val_bpb is None or self.target_val_bpb > 0,
            f"train.target_val_bpb must be positive or null, got {self.target_val_bpb}",
        )
        _require(
            self.max_time_s is None or self.max_time_s > 0,
            f"train.max_time_s must be positive or null, got {self.max_time_s}",
        )
        # AdamW's own checks (torch raises ValueError) would fire only after the data is prepared
        _require(0 <= self.beta1 < 1, f"train.beta1 must be in [0, 1), got {self.beta1}")
        _require(0 <= self.beta2 < 1, f"train.beta2 must be in [0, 1), got {self.beta2}")
        _require(self.eps > 0, f"train.eps must be positive, got {self.eps}")
        _require(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _require(
            self.keep_checkpoints >= 0,
            f"train.keep_checkpoints must be >= 0 (0 keeps every checkpoint), got {self.keep_checkpoints}",
        )
        for name in ("lr", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip", "muon_lr"):
            _require(math.isfinite(getattr(self, name)), f"train.{name} must be a finite number")
        _require(
            self.checkpoint_format in ("auto", "full", "dcp"),
            f"train.checkpoint_format must be auto, full or dcp, got {self.checkpoint_format!r}",
        )
        _require(
            self.dtype in ("auto", "fp32", "bf16"),
            f"train.dtype must be auto, fp32 or bf16, got {self.dtype!r}",
        )


@dataclass
class SampleConfig:
    prompts: list[str] = field(default_factory=lambda: ["def ", "import "])
    max_new_tokens: int = 120
    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        _require(
            math.isfinite(self.temperature) and self.temperature >= 0,
            f"sample.temperature must be >= 0 and finite (0 = greedy), got {self.temperature}",
        )
        _require(
            self.top_p is None or 0 < self.top_p <= 1, f"sample.top_p must be in (0, 1], got {self.top_p}"
        )
        _require(
            self.top_k is None or self.top_k >= 0,
            f"sample.top_k must be >= 1, or 0/null (off), got {self.top_k}",
        )
        _require(self.max_new_tokens >= 0, "sample.max_new_tokens must be >= 0")


@dataclass
class TrainKernelConfig(KernelConfig):
    """The per-op kernel choice of a run (kiln.model.config.KernelConfig) with training's default: attention
    "auto", measured when training starts (kiln.train.kernels). A class of its own so that a partial
    `--kernels.linear=fp8` keeps that default. linear "fp8" / "fp8_rowwise" trains the block linears in FP8."""

    attention: str = "auto"


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    device: str = "auto"
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kernels: TrainKernelConfig = field(default_factory=TrainKernelConfig)

    def __post_init__(self) -> None:
        _require(
            self.model.vocab_size == self.tokenizer.vocab_size,
            f"model.vocab_size ({self.model.vocab_size}) must equal tokenizer.vocab_size "
            f"({self.tokenizer.vocab_size}); set both, or only tokenizer.vocab_size",
        )
        _require(
            self.train.seq_len <= self.model.max_seq_len,
            f"train.seq_len ({self.train.seq_len}) exceeds model.max_seq_len ({self.model.max_seq_len})",
        )


def resolve_config(
    preset: str, config_file: str | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """Preset <- config file <- overrides, validated. tokenizer.vocab_size also sets model.vocab_size."""
    return _layered(load_preset(preset), config_file, overrides)


def resume_config(
    saved: dict[str, Any], config_file: str | None = None, overrides: list[str] | None = None
) -> RunConfig:
    """A run's saved config.json <- config file <- overrides, as resolve_config layers a preset.

    Whether the result may resume the run is run()'s question (resume_changes), asked against the
    checkpoint itself.
    """
    return _layered(saved, config_file, overrides)


def _layered(data: dict[str, Any], config_file: str | None, overrides: list[str] | None) -> RunConfig:
    if config_file is not None:
        data = merge(data, read_json_object(config_file, "config file"))
    extra = parse_overrides(overrides or [])
    data = merge(data, extra)
    # a section given as a scalar (`--model=3`) is left for from_dict to name; only sections get the vocab
    tok, model = data.get("tokenizer"), data.get("model")
    vocab = tok.get("vocab_size") if isinstance(tok, dict) else None
    model_extra = extra.get("model")
    if vocab is not None and isinstance(model, dict) and "vocab_size" not in (model_extra or {}):
        model["vocab_size"] = vocab
    return from_dict(RunConfig, data, "config")


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    return from_dict(RunConfig, d, "config")


# What `kiln run --resume` may change: how long the run goes on, how often it logs, evaluates and checkpoints,
# where the schedule ends, where it runs, and the samples at the end. Everything else (data, tokenizer,
# model, batch, optimizer, seeds) decides what the checkpoint's weights mean, and a change is refused.
RESUMABLE = (
    "out_dir",
    "device",
    "train.steps",
    "train.min_lr_ratio",
    "train.log_interval",
    "train.eval_interval",
    "train.ckpt_interval",
    "train.keep_checkpoints",
    "train.checkpoint_format",  # the checkpoint read says its own format
    "train.max_bad_steps",
    "train.target_val_bpb",
    "train.max_time_s",
    "sample.*",
    "kernels.*",
)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".*") and key.startswith(r[:-1])) for r in RESUMABLE)


def resume_changes(
    old: dict[str, Any], new: RunConfig
) -> tuple[list[tuple[str, Any, Any]], list[tuple[str, Any, Any]]]:
    """(allowed, refused) changes from a checkpoint's config `old` to `new`, as (key, old value, new value).

    `old` is read through RunConfig first where it can be, so keys added since it was written compare
    as their defaults rather than as changes.
    """
    try:
        old = to_dict(config_from_dict(old))
    except KilnError:  # written by another version of kiln: compare what it holds
        pass
    a, b = _flat(old), _flat(to_dict(new))
    allowed, refused = [], []
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            (allowed if _resumable(key) else refused).append((key, a.get(key), b.get(key)))
    return allowed, refused


__all__ = [
    "DataConfig",
    "TokenizerConfig",
    "TrainConfig",
    "SampleConfig",
    "ParallelConfig",
    "KernelConfig",
    "TrainKernelConfig",
    "RunConfig",
    "resolve_config",
    "config_from_dict",
    "RESUMABLE",
    "resume_changes",
    "load_preset",
    "PRESETS",
    "to_dict",
]
