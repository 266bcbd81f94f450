"""ModelConfig: one validated dataclass describing every decoder kiln builds, and the sizes derived from it.

The architecture family (`arch`) fixes the block's shape:
- "gpt2": learned positions, LayerNorm, GELU MLP, biases on every linear and norm, tied head;
- "llama", "mistral", "qwen2", "qwen3", "mixtral": RoPE, RMSNorm, SwiGLU (or a sparse MoE of SwiGLU
  experts when n_experts > 0), no biases except the optional q/k/v bias (Qwen2).
Everything else (GQA ratio, head_dim, q/k norm, window, sinks, RoPE scaling, experts) is an explicit field,
so a config means one model and the HF export only has to check the family can express it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import KilnError

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "mixtral")
ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3")
# the keys each rope_scaling type reads (besides "rope_type"); anything else is an error, not ignored
ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "ntk": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ROPE_REQUIRED = {
    "default": set(),
    "linear": {"factor"},
    "ntk": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
}
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")
LINEAR_BACKENDS = ("auto", "torch", "kiln", "fp8", "fp8_rowwise")
ATTENTION_BACKENDS = ("kiln", "sdpa", "auto")
MOE_BACKENDS = ("auto", "eager", "kiln")


def _env_form(var: str, forms: tuple[str, ...], what: str) -> str:
    """The decode-form switch `var` from the environment: forms[0] when unset or empty, else one of
    `forms`; `what` says what each non-default form does, for the error that names the fix."""
    form = os.environ.get(var, "") or forms[0]
    if form not in forms:
        raise KilnError(
            f"{var}={form!r} is not one of {', '.join(forms)}: unset it (or {forms[0]!r}) for {what}"
        )
    return form


# How a decode step's add + RMSNorm runs (decode_norm): "separate" (kiln's add + RMSNorm kernel between the
# matmuls) or "split" (folded into the decode matmuls around it, kiln.kernels.matmul_decode)
DECODE_NORMS = ("separate", "split")


@functools.cache
def decode_norm() -> str:
    """The decoder's add + RMSNorm form at decode-sized steps: "separate" (the default) unless KILN_DECODE_NORM
    in the environment says "split" (read once, as KILN_DECODE_FORM and KILN_PDL are), so that
    `KILN_DECODE_NORM=split python bench/infer_overlap.py ...` times whole decode steps with the norms split
    across the decode matmuls (o_proj / down_proj's residual_sumsq epilogue, gate_up / qkv's rmsnorm
    prologue) without a code change. Where the split form does not apply, a step runs as with "separate"
    (kiln.model.transformer.Decoder). Off by default: on the H200 at c598f16 whole decode steps with it ran 15%
    slower at batch 1 and 12% at batch 16 (docs/perf/matmul_decode.md)."""
    what = "kiln's add + RMSNorm kernel, 'split' to fold it into the decode matmuls"
    return _env_form("KILN_DECODE_NORM", DECODE_NORMS, what)


# How a one-token decode step runs its q/k/v projection (decode_qkv): "fused" (kiln.kernels.rope.qkv_rope: RoPE
# and the K/V write in the projection's epilogue), "separate" (the decode matmul, then
# kiln.kernels.rope.rope_kv_write) or "norm" (fused, with the block's add + RMSNorm in the kernel too)
DECODE_QKV = ("fused", "separate", "norm")


@functools.cache
def decode_qkv() -> str:
    """The one-token decode step's q/k/v projection form: "fused" (the default) unless KILN_DECODE_QKV says
    "separate" (read once, as KILN_DECODE_NORM is), for A/B timing of whole steps. Where the fused form does
    not apply (q/k norms, more than one token, prefill, the shapes kiln.kernels.rope.qkv_rope does not take),
    a step runs as with "separate" (kiln.model.layers.Attention). On the H200 (7d37105, whole decode steps,
    CUDA-graph replays; docs/perf/inference.md) 1.035x at batch 1 alone and 1.049x with the SwiGLU epilogue,
    once the fused kernel loads its weight before its wait as the separate projection does (at 49cfa51,
    loading nothing early, it tied: 0.998x). "norm" also takes the block's input add + RMSNorm into that
    kernel (kiln.model.transformer.Block.forward, Attention.takes_input_norm): one launch less a layer, and
    a tie in whole steps on the H200 (0.995x at batch 1, 6696200), so not the default."""
    what = (
        "RoPE and the K/V write in the projection's kernel, 'separate' for kiln's RoPE kernel after it, "
        "'norm' for the block's add + RMSNorm in that kernel too"
    )
    return _env_form("KILN_DECODE_QKV", DECODE_QKV, what)


# How many rows of a decode-sized step take kiln's decode matmul rather than cuBLAS (decode_rows): up to 64
# (the default: the gemv and 16-wide dot tiles to 16 rows, the dot kernel's wide tiles past them), or up to
# 16 / 32 / 128
DECODE_ROWS_FORMS = ("64", "16", "32", "128")


@functools.cache
def decode_rows() -> int:
    """The most rows a no-gradient CUDA linear sends to kiln.kernels.matmul_decode (past it: cuBLAS): 64 (the
    default) unless KILN_DECODE_ROWS says 16, 32 or 128 (read once, as KILN_DECODE_NORM is), for A/B timing
    of whole decode steps without a code change (kiln.model.linear.Linear). On the H200 (Qwen2.5-1.5B, CUDA
    graphs, 1k-token contexts; docs/perf/inference.md) the wide tiles up to 64 rows ran whole steps at 1.095x
    (32 sequences) and 1.074x (64) the cuBLAS projections, and tied at 1-16 and 128; at 128 rows cuBLAS's
    kernels were faster than the wide tiles (bench/experiments/decode_wide_sweep.py)."""
    what = "kiln's decode tiles up to 64 rows; 16, 32 or 128 to move cuBLAS's share"
    return int(_env_form("KILN_DECODE_ROWS", DECODE_ROWS_FORMS, what))


# How a decode step's SwiGLU runs (decode_swiglu): "epilogue" (in the gate_up decode matmul's epilogue,
# kiln.kernels.matmul_decode) or "separate" (kiln's SwiGLU kernel after the gate_up matmul)
DECODE_SWIGLUS = ("epilogue", "separate")


@functools.cache
def decode_swiglu() -> str:
    """The gated MLP's SwiGLU form at decode-sized steps: "epilogue" (the default: the SwiGLU in the gate_up
    projection's epilogue, one launch and the (N, 2F) round trip less a layer, the same bits) unless
    KILN_DECODE_SWIGLU in the environment says "separate" (read once, as KILN_DECODE_NORM is), for A/B timing
    of whole decode steps without a code change. Where the epilogue does not apply, a step runs as with
    "separate" (kiln.model.layers.GatedMLP). On the H200 (7d37105, docs/perf/inference.md) whole decode steps
    ran 1.005x at batch 1 and 1.012x at 16 with it, 1.049x at batch 1 with the fused q/k/v too; at 3918cda
    0.999x at 64."""
    what = "the SwiGLU in the gate_up matmul's epilogue, 'separate' for kiln's SwiGLU kernel after it"
    return _env_form("KILN_DECODE_SWIGLU", DECODE_SWIGLUS, what)


# Where a decode step's split-K sums are added (decode_sum): "all" (o_proj's and down_proj's by the add +
# RMSNorm kernel after them, q/k/v's by the RoPE + K/V write kernel), "norm" (o_proj's and down_proj's only)
# or "separate" (each decode matmul's own sum kernel)
DECODE_SUMS = ("all", "norm", "separate")


@functools.cache
def decode_sum() -> str:
    """Where the split-K partial sums of a decode matmul that splits K are added (q/k/v and o_proj at 17-64
    rows, down_proj at 2-64 at the Qwen2.5-1.5B shape): "all" (the default) unless KILN_DECODE_SUM says "norm"
    or "separate" (read once, as KILN_DECODE_NORM is), for A/B timing of whole steps. "all": the add + RMSNorm
    kernel after o_proj or down_proj adds their slices (kiln.kernels.rmsnorm.rmsnorm_split) and the RoPE + K/V
    write kernel the q/k/v projection's (kiln.kernels.rope.rope_kv_write_split), one launch less at each;
    "norm": the norms only; "separate": every matmul's own sum kernel. The projections' outputs and the
    stream are the same bits in every form; a normalized element may move by a bf16 ulp (rstd's sum order).
    Where it does not apply, a step runs as with "separate" (kiln.model.transformer.Decoder). On the H200
    (whole decode steps, CUDA-graph replays; docs/perf/inference.md): "norm" against "separate" 1.010x at 16
    sequences, 1.025x at 32, 1.017x at 64 (0d16ae1); "all" against "norm" 1.019x at 32, 1.065x at 64
    (40d2a12)."""
    what = (
        "the sums in the kernels after the matmuls, 'norm' for the add + RMSNorm's only, 'separate' for each "
        "decode matmul's own split-K sum kernel"
    )
    return _env_form("KILN_DECODE_SUM", DECODE_SUMS, what)


# How a one-token paged decode step runs each dense block (decode_block): "separate" (its ten kernels) or
# "fused" (kiln.kernels.decode_block: the whole block in one launch, grid barriers between its phases)
DECODE_BLOCKS = ("separate", "fused")


@functools.cache
def decode_block() -> str:
    """The one-token decode step's block form: "separate" (the default) unless KILN_DECODE_BLOCK says "fused"
    (read once, as KILN_DECODE_NORM is), for A/B timing of whole steps. Where the fused form does not apply
    (more than one token, prefill, q/k norms, sinks, MoE or GPT-2 blocks, quantized or sharded linears, the
    shapes kiln.kernels.decode_block does not take), a step runs as with "separate"
    (kiln.model.transformer.Decoder)."""
    what = "each block's separate kernels, 'fused' for one launch a block"
    return _env_form("KILN_DECODE_BLOCK", DECODE_BLOCKS, what)


@dataclass
class KernelConfig:
    """Which kernel runs each op of the model; it does not change the model (not saved with weights).

    linear     "auto" (kiln's decode-row kernels for <= 64 rows at inference on CUDA, cuBLAS elsewhere),
               "torch" (F.linear / cuBLAS), "kiln" (kiln's Triton matmul everywhere), or for training
               "fp8" / "fp8_rowwise" (every GEMM of the layer in FP8 with tensorwise / rowwise current
               scaling, master weights untouched; kiln.kernels.fp8_train); kiln.model.linear
    attention  "kiln" (kiln's FlashAttention and paged decode kernels) or "sdpa" (torch's
               scaled_dot_product_attention for dense batches without sinks or masks; kiln elsewhere);
               "auto" is resolved when training starts (the training loop measures both on CUDA)
               and runs as "kiln" until then
    moe        "auto" (kiln's MoE kernels on CUDA, the eager loop elsewhere), "eager" (the per-expert loop,
               the reference: one host sync per layer) or "kiln" (router, permutation and grouped GEMM
               kernels, no host sync, everywhere); kiln.model.moe
    """

    linear: str = "auto"
    attention: str = "kiln"
    moe: str = "auto"

    def __post_init__(self) -> None:
        if self.linear not in LINEAR_BACKENDS:
            raise KilnError(f"kernels.linear {self.linear!r} is not one of {', '.join(LINEAR_BACKENDS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise KilnError(
                f"kernels.attention {self.attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.moe not in MOE_BACKENDS:
            raise KilnError(f"kernels.moe {self.moe!r} is not one of {', '.join(MOE_BACKENDS)}")


@dataclass
class ModelConfig:
    """A decoder-only Transformer. Sizes are per model; `None` fields take the family's derived default.

    arch               family, see the module docstring
    vocab_size         rows of the embedding and the head
    d_model            residual stream width (HF hidden_size)
    n_layers, n_heads  blocks and query heads
    n_kv_heads         key/value heads (GQA; n_heads % n_kv_heads == 0); None = n_heads
    head_dim           per-head width; None = d_model // n_heads (Qwen3 sets it explicitly)
    ffn_hidden         MLP (or per-expert) hidden width (HF intermediate_size)
    max_seq_len        training context; the learned position table's size for GPT-2
    norm_eps           RMSNorm / LayerNorm epsilon
    hidden_act         "silu" (SwiGLU families), "gelu_tanh" or "gelu" (GPT-2's MLP)
    rope_theta         RoPE base
    rope_interleaved   pairs (x[2i], x[2i+1]) as the original RoPE, instead of HF's half-rotated layout
    rope_scaling       None or {"rope_type": one of ROPE_TYPES, ...} with HF's key names
    tie_embeddings     the head reuses the token embedding
    qkv_bias           biases on q/k/v projections (Qwen2); GPT-2 has biases everywhere regardless
    qk_norm            per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window     each query sees only the last `sliding_window` keys (itself included); None = all
    attn_sinks         a learned per-head logit joins every softmax denominator (gpt-oss)
    n_experts          0 = dense MLP; > 0 = sparse MoE with this many SwiGLU experts per block
    n_experts_per_tok  experts each token is routed to (top-k, weights renormalized)
    router_aux_loss_coef  weight of the load-balancing loss `Transformer.loss` adds in training mode
    init_std           std of the normal init (residual projections are scaled down with depth)
    """

    arch: str = "llama"
    vocab_size: int = 32000
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_hidden: int = 2048
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    hidden_act: str | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    attn_sinks: bool = False
    n_experts: int = 0
    n_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.01
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise KilnError(f"model.arch {self.arch!r} is not supported: choose one of {', '.join(ARCHS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise KilnError(f"model.{name} must be a positive integer, got {v!r}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise KilnError(
                f"model.n_heads ({self.n_heads}) must be a positive multiple of model.n_kv_heads "
                f"({self.n_kv_heads})"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise KilnError(
                    f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads}): "
                    "set model.head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.head_dim <= 0 or (self.uses_rope and self.head_dim % 2):
            raise KilnError(f"model.head_dim must be a positive even integer for RoPE, got {self.head_dim}")
        if self.hidden_act is None:
            self.hidden_act = "gelu_tanh" if self.arch == "gpt2" else "silu"
        if self.hidden_act not in HIDDEN_ACTS:
            raise KilnError(
                f"model.hidden_act {self.hidden_act!r} is not supported: choose one of {HIDDEN_ACTS}"
            )
        if self.arch != "gpt2" and self.hidden_act != "silu":
            raise KilnError(f"model.hidden_act must be 'silu' for the gated MLP of arch {self.arch!r}")
        if self.arch == "gpt2" and self.hidden_act == "silu":
            raise KilnError("model.hidden_act must be 'gelu_tanh' or 'gelu' for arch 'gpt2'")
        if not self.norm_eps > 0:
            raise KilnError(f"model.norm_eps must be > 0, got {self.norm_eps}")
        if not self.rope_theta > 0:
            raise KilnError(f"model.rope_theta must be > 0, got {self.rope_theta}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise KilnError(
                f"model.sliding_window must be a positive integer or null, got {self.sliding_window}"
            )
        if self.n_experts < 0:
            raise KilnError(f"model.n_experts must be >= 0, got {self.n_experts}")
        if self.n_experts:
            if self.arch == "gpt2":
                raise KilnError(
                    "model.n_experts > 0 needs a SwiGLU family (llama, qwen2, qwen3, mistral, mixtral)"
                )
            if not 0 < self.n_experts_per_tok <= self.n_experts:
                raise KilnError(
                    f"model.n_experts_per_tok ({self.n_experts_per_tok}) must be in 1..n_experts ({self.n_experts})"
                )
        elif self.arch == "mixtral":
            raise KilnError("arch 'mixtral' needs model.n_experts > 0")
        if self.arch == "gpt2" and (self.rope_scaling is not None or self.rope_interleaved):
            raise KilnError(
                "arch 'gpt2' uses learned positions: model.rope_scaling / rope_interleaved do not apply"
            )
        self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    # ---- derived shape facts -------------------------------------------------------------------------------
    @property
    def uses_rope(self) -> bool:
        return self.arch != "gpt2"

    @property
    def has_bias(self) -> bool:
        """Biases on every linear and norm (GPT-2)."""
        return self.arch == "gpt2"

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling["rope_type"]

    # ---- serialization -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KilnError(f"unknown model config key(s) {unknown}: the known keys are {sorted(known)}")
        return cls(**d)

    # ---- sizes ---------------------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Parameters by part: embedding (tokens + learned positions), attention, mlp (or experts + router),
        norms, head (0 when tied). The sum is the number of distinct parameters of the built model."""
        d, hd, L = self.d_model, self.head_dim, self.n_layers
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        b = self.has_bias
        attn = d * q + 2 * d * kv + q * d
        if b:
            attn += q + 2 * kv + d
        elif self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * hd
        if self.attn_sinks:
            attn += self.n_heads
        if self.n_experts:
            mlp = self.n_experts * 3 * d * self.ffn_hidden + self.n_experts * d
        elif self.arch == "gpt2":
            mlp = 2 * d * self.ffn_hidden + self.ffn_hidden + d
        else:
            mlp = 3 * d * self.ffn_hidden
        norm_size = 2 * d if b else d
        embedding = self.vocab_size * d + (self.max_seq_len * d if self.arch == "gpt2" else 0)
        return {
            "embedding": embedding,
            "attention": L * attn,
            "mlp": L * mlp,
            "norms": (2 * L + 1) * norm_size,
            "head": 0 if self.tie_embeddings else self.vocab_size * d,
        }

    def num_params(self, non_embedding: bool = False) -> int:
        """Distinct parameters; `non_embedding` drops the token and position embeddings (Kaplan et al.),
        but keeps an untied head."""
        c = self.param_counts()
        return sum(c.values()) - (c["embedding"] if non_embedding else 0)

    def active_matmul_params(self) -> int:
        """Weights each token multiplies through (routed experts only; the head, tied or not; no lookups)."""
        d, hd, L = self.d_model, self.head_dim, self.n_layers
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d
        if self.n_experts:
            mlp = self.n_experts_per_tok * 3 * d * self.ffn_hidden + self.n_experts * d
        else:
            mlp = (2 if self.arch == "gpt2" else 3) * d * self.ffn_hidden
        return L * (attn + mlp) + self.vocab_size * d

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward) at sequence length `seq_len`.

        Forward: 2 per multiply-add of every active weight, plus attention's two matmuls (QK^T and PV),
        2 * 2 * head_dim FLOPs per head per attended key. Keys are counted as computed with causal
        masking and the window: a query at position i attends min(i + 1, window) keys, averaged over
        the sequence. (PaLM's 6N + 12*L*H*hd*T counts the full square; this is about half of that term.)
        """
        T = self.max_seq_len if seq_len is None else int(seq_len)
        if T <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        W = self.sliding_window
        if W is None or W >= T:
            mean_ctx = (T + 1) / 2
        else:  # positions 0..W-1 see i+1 keys, the rest see W
            mean_ctx = (W * (W + 1) / 2 + (T - W) * W) / T
        attn = 4 * self.n_layers * self.n_heads * self.head_dim * mean_ctx
        return 3.0 * (2.0 * self.active_matmul_params() + attn)

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes one token's keys and values take in a KV cache of `dtype`, over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


def _check_rope_scaling(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise KilnError(f"model.rope_scaling must be a mapping or null, got {type(rs).__name__}")
    rs = dict(rs)
    kind = rs.get("rope_type", rs.pop("type", None))
    if kind not in ROPE_TYPES:
        raise KilnError(f"model.rope_scaling.rope_type {kind!r} is not supported: choose one of {ROPE_TYPES}")
    rs["rope_type"] = kind
    extra = sorted(set(rs) - ROPE_KEYS[kind] - {"rope_type"})
    if extra:
        raise KilnError(f"model.rope_scaling key(s) {extra} are not used by rope_type {kind!r}")
    missing = sorted(ROPE_REQUIRED[kind] - set(rs))
    if missing:
        raise KilnError(f"model.rope_scaling for rope_type {kind!r} needs key(s) {missing}")
    if "factor" in rs and not (
        isinstance(rs["factor"], int | float) and rs["factor"] > 0 and math.isfinite(rs["factor"])
    ):
        raise KilnError(f"model.rope_scaling.factor must be a positive number, got {rs['factor']!r}")
    if kind == "default":
        return None
    return rs
