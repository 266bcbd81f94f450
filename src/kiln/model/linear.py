"""The model's linear layers: plain and merged (fused QKV, fused gate/up), on a chosen matmul backend.

`Linear` is y = x W^T + b like nn.Linear (same attribute names, same init hooks), with the matmul taken
by `KernelConfig.linear` (kiln.model.config):
- "torch": F.linear (cuBLAS on CUDA);
- "kiln": kiln.kernels.matmul.linear (kiln's Triton tile kernel, and its decode kernels for <= 16 rows),
  and at inference the decode kernels' wide tiles for 17-64 rows;
- "auto" (default): kiln's decode kernels where they won on the H200 (CUDA, inference, <= 64 rows: 1.1-2.5x
  cuBLAS at the Qwen2.5-1.5B decode shapes up to 16 rows, docs/perf/matmul_decode.md, and whole decode
  steps 1.07-1.10x at 32-64 sequences with the wide tiles; KILN_DECODE_ROWS moves the bound:
  kiln.model.config.decode_rows), F.linear elsewhere;
- "fp8" / "fp8_rowwise": FP8 training, the forward and both gradient GEMMs in FP8 with tensorwise /
  rowwise scales from the current step (kiln.kernels.fp8_train), the weight kept in its own dtype.
The choice reads only shapes and flags, so it is fixed for a captured decode step.

`MergedLinear` stores several projections of the same input as one weight (sum of out sizes, in), so a
step runs one GEMM instead of two or three: q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`). Its state
dict still speaks the checkpoint names: `...self_attn.q_proj.weight` etc. are views of the slices (a
state-dict hook), and loading takes those names and copies each into its slice (a load pre-hook), so
HF import/export, kiln checkpoints and `init_weights` see the unfused names. Quantized or tensor-parallel
linears later replace these classes, not the model.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.dispatch import sm_count, use_triton
from kiln.kernels.fp8_train import fp8_train_linear
from kiln.kernels.matmul import linear as kiln_linear
from kiln.kernels.matmul_decode import DECODE_MAX_M, decode_config, decode_matmul, preload_weight
from kiln.model.config import decode_rows, decode_sum

DECODE_ROWS = DECODE_MAX_M  # kiln.kernels.matmul_decode handles up to this many rows
DECODE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what kiln's matmul takes
# past DECODE_ROWS, the SwiGLU epilogue from this many rows (MergedLinear.swiglu_fusable)
SWIGLU_WIDE_MIN_ROWS = 33
FP8_RECIPES = {"fp8": "tensorwise", "fp8_rowwise": "rowwise"}  # KernelConfig.linear -> fp8_train recipe


class SplitSum(NamedTuple):
    """A decode matmul's output left as its split-K partial sums (Linear.split_sum), for the add + RMSNorm
    after it to add (kiln.model.layers.Norm, kiln.kernels.rmsnorm.rmsnorm_split): partials (S, N, out)
    float32, the bias (out,) or None, and the output's dtype."""

    partials: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.partials.shape[1:]


