"""Quantizing a kiln Transformer, and the quantized model directory kiln writes and reads back.

`quantize_model(model, scheme, calib)` replaces every linear (q/k/v and gate/up stay merged) and, with
`scheme.head`, the LM head by kiln.model.quant_linear.QuantLinear, quantized by round-to-nearest or GPTQ
(kiln.quant.rtn, kiln.quant.gptq). Embeddings and norms stay in float.

A quantized model directory:
    model.json          ModelConfig (as a kiln model directory)
    model.safetensors   the state dict: float tensors in the chosen dtype, and per quantized linear
                        `<name>.qweight`, `<name>.scales` (bf16-exact), `<name>.zeros` (asymmetric int4),
                        `<name>.bias`; merged names (`qkv_proj`, `gate_up_proj`), `lm_head.*` for the head
    quant_config.json   {"format": "kiln-quant", "version": 1, "scheme": {...}, "modules": [names]}
    tokenizer files     copied from the source, when it has them
quant_config.json is written last: a directory without it is not a quantized model (an interrupted write
leaves nothing that loads half-quantized). Each file is written atomically (kiln.io.atomic).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from kiln.errors import KilnError
from kiln.io.atomic import atomic_write_bytes, atomic_write_text
from kiln.model.checkpoint import MODEL_JSON, MODEL_WEIGHTS
from kiln.model.config import ModelConfig
from kiln.model.quant_linear import QuantLinear, quant_linear_like, replace_linears
from kiln.model.transformer import Transformer
from kiln.quant.gptq import gptq_model
from kiln.quant.rtn import quantize_weight
from kiln.quant.scheme import QuantScheme

QUANT_CONFIG = "quant_config.json"
FORMAT, VERSION = "kiln-quant", 1


def check_shapes(model: Transformer, scheme: QuantScheme) -> None:
    """A KilnError naming the first linear whose input size the scheme cannot group, and what to do."""
    if scheme.kind != "int4":
        return
    for name, m in model.named_modules():
        if hasattr(m, "in_features") and m.in_features % scheme.group_size:
            raise KilnError(
                f"{name or 'lm_head'} has {m.in_features} inputs, not a multiple of the int4 group size "
                f"{scheme.group_size}: choose a group that divides it (int4-g32/g64/g128) or int8"
            )


@torch.no_grad()
def quantize_model(
    model: Transformer,
    scheme: QuantScheme,
    calib: Iterable[torch.Tensor] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Quantize `model` in place; returns the names of the modules replaced. `calib`: (B, T) token-id
    batches, needed by GPTQ (which quantizes the blocks' linears; the head is always round-to-nearest)."""
    check_shapes(model, scheme)
    gptq: dict[str, dict] = {}
    if scheme.method == "gptq":
        if calib is None:
            raise KilnError("GPTQ needs calibration text: pass --calib FILE")
        gptq = gptq_model(
            model, calib, scheme.kind, scheme.group_size, scheme.asymmetric, scheme.act_order, log=log
        )

    def make(name: str, module: nn.Module) -> QuantLinear:
        q = quant_linear_like(module, scheme.kind, scheme.group_size, scheme.asymmetric)
        res = gptq.get(name) or quantize_weight(
            module.weight, scheme.kind, scheme.group_size, scheme.asymmetric
        )
        dev = module.weight.device
        q.set_quantized(
            res["qweight"].to(dev),
            res["scales"].to(dev),
            None if res["zeros"] is None else res["zeros"].to(dev),
            None if module.bias is None else module.bias.detach(),
        )
        return q

    return replace_linears(model, make, head=scheme.head)


def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / QUANT_CONFIG).is_file()


def save_quantized(
    model: Transformer, scheme: QuantScheme, out: str | Path, dtype: torch.dtype | None = None
) -> None:
    """Write `model` (quantized by quantize_model) to directory `out` (module docstring); float tensors cast
    to `dtype` (default: as they are)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    modules = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not modules:
        raise ValueError("save_quantized: the model has no quantized linears (run quantize_model first)")
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach().to("cpu")
        if dtype is not None and v.is_floating_point() and not k.endswith(".scales"):
            v = v.to(dtype)
        state[k] = v.contiguous()
    atomic_write_bytes(out / MODEL_WEIGHTS, safetensors_bytes(state, metadata={"format": "pt"}))
    atomic_write_text(out / MODEL_JSON, json.dumps(model.config.to_dict(), indent=2) + "\n")
    cfg = {"format": FORMAT, "version": VERSION, "scheme": scheme.to_dict(), "modules": modules}
    atomic_write_text(out / QUANT_CONFIG, json.dumps(cfg, indent=2) + "\n")


def read_quant_config(path: str | Path) -> tuple[QuantScheme, list[str]]:
    f = Path(path) / QUANT_CONFIG
    try:
        d = json.loads(f.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path} is not a quantized model directory (no {QUANT_CONFIG})") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{f} is not valid JSON: {e}") from None
    if d.get("format") != FORMAT or d.get("version") != VERSION:
        raise KilnError(f"{f}: format {d.get('format')!r} v{d.get('version')} is not {FORMAT} v{VERSION}")
    return QuantScheme.from_dict(d["scheme"]), list(d["modules"])


def load_quantized(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> Transformer:
    """A quantized model directory -> the Transformer with QuantLinears, on `device`, float tensors in `dtype`
    (the quantized values and their scales as stored)."""
    path = Path(path)
    scheme, modules = read_quant_config(path)
    try:
        cfg = ModelConfig.from_dict(json.loads((path / MODEL_JSON).read_text()))
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise KilnError(f"{path / MODEL_JSON} is missing or not valid JSON: {e}") from None
    with torch.device("meta"):
        model = Transformer(cfg)
        wanted = set(modules)
        replace_linears(
            model,
            lambda name, m: (
                quant_linear_like(m, scheme.kind, scheme.group_size, scheme.asymmetric)
                if name in wanted
                else None
            ),
            head="lm_head" in wanted,
        )
    state = load_file(str(path / MODEL_WEIGHTS))
    for k, v in state.items():
        if v.is_floating_point() and not k.endswith(".scales"):
            v = v.to(dtype)
        state[k] = v.to(device)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise KilnError(
            f"{path}: weights do not match the quantized model: {str(e).splitlines()[0]}"
        ) from None
    return model
