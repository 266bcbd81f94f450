"""Where a model comes from: kiln model directories, HF directories, training checkpoints, config files.

A kiln model directory holds `model.json` (ModelConfig.to_dict()) and `model.safetensors` (kiln names).
`kiln convert` and `kiln model summary` accept any of:
- an HF checkpoint directory (config.json with "architectures"), or an HF config.json;
- a kiln model directory, or a model.json;
- a training run directory, its checkpoints/ directory or a step_*.pt file (`kiln run` output), or the
  run's config.json / a run config file (its "model" section);
- the name of a run preset (`kiln model summary gpu`);
- a sharded checkpoint of `torch.distributed.checkpoint` written by kiln.dist.checkpoint.save_sharded (its
  `.metadata`, every rank's shards and the model.json written beside them): read in one process, each
  tensor assembled from its shards whatever mesh wrote it (`kiln convert DIR OUT` exports it to HF).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kiln.configs import PRESETS, load_preset
from kiln.errors import KilnError
from kiln.io.checkpoint import POINTER, load_checkpoint, resolve_checkpoint
from kiln.model.config import ModelConfig
from kiln.model.hf import from_pretrained
from kiln.model.hf_config import config_from_hf
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer

MODEL_JSON, MODEL_WEIGHTS = "model.json", "model.safetensors"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint


def save_model_dir(model: Transformer, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write `model.json` + `model.safetensors` (kiln parameter names)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {
        k: v.detach().to("cpu", dtype=dtype or v.dtype).contiguous() for k, v in model.state_dict().items()
    }
    save_file(state, str(path / MODEL_WEIGHTS), metadata={"format": "pt"})
    (path / MODEL_JSON).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


def load_model_dir(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    path = Path(path)
    cfg = ModelConfig.from_dict(_read_json(path / MODEL_JSON))
    return _with_state(cfg, load_file(str(path / MODEL_WEIGHTS)), device, dtype, str(path))


def _is_sharded(path: Path) -> bool:
    return path.is_dir() and (path / DCP_METADATA).is_file()


def _sharded_config(path: Path) -> ModelConfig:
    if not (path / MODEL_JSON).is_file():
        raise KilnError(
            f"{path} is a sharded (DCP) checkpoint without {MODEL_JSON}: kiln cannot tell which model it holds; "
            f"write it with kiln.dist.checkpoint.save_sharded, or copy the run's model config there as {MODEL_JSON}"
        )
    return ModelConfig.from_dict(_read_json(path / MODEL_JSON))


def load_sharded_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """The model of a sharded DCP checkpoint, in one process (no process group): DCP reads every
    tensor's shards into the full fp32 tensor (`no_dist`); the optimizer state is not read."""
    import torch.distributed.checkpoint as dcp  # only here: the distributed package is heavy to import

    path = Path(path)
    cfg = _sharded_config(path)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")  # storage for DCP to read into; no random init of a model it overwrites
    state = {"model": model.state_dict()}  # keys "model.<name>", as save_sharded stored them
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled...": one process is the intent
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - the latter is a BaseException
        msg = str(e).strip().splitlines()
        raise KilnError(
            f"{path}: the sharded checkpoint does not hold the model of its {MODEL_JSON}: {msg[-1] if msg else e}"
        ) from None
    return _with_state(cfg, state["model"], device, dtype, str(path))


def _with_state(cfg: ModelConfig, state: dict, device, dtype, where: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, assign=True)
    except RuntimeError as e:
        raise KilnError(f"{where}: weights do not match the model config: {str(e).splitlines()[0]}") from None
    return model


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{path} is not valid JSON: {e}") from None


def _config_from_json(d: dict[str, Any], where: str) -> tuple[ModelConfig, str]:
    if "architectures" in d:
        return config_from_hf(d), "hf"
    if "model" in d and isinstance(d["model"], dict):  # a run config or preset
        m = dict(d["model"])
        vocab = (d.get("tokenizer") or {}).get("vocab_size")
        if vocab is not None and "vocab_size" not in m:
            m["vocab_size"] = vocab  # as `kiln run` resolves it
        return ModelConfig.from_dict(m), "run config"
    if "arch" in d:
        return ModelConfig.from_dict(d), "kiln"
    raise KilnError(
        f"{where} is neither an HF config.json, a kiln model.json nor a run config (no 'model' section)"
    )