class Linear(nn.Module):
    """y = x W^T + b. weight (out_features, in_features), bias (out_features,) or None."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: str = "auto"):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend in FP8_RECIPES:
            return fp8_train_linear(x, self.weight, self.bias, FP8_RECIPES[self.backend])
        rows = self._decode_rows(x)
        if rows > DECODE_ROWS:  # past kiln's matmul's decode rows: the wide tiles (KILN_DECODE_ROWS)
            y = decode_matmul(x.reshape(rows, x.shape[-1]), self.weight.t(), self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if self.backend == "kiln" or rows:
            return kiln_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _decode_rows(self, x: torch.Tensor) -> int:
        """x's rows where they take kiln's decode matmul: a no-gradient call of at most decode_rows() rows
        (DECODE_ROWS under torch.compile, which traces kiln's matmul but not the wide tiles' launcher) in
        the weight's dtype, on CUDA ("auto") or wherever kiln's kernels run ("kiln"), with a plain weight
        (a DTensor's matmul is torch's, sharded); else 0."""
        if not self._takes_decode(x):
            return 0
        rows = x.numel() // max(x.shape[-1], 1)
        limit = DECODE_ROWS if torch.compiler.is_compiling() else decode_rows()
        return rows if 0 < rows <= limit else 0

    def _takes_decode(self, x: torch.Tensor) -> bool:
        """_decode_rows' conditions other than the row count."""
        if self.backend not in ("auto", "kiln"):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):  # training
            return False
        if not (x.is_cuda if self.backend == "auto" else use_triton(x)) or x.dtype != self.weight.dtype:
            return False
        return _plain(self.weight)  # not a DTensor (tensor parallel, FSDP): F.linear

    def reads_early(self, x: torch.Tensor) -> bool:
        """Whether this projection of x (a flat (tokens, features) step) is of one token and
        runs the one-row decode gemv that loads its whole weight before its programmatic-launch wait
        (matmul_decode.preload_weight: qkv and o at the Qwen2.5-1.5B shape), so that the kernel ahead of
        it may let it be scheduled early (`signal_first` of rmsnorm and decode_attention)."""
        return (
            x.dim() == 2
            and x.shape[0] == 1
            and not torch.compiler.is_compiling()
            and self._takes_decode(x)
            and preload_weight(self.out_features, self.in_features)
        )

    # ---- the split add + RMSNorm (KILN_DECODE_NORM=split; kiln.model.transformer.Decoder decides per call)
    def decode_fusable(self, x: torch.Tensor) -> bool:
        """Whether forward(x) would run kiln's decode matmul, so that the split norm's epilogue / prologue
        (add_to_stream, normed_from_stream) may take its place: `decode_step_fusable(x)` holds (checked
        once per step by the caller), the backend reaches kiln's kernels ("kiln", or "auto" on CUDA), the
        weight is a plain tensor of x's dtype and device (not a DTensor of tensor parallelism or FSDP), no
        hooks wrap the call, and no gradient is wanted. Quantized linears are other classes."""
        w, b = self.weight, self.bias
        grad = torch.is_grad_enabled() and (w.requires_grad or (b is not None and b.requires_grad))
        return (
            (self.backend == "kiln" or (self.backend == "auto" and x.is_cuda))
            and _plain(w)
            and w.dtype == x.dtype
            and w.device == x.device
            and not hooked(self)
            and not grad
        )

    def defers_sum(self, x: torch.Tensor) -> bool:
        """Whether self(x) may come back as its split-K partials (split_sum) for the add + RMSNorm after it
        to add (KILN_DECODE_SUM, kiln.model.config.decode_sum): a decode-sized step (up to
        decode_rows() rows) that runs kiln's decode matmul (decode_fusable) with a config that splits K.
        Shapes and flags only: fixed for a captured CUDA graph."""
        # is_compiling first: False under torch.compile, where Dynamo need not trace the cached switches
        # (decode_rows() is evaluated as decode_step_fusable's argument)
        return (
            not torch.compiler.is_compiling()
            and decode_step_fusable(x, decode_rows())
            and decode_sum() != "separate"
            and self.decode_fusable(x)
            and self._rule(x).split_k > 1
        )

    def split_sum(self, x: torch.Tensor) -> SplitSum:
        """self(x) as its split-K partial sums, unsummed (only where defers_sum(x)), at the rule's config:
        the one defers_sum read and self(x) would run."""
        return SplitSum(
            decode_matmul(x, self.weight.t(), config=self._rule(x), defer_sum=True), self.bias, x.dtype
        )

    def _rule(self, x: torch.Tensor):
        """The decode matmul's config for x (N, in) rows of this weight (matmul_decode.decode_config)."""
        return decode_config(x.shape[0], self.out_features, self.in_features, sm_count(x.device))

    def add_to_stream(self, x: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stream + self(x) (N, out), its (N, n) float32 partial sums of squares per column block): the
        decode matmul's residual_sumsq epilogue, rounded as self(x) followed by kiln's add + RMSNorm kernel
        would round the new stream (bit for bit), for the next matmul's rmsnorm prologue. Only where
        `decode_fusable(x)`; x (N, in) with N <= DECODE_ROWS, stream (N, out) of x's dtype."""
        return decode_matmul(
            x, self.weight.t(), self.bias, epilogue="residual_sumsq", residual=stream.contiguous()
        )

    def normed_from_stream(
        self, stream: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """self(rmsnorm(stream) * norm_weight) (N, out) with the norm in the decode matmul's prologue: its
        rstd from `sumsq`, the (N, n) partials that add_to_stream returned with `stream`. Only where
        `decode_fusable(stream)`."""
        return decode_matmul(
            stream,
            self.weight.t(),
            self.bias,
            prologue="rmsnorm",
            norm_weight=norm_weight,
            sumsq=sumsq,
            eps=eps,
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"


def hooked(module: nn.Module) -> bool:
    """Whether hooks that may change a module's inputs or outputs wrap its forward (sequence or tensor
    parallelism's, a user's), so that a fused kernel must not take the module's place. Hooks whose function
    carries `kiln_observer = True` only watch (kiln.profile.naming.module_scopes' profiler ranges) and do
    not count: a profiled step runs the kernels an unprofiled one runs."""
    hooks = (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    return any(not getattr(h, "kiln_observer", False) for h in hooks)


def _plain(w: torch.Tensor) -> bool:
    """Whether a weight is a plain tensor (not a DTensor of tensor parallelism or FSDP, whose matmul is
    torch's, sharded): the decode kernels take only those."""
    return type(w) in (nn.Parameter, torch.Tensor)


def decode_step_fusable(x: torch.Tensor, max_rows: int = DECODE_ROWS) -> bool:
    """The per-call half of Linear.decode_fusable, the same for every linear of a step (x: the step's
    flat hidden states (N, d)): a decode-sized step (0 < N <= max_rows rows: DECODE_ROWS, or decode_rows()
    for a fusion the wide tiles take too) of a dtype kiln's matmul takes, with no gradient, not under
    autocast (a float32 stream meets 16-bit outputs there) or torch.compile (the decode matmul's hooks are
    not registered ops), where kiln's Triton kernels run (CUDA, or the interpreter with the "triton"
    backend: kiln.kernels.dispatch)."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= max_rows
        and x.shape[1] > 0
        and x.dtype in DECODE_DTYPES
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.is_autocast_enabled(x.device.type)
        and not torch.compiler.is_compiling()
        and use_triton(x)
    )


class MergedLinear(Linear):
    """Several projections of one input in one weight; `parts` maps each checkpoint name to its out size.

    forward returns the concatenated outputs (..., sum of sizes); `split(y)` cuts them apart as views.
    """

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, backend: str = "auto"):
        super().__init__(in_features, sum(parts.values()), bias, backend)
        self.parts = dict(parts)
        self._register_state_dict_hook(_split_state)

    def load_from_parts(self, owner: nn.Module, attr: str) -> None:
        """Let `owner` (the module holding this one as `attr`) take the parts' checkpoint names on
        load. The hook sits on the owner because load_state_dict hands a child only the keys under the
        child's own prefix, and the parts are named beside it, not under it."""
        self._merge_hook = owner._register_load_state_dict_pre_hook(
            functools.partial(_merge_state, self, attr)
        )

    def unmerge(self, owner: nn.Module, attr: str, shards: int = 1) -> list[Linear]:
        """Replace this merged projection on `owner` by one Linear per part, registered on `owner` under
        the parts' checkpoint names (so parameter names are the HF names with no state-dict hooks), and
        `owner.<attr>` by a parameterless `SplitCall` that runs them and concatenates, so the owner's
        forward is unchanged. `shards`: each part's output is later split this many ways (tensor
        parallel), so `split` cuts the local outputs at size / shards. Used by kiln.dist, where a
        column-wise split must split each part (q, k and v separately), not the merged rows."""
        parts = []
        for name, a, b in self.slices():
            lin = Linear(self.in_features, b - a, self.bias is not None, self.backend)
            if self.weight.device.type != "meta":
                with torch.no_grad():
                    lin.to(self.weight.device, self.weight.dtype)
                    lin.weight.copy_(self.weight[a:b])
                    if self.bias is not None:
                        lin.bias.copy_(self.bias[a:b])
            else:
                lin.to(device="meta", dtype=self.weight.dtype)
            setattr(owner, name, lin)
            parts.append(lin)
        self._merge_hook.remove()
        delattr(owner, attr)
        object.__setattr__(owner, attr, SplitCall(parts, [s // shards for s in self.parts.values()]))
        return parts

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(list(self.parts.values()), dim=-1))

    def swiglu_fusable(self, x: torch.Tensor) -> bool:
        """Whether swiglu_decode(x) is taken for x's rows: at 1-16 rows of a gate/up shape; past them (the
        wide tiles) from SWIGLU_WIDE_MIN_ROWS rows where the rule's tile takes no split K (the epilogue takes
        none), so that it runs the config self(x) would: Qwen2.5-1.5B's 280 column blocks fill the SMs,
        Qwen3-0.6B's 96 do not (the unfused split then stays). Whole decode steps on the H200
        (Qwen2.5-1.5B, docs/perf/inference.md): 1.033x at 64 sequences, 0.981x at 32, where the wide tile
        is 128 deep in K (3 stages) rather than 64 (4)."""
        rows = x.shape[0]
        if rows <= DECODE_ROWS:
            return True
        return rows >= SWIGLU_WIDE_MIN_ROWS and self._rule(x).split_k == 1

    def swiglu_decode(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu(self(x)) (N, F) for a gate/up projection (two parts of F rows each: gate, then up) with
        the SwiGLU in the decode matmul's epilogue: the bits of self(x) followed by kiln's SwiGLU kernel,
        without the (N, 2F) output or the second launch. Only where `decode_fusable(x)`; x (N, in) with
        N <= decode_rows() (past DECODE_ROWS, the wide tiles' rule: the dot kernel over all of K)."""
        sizes = list(self.parts.values())
        if len(sizes) != 2 or sizes[0] != sizes[1]:
            raise ValueError(f"swiglu_decode: needs two parts of one size (gate, up), got {self.parts}")
        return decode_matmul(x, self.weight.t(), self.bias, epilogue="swiglu")

    def slices(self) -> list[tuple[str, int, int]]:
        """(checkpoint name, first row, end row) of each part in the merged weight."""
        out, start = [], 0
        for name, size in self.parts.items():
            out.append((name, start, start + size))
            start += size
        return out


class SplitCall:
    """What stands where an unmerged MergedLinear stood: calls the parts, concatenates their outputs
    (..., sum of local sizes), and `split` cuts them apart again. Not a module: the parts are
    registered on the owner, once."""

    def __init__(self, parts: list[Linear], local_sizes: list[int]):
        self.parts, self.local_sizes = parts, local_sizes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.local_sizes, dim=-1))


def _parent_prefix(prefix: str) -> str:
    """ "model.layers.0.self_attn.qkv_proj." -> "model.layers.0.self_attn." (where the parts are named)."""
    return prefix[: prefix.rstrip(".").rfind(".") + 1]


def _split_state(module: MergedLinear, state: dict, prefix: str, local_metadata) -> None:
    # The merged entries become one entry per part (views of their rows), in the parts' order.
    parent = _parent_prefix(prefix)
    tensors = {k: state.pop(prefix + k) for k in ("weight", "bias") if prefix + k in state}
    for name, a, b in module.slices():
        for kind, t in tensors.items():
            state[f"{parent}{name}.{kind}"] = t[a:b]


def _merge_state(module: MergedLinear, attr: str, state: dict, prefix: str, *args) -> None:
    # On the owner, at `prefix`: checkpoint names in, the merged tensor out. A missing part leaves the
    # merged key absent, so load_state_dict reports the merged name as missing.
    merged = f"{prefix}{attr}."
    for kind in ("weight", "bias"):
        keys = [f"{prefix}{name}.{kind}" for name, _, _ in module.slices()]
        if merged + kind in state or not all(k in state for k in keys):
            continue
        state[merged + kind] = torch.cat([state.pop(k) for k in keys], dim=0)