def _training_checkpoint(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".pt":
        return path
    for d in (path, path / "checkpoints"):
        if (d / POINTER).is_file():
            return d
    return None


def describe_source(src: str | Path) -> tuple[ModelConfig, str]:
    """(config, kind) of a source without loading weights; kind is 'hf', 'kiln', 'training' or 'run config'."""
    path = Path(src)
    if not path.exists():
        if str(src) in PRESETS:
            return _config_from_json(load_preset(str(src)), f"preset {src}")[0], "run config"
        raise KilnError(f"{src} does not exist (and is not a preset: {', '.join(PRESETS)})")
    if path.is_file() and path.suffix == ".json":
        return _config_from_json(_read_json(path), str(path))
    if _is_sharded(path):
        return _sharded_config(path), "sharded"
    if path.is_dir() and (path / MODEL_JSON).is_file():
        return ModelConfig.from_dict(_read_json(path / MODEL_JSON)), "kiln"
    ckpt = _training_checkpoint(path)
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        return _config_from_json(state["config"], str(ckpt))[0], "training"
    if path.is_dir() and (path / "config.json").is_file():
        return _config_from_json(_read_json(path / "config.json"), str(path / "config.json"))
    raise KilnError(
        f"{src} is not a model: expected an HF checkpoint directory, a kiln model directory (model.json), "
        "a training run / checkpoint, or a config .json"
    )


def load_source(
    src: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Transformer, str]:
    """(model with weights, kind) from an HF directory, a kiln model directory or a training checkpoint."""
    path = Path(src)
    if _is_sharded(path):
        return load_sharded_model(path, device, dtype), "sharded"
    if path.is_dir() and (path / MODEL_JSON).is_file():
        return load_model_dir(path, device, dtype), "kiln"
    ckpt = _training_checkpoint(path) if path.exists() else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        if state.get("sharded"):  # kiln run's dcp format: the .pt names the shards' directory beside it
            return load_sharded_model(
                resolve_checkpoint(ckpt).parent / state["sharded"], device, dtype
            ), "sharded"
        cfg, _ = _config_from_json(state["config"], str(ckpt))
        return _with_state(cfg, state["model"], device, dtype, str(ckpt)), "training"
    if path.is_dir() and (path / "config.json").is_file():
        return from_pretrained(path, device, dtype), "hf"
    if not path.exists():
        raise KilnError(
            f"{src} does not exist: give an HF checkpoint directory, a kiln model directory or a training "
            "run / checkpoint"
        )
    raise KilnError(
        f"{src} holds no weights kiln can read: expected an HF checkpoint directory (config.json + safetensors), "
        "a kiln model directory (model.json + model.safetensors) or a training checkpoint"
    )


def tokenizer_dir(src: str | Path) -> Path | None:
    """The directory holding the tokenizer that goes with model source `src`, or None.

    A training run keeps it in its tokenizer/ directory (beside checkpoints/); a kiln model directory or
    an HF checkpoint directory holds it beside the weights (kiln's files or tokenizer.json), as
    `kiln convert` writes them.
    """
    path = Path(src)
    if not path.exists():
        return None
    ckpt = None if (path / MODEL_JSON).is_file() else _training_checkpoint(path)
    if ckpt is not None:
        ckpt_dir = ckpt.parent if ckpt.is_file() else ckpt  # runs/X/checkpoints
        candidates = [ckpt_dir.parent / "tokenizer", ckpt_dir / "tokenizer"]
    else:
        candidates = [path] if path.is_dir() else []
    for d in candidates:
        if any((d / f).is_file() for f in ("kiln_tokenizer.json", "tokenizer.json", "vocab.json")):
            return d
    return None


def load_for_generation(
    checkpoint: str | Path, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[Transformer, Tokenizer]:
    """Model and tokenizer from any model source `kiln generate` takes.

    `checkpoint`: a run directory, its checkpoints/ directory or a step_*.pt file (tokenizer: the run's
    tokenizer/), a kiln model directory (model.json + model.safetensors) or a Hugging Face directory
    (config.json + safetensors); the last two hold their tokenizer beside the weights, as `kiln convert`
    writes them.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise KilnError(
            f"--checkpoint {path} does not exist: pass a run directory, a checkpoint .pt file, "
            "or a model directory written by `kiln convert`"
        )
    tok_dir = tokenizer_dir(path)  # before the weights load: a missing tokenizer fails fast
    if tok_dir is None:
        describe_source(path)  # when `path` is no model at all, that is the message
        raise KilnError(
            f"no tokenizer for {path} (a run keeps it in RUN_DIR/tokenizer/, a model directory beside the "
            "weights): convert the model again with `kiln convert` from its run, which copies the tokenizer, "
            "or put tokenizer.json and tokenizer_config.json beside the weights"
        )
    tok = Tokenizer.load(tok_dir)
    model, _ = load_source(path, device, dtype)
    if tok.n_vocab > model.config.vocab_size:
        raise KilnError(
            f"the tokenizer in {tok_dir} has {tok.n_vocab} ids but the model only {model.config.vocab_size}: "
            "they do not belong together"
        )
    return model, tok
