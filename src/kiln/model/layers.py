"""The pieces of a block: norms, attention, and the dense MLPs. Every op goes through kiln.kernels.

State-dict names match the HF checkpoints (q_proj, o_proj, gate_proj, input_layernorm, ...), so importing
and exporting weights is a rename table (kiln/model/hf.py); q/k/v and gate/up are stored merged and
presented under their checkpoint names (kiln/model/linear.py). Every layer takes flat tokens (N, d) and
the step's AttnMetadata (kiln/model/attn_metadata.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.attention import attention, tuning_lengths
from kiln.kernels.decode_attention import decode_attention
from kiln.kernels.fp8_matmul import Fp8Rows
from kiln.kernels.launch import pow2
from kiln.kernels.layernorm import layernorm
from kiln.kernels.paged_kv import paged_kv_write
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_fp8, rmsnorm_split
from kiln.kernels.rope import (
    apply_rope,
    qkv_rope,
    qkv_rope_norm_supported,
    qkv_rope_supported,
    rope_kv_write,
    rope_kv_write_split,
)
from kiln.kernels.swiglu import swiglu, swiglu_fp8
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.config import KernelConfig, ModelConfig, decode_qkv, decode_rows, decode_sum, decode_swiglu
from kiln.model.linear import Linear, MergedLinear, SplitSum, decode_step_fusable, hooked
from kiln.model.quant_linear import QuantLinear


def takes_fp8_rows(linear: nn.Module | None, x: torch.Tensor) -> bool:
    """Whether `linear`'s input, made from x (N, any) by a norm or the SwiGLU, should reach it quantized by
    its producer (QuantLinear.takes_fp8_rows)."""
    return isinstance(linear, QuantLinear) and linear.takes_fp8_rows(x)


class Norm(nn.Module):
    """RMSNorm (weight) or LayerNorm (weight and bias) over the last dim.

    forward(x, residual=None) -> (norm(x + residual), x + residual): the pre-norm block hands the
    residual stream through, so the add fuses into the norm kernel. With residual=None, (norm(x), x).
    Under autocast a sublayer's output (bf16) meets a float32 stream: both are promoted to the wider
    dtype first, so the stream keeps its precision (as `residual + h` would in eager PyTorch).
    """

    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, into: nn.Module | None = None
    ) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """into: the linear that takes the output. Where it is an FP8 QuantLinear that wants its rows
        quantized by their producer (QuantLinear.takes_fp8_rows), an RMSNorm returns them as Fp8Rows
        (kiln.kernels.rmsnorm.rmsnorm_fp8: the same bits as norm, then quantize, one launch less).
        x may be a SplitSum (a decode matmul's split-K partials, where takes_split_sum held for its
        producer): the norm kernel adds them (kiln.kernels.rmsnorm.rmsnorm_split)."""
        if isinstance(x, SplitSum):
            return rmsnorm_split(x.partials, x.bias, self.weight, self.eps, residual)
        if residual is not None and residual.dtype != x.dtype:
            wide = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(wide), residual.to(wide)
        if self.bias is None and takes_fp8_rows(into, x):
            return rmsnorm_fp8(x, self.weight, self.eps, residual)
        if self.bias is None:
            # the next projection loads its weight before its wait: it may be scheduled before ours
            first = isinstance(into, (Linear, QuantLinear)) and into.reads_early(x)
            out = rmsnorm(x, self.weight, self.eps, residual, signal_first=first)
        else:
            out = layernorm(x, self.weight, self.bias, self.eps, residual)
        return (out, x) if residual is None else out

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Just the norm, no residual (the per-head q/k norms)."""
        return self(x)[0]

    def takes_split_sum(self, into: nn.Module | None = None) -> bool:
        """Whether this norm, called with a residual stream, may take its input as a SplitSum (the producer's
        split-K partials, Linear.split_sum): an RMSNorm with no hooks whose output does not go to a
        quantized linear (an FP8 one may want its rows quantized by the norm)."""
        return self.bias is None and not hooked(self) and not isinstance(into, QuantLinear)

    def splittable(self, x: torch.Tensor) -> bool:
        """Whether the decode matmuls around this norm may take it over (KILN_DECODE_NORM=split) for a step
        whose stream is x (N, d): an RMSNorm (no bias) whose weight is a plain contiguous tensor on x's
        device, with no hooks wrapping it (sequence parallelism's)."""
        w = self.weight
        return (
            self.bias is None
            and type(w) in (nn.Parameter, torch.Tensor)
            and w.device == x.device
            and w.is_contiguous()
            and not hooked(self)
        )


class Attention(nn.Module):
    """Multi-head attention with GQA (K/V heads never repeated), optional q/k norm, window and sinks.

    q/k/v are one merged projection (`qkv_proj`; checkpoints keep q_proj/k_proj/v_proj, see
    kiln.model.linear). The layer index lives on the layer: it picks this layer's paged cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelConfig | None = None):
        super().__init__()
        kernels = kernels or KernelConfig()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.rope_interleaved = cfg.rope_interleaved
        self.attention_backend = kernels.attention
        d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.has_bias
        self.qkv_proj = MergedLinear(d, {"q_proj": q, "k_proj": kv, "v_proj": kv}, qkv_bias, kernels.linear)
        self.qkv_proj.load_from_parts(self, "qkv_proj")
        self.o_proj = Linear(q, d, cfg.has_bias, kernels.linear)
        if cfg.qk_norm:
            self.q_norm = Norm(cfg.head_dim, cfg.norm_eps, bias=False)
            self.k_norm = Norm(cfg.head_dim, cfg.norm_eps, bias=False)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        meta: AttnMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        *,
        prenorm: tuple[Norm, torch.Tensor] | None = None,
        stream: torch.Tensor | None = None,
        input_norm: tuple[Norm, torch.Tensor | None] | None = None,
        defer_sum: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | SplitSum:
        """x (N, d) -> (N, d). rope = (cos, sin, index) for the N query positions, or None (learned
        positions); kv_cache = this layer's paged (k_cache, v_cache) (num_blocks, block_size, Hk, D);
        key_rope: tables for every key when a legacy cache rotates keys itself (streaming).

        The split add + RMSNorm (decode-sized steps where Linear.decode_fusable holds; Block.forward_split):
        prenorm = (norm, sumsq): x is the residual stream itself and the qkv projection applies `norm` in
        its prologue, its rstd from sumsq (N, n), the partials of the matmul that produced x. stream (N, d):
        o_proj adds its output to it in its epilogue, and the call returns (new stream, its partials).

        input_norm = (norm, residual) (a one-token step where takes_input_norm holds, KILN_DECODE_QKV=norm):
        x is the block's input before its add + RMSNorm, which the fused q/k/v kernel forms itself; the
        call returns (output, the new residual stream).

        defer_sum: the caller's add + RMSNorm takes a SplitSum (Norm.takes_split_sum): where o_proj's decode
        matmul splits K (Linear.defers_sum), the call returns its partials unsummed."""
        if input_norm is not None:
            return self._forward_normed(x, *input_norm, rope, meta, kv_cache)
        N = x.shape[0]
        if prenorm is None and self._fused_qkv(x, rope, meta, kv_cache):
            # one token: the projection rotates q and k and writes k and v into the cache itself
            k_cache, v_cache = kv_cache
            q = qkv_rope(x, self.qkv_proj.weight, self.qkv_proj.bias, rope[0], rope[1], rope[2].reshape(-1),
                         k_cache, v_cache, meta.slot_mapping, self.n_heads, interleaved=self.rope_interleaved)  # fmt: skip
            return self._attend_rotated(q, meta, kv_cache, stream, defer_sum)
        if prenorm is None and self._split_qkv(x, rope, meta, kv_cache):
            # the projection splits K (2-64 rows, KILN_DECODE_SUM=all): the RoPE + K/V write kernel adds its
            # partial sums as it loads them (the same bits as the sum kernel), one launch less
            s = self.qkv_proj.split_sum(x)
            k_cache, v_cache = kv_cache
            q = rope_kv_write_split(s.partials, s.bias, self.n_heads, rope[0], rope[1], rope[2].reshape(-1),
                                    k_cache, v_cache, meta.slot_mapping, interleaved=self.rope_interleaved)  # fmt: skip
            return self._attend_rotated(q, meta, kv_cache, stream, defer_sum)
        if prenorm is None:
            qkv = self.qkv_proj(x)
        else:
            norm, sumsq = prenorm
            qkv = self.qkv_proj.normed_from_stream(x, sumsq, norm.weight, norm.eps)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(N, self.n_heads, self.head_dim)
        k = k.view(N, self.n_kv_heads, self.head_dim)
        v = v.view(N, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        if meta.batch_shape is not None:
            y = self._dense(q, k, v, rope, meta, key_rope)
        else:
            y = self._flat(q, k, v, rope, meta, kv_cache)
        return self._project(y.reshape(N, -1), stream, defer_sum)

    def _project(self, y: torch.Tensor, stream: torch.Tensor | None, defer_sum: bool):
        """o_proj of the attention output y (N, Hq * D): with `stream` (the split norm) (new stream, partials),
        with defer_sum where o_proj defers its split-K sum a SplitSum, else the output."""
        if stream is not None:
            return self.o_proj.add_to_stream(y, stream)
        if defer_sum and isinstance(self.o_proj, Linear) and self.o_proj.defers_sum(y):
            return self.o_proj.split_sum(y)
        return self.o_proj(y)

    def _attend_rotated(
        self,
        q: torch.Tensor,
        meta: AttnMetadata,
        kv_cache,
        stream: torch.Tensor | None,
        defer_sum: bool = False,
    ):
        """Decode attention and the o projection after the fused q/k/v kernel (q (N, Hq, D) rotated, this
        token's K/V in the cache): forward's output (see _project)."""
        k_cache, v_cache = kv_cache
        y = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, window=self.window,
                             sinks=self.sinks, signal_first=self._o_reads_early(q))  # fmt: skip
        return self._project(y.reshape(q.shape[0], -1), stream, defer_sum)

    def takes_input_norm(
        self, h: torch.Tensor, residual, norm: Norm, rope, meta: AttnMetadata, kv_cache
    ) -> bool:
        """Whether this one-token step takes its block's input add + RMSNorm inside the fused q/k/v kernel
        (KILN_DECODE_QKV=norm; forward's input_norm): the fused q/k/v applies to h (the previous sublayer's
        output, or the embeddings), `norm` is a plain RMSNorm of h's dtype, h and the residual stream are
        contiguous rows of one dtype, no hook but the profiler's observers wraps this layer, and the weight
        fits the kernel's preloaded form (kiln.kernels.rope.qkv_rope_norm_supported)."""
        return (
            isinstance(h, torch.Tensor)
            and not torch.compiler.is_compiling()  # first: Dynamo need not trace the switch's read
            and decode_qkv() == "norm"
            and not hooked(self)
            and norm.splittable(h)
            and norm.weight.dtype == h.dtype
            and h.is_contiguous()
            and (residual is None or (residual.dtype == h.dtype and residual.is_contiguous()))
            and self._fused_qkv(h, rope, meta, kv_cache)
            and qkv_rope_norm_supported(self.qkv_proj.weight)
        )

    def _forward_normed(self, h: torch.Tensor, norm: Norm, residual, rope, meta: AttnMetadata, kv_cache):
        """(this sublayer's output, the new residual stream) of a one-token decode step from the block's
        input (takes_input_norm): one kernel adds h to the stream, normalizes, projects q/k/v, rotates and
        writes K/V (kiln.kernels.rope.qkv_rope's norm_weight), then decode attention and o_proj as forward.
        The new stream is the norm kernel's bit for bit; rstd's float32 sum may differ in its last bits."""
        k_cache, v_cache = kv_cache
        q, stream = qkv_rope(h, self.qkv_proj.weight, self.qkv_proj.bias, rope[0], rope[1], rope[2].reshape(-1),
                             k_cache, v_cache, meta.slot_mapping, self.n_heads, interleaved=self.rope_interleaved,
                             pre_k=pow2(h.shape[1]), norm_weight=norm.weight, residual=residual, eps=norm.eps)  # fmt: skip
        return self._attend_rotated(q, meta, kv_cache, None), stream

    def _split_qkv(self, x: torch.Tensor, rope, meta: AttnMetadata, kv_cache) -> bool:
        """Whether this paged decode step's q/k/v projection leaves its split-K sum to the RoPE + K/V write
        kernel (rope_kv_write_split): RoPE and no q/k norm (the path that runs rope_kv_write), the projection a
        plain decode linear in the caches' dtype whose config splits K (Linear.defers_sum: 2-64 rows), and
        KILN_DECODE_SUM=all."""
        return (
            isinstance(x, torch.Tensor)  # not Fp8Rows (an FP8 projection's input)
            and kv_cache is not None
            and rope is not None
            and meta.decode
            and meta.batch_shape is None
            and self.q_norm is None
            and isinstance(self.qkv_proj, Linear)
            and self.qkv_proj.weight.dtype == kv_cache[0].dtype
            and self.qkv_proj.defers_sum(x)
            and decode_sum() == "all"
        )

    def _fused_qkv(self, x: torch.Tensor, rope, meta: AttnMetadata, kv_cache) -> bool:
        """Whether this step's q/k/v projection, RoPE and K/V write run as one kernel (kiln.kernels.rope.qkv_rope):
        decode_qkv() (fused unless KILN_DECODE_QKV=separate), a one-token paged decode step with RoPE and no
        q/k norm, the projection on kiln's decode matmul (a plain float weight, not quantized, no hooks) at
        shapes the kernel takes."""
        return (
            isinstance(x, torch.Tensor)  # not Fp8Rows (an FP8 projection's input)
            and x.shape[0] == 1
            and kv_cache is not None
            and rope is not None
            and meta.decode
            and meta.batch_shape is None
            and self.q_norm is None
            and decode_step_fusable(x)  # False under torch.compile: Dynamo need not trace the switch's read
            and decode_qkv() != "separate"
            and isinstance(self.qkv_proj, Linear)  # not a QuantLinear: the kernel reads a bf16/fp16/fp32 W
            and self.qkv_proj.decode_fusable(x)
            and qkv_rope_supported(x, self.qkv_proj.weight, kv_cache[0], self.n_heads)
        )

    @torch.inference_mode()
    def warm_up_packed(self, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """Run this layer's packed prefill attention (`_flat`'s calls, on zeros) once per autotuning bucket
        of up to `max_len` query rows, over its own keys and over a cached prefix: Triton tunes and
        compiles each bucket's kernels at its first call, seconds apiece, which an inference engine pays
        at start instead of inside the first served step that reaches the bucket."""
        attn = dict(causal=True, window=self.window, sinks=self.sinks)
        for n in tuning_lengths(max_len):
            q = torch.zeros(n, self.n_heads, self.head_dim, device=device, dtype=dtype)
            kv = torch.zeros(n + 1, self.n_kv_heads, self.head_dim, device=device, dtype=dtype)
            cu_q = torch.tensor([0, n], dtype=torch.int32, device=device)
            cu_k = torch.tensor([0, n + 1], dtype=torch.int32, device=device)
            attention(q, kv[:n], kv[:n], cu_seqlens=cu_q, max_seqlen=n, **attn)
            attention(q, kv, kv, cu_seqlens=cu_q, max_seqlen=n, cu_seqlens_k=cu_k, **attn)

    @torch.inference_mode()
    def warm_up_decode(
        self, kv_cache: tuple[torch.Tensor, torch.Tensor], width: int, batches: Iterable[int]
    ) -> None:
        """Compile this layer's decode attention for every decode step that runs eagerly (no graph bucket):
        one launch at each batch size in `batches`, over tables `width` pages wide (the engine pads an
        eager step's tables to that width) and this layer's own paged cache (whether its offsets fit 32 bits
        is part of the kernel). The launcher then picks the split count, split kernel form (decode_attention's
        EARLY) and reduction tile a served step of that batch picks, and their specialization: none is
        compiled mid-serving. Each sequence one key of page 0: reads one page, writes nothing to the cache."""
        k_cache, v_cache = kv_cache
        dev = k_cache.device
        for B in batches:
            q = torch.zeros(B, self.n_heads, self.head_dim, device=dev, dtype=k_cache.dtype)
            lens = torch.ones(B, dtype=torch.int32, device=dev)
            table = torch.zeros(B, width, dtype=torch.int32, device=dev)
            decode_attention(q, k_cache, v_cache, table, lens, window=self.window, sinks=self.sinks)

    def _o_reads_early(self, q: torch.Tensor) -> bool:
        """Whether decode attention may let the o projection be scheduled before its reduction waits:
        where the projection of q's tokens (N, Hq, D) loads its weight early (Linear's or QuantLinear's
        reads_early)."""
        return isinstance(self.o_proj, (Linear, QuantLinear)) and self.o_proj.reads_early(q[:, 0])

    def _flat(self, q, k, v, rope, meta: AttnMetadata, kv_cache):
        """Packed sequences (AttnMetadata's prefill and decode paths): q (N, Hq, D) -> (N, Hq, D)."""
        attn = dict(window=self.window, sinks=self.sinks)
        if kv_cache is not None and meta.decode:
            attn["signal_first"] = self._o_reads_early(q)
        if kv_cache is not None and meta.decode and rope is not None:
            # decode: one kernel rotates q and k and writes k and v into their cache slots (rope[2] is
            # (1, N): each token's table row)
            k_cache, v_cache = kv_cache
            q = rope_kv_write(q, k, v, rope[0], rope[1], rope[2].reshape(-1), k_cache, v_cache,
                              meta.slot_mapping, interleaved=self.rope_interleaved)  # fmt: skip
            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, **attn)
        if rope is not None:  # the kernel takes (B, T, H, D): the flat batch is one row of N
            q, k = apply_rope(q[None], k[None], *rope, interleaved=self.rope_interleaved)
            q, k = q[0], k[0]
        if kv_cache is not None:
            k_cache, v_cache = kv_cache
            paged_kv_write(k_cache, v_cache, k, v, meta.slot_mapping)
            if meta.decode:
                return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, **attn)
            if meta.has_prefix:  # keys this pass did not compute: read every key back from the cache
                k = k_cache.view(-1, *k_cache.shape[2:])[meta.key_slots]  # (total_k, Hk, D)
                v = v_cache.view(-1, *v_cache.shape[2:])[meta.key_slots]
                return attention(
                    q, k, v, causal=True, cu_seqlens=meta.cu_seqlens_q, max_seqlen=meta.max_seqlen_q,
                    cu_seqlens_k=meta.cu_seqlens_k, **attn,
                )  # fmt: skip
        elif meta.decode or meta.has_prefix:
            raise ValueError("attention: decode and cached-prefix steps need the layer's paged KV cache")
        return attention(
            q, k, v, causal=True, cu_seqlens=meta.cu_seqlens_q, max_seqlen=meta.max_seqlen_q, **attn
        )

    def _dense(self, q, k, v, rope, meta: AttnMetadata, key_rope):
        """B sequences of T tokens (training, HF parity, model.generate's legacy cache) -> (N, Hq, D)."""
        B, T = meta.batch_shape
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        cache = meta.legacy_cache
        attn = dict(window=self.window, sinks=self.sinks, attn_mask=meta.attn_mask)
        if cache is not None and cache.rotate_keys_in_cache:
            # streaming: keys are stored unrotated, then queries and all keys are rotated at their cache
            # slots; apply_rope rotates a pair of one length, so each side goes as both arguments
            k, v = cache.update(self.layer_idx, k, v)  # (B, S + T, Hk, D)
            if rope is not None:
                q = apply_rope(q, q, *rope[:2], rope[2], interleaved=self.rope_interleaved)[0]
                k = apply_rope(k, k, *key_rope[:2], key_rope[2], interleaved=self.rope_interleaved)[0]
            return attention(q, k, v, causal=True, **attn)
        if rope is not None:
            q, k = apply_rope(q, k, *rope[:2], rope[2], interleaved=self.rope_interleaved)
        if cache is not None:
            return cache.attend(self.layer_idx, q, k, v, **attn)
        if (
            self.attention_backend == "sdpa"
            and self.sinks is None
            and meta.attn_mask is None
            and self.window is None
        ):
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return y.transpose(1, 2)
        return attention(q, k, v, causal=True, **attn)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama / Qwen / Mistral; gate and up are one merged projection."""

    def __init__(self, d_model: int, hidden: int, kernels: KernelConfig | None = None):
        super().__init__()
        kernels = kernels or KernelConfig()
        self.gate_up_proj = MergedLinear(
            d_model, {"gate_proj": hidden, "up_proj": hidden}, False, kernels.linear
        )
        self.gate_up_proj.load_from_parts(self, "gate_up_proj")
        self.down_proj = Linear(hidden, d_model, False, kernels.linear)

    def forward(
        self,
        x: torch.Tensor,
        *,
        prenorm: tuple[Norm, torch.Tensor] | None = None,
        stream: torch.Tensor | None = None,
        defer_sum: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | SplitSum:
        """x (N, d) -> (N, d). The split add + RMSNorm (as Attention.forward's): prenorm = (norm, sumsq):
        x is the stream and gate_up applies `norm` in its prologue; stream: down_proj adds its output to it
        and the call returns (new stream, its (N, n) partial sums of squares). defer_sum: the caller's next
        add + RMSNorm takes a SplitSum: where down_proj splits K (Linear.defers_sum), its partials unsummed.

        Unless KILN_DECODE_SWIGLU=separate (kiln.model.config.decode_swiglu), a decode-sized step whose gate_up
        runs kiln's decode matmul takes the SwiGLU in that matmul's epilogue (MergedLinear.swiglu_decode:
        the same bits, one launch less); with prenorm (the split norm) it keeps the separate kernel."""
        if prenorm is None and self._swiglu_in_epilogue(x):
            a = self.gate_up_proj.swiglu_decode(x)  # (N, F)
        else:
            if prenorm is None:
                h = self.gate_up_proj(x)  # (N, 2F): [gate | up] in one tensor
            else:
                norm, sumsq = prenorm
                h = self.gate_up_proj.normed_from_stream(x, sumsq, norm.weight, norm.eps)
            # Not kiln.kernels.swiglu.swiglu_linear (the SwiGLU in the down projection's decode prologue): on
            # the H200 at one row (Qwen2.5-1.5B shape, CUDA graphs) it took 415 us a step for the 28 layers
            # against 287 us for the SwiGLU kernel + the decode matmul, since every column block recomputes
            # the SwiGLU of the whole row (docs/perf/inference.md).
            a = swiglu_fp8(h) if takes_fp8_rows(self.down_proj, h) else swiglu(h, None)  # (N, F)
        if stream is not None:
            return self.down_proj.add_to_stream(a, stream)
        if defer_sum and isinstance(self.down_proj, Linear) and self.down_proj.defers_sum(a):
            return self.down_proj.split_sum(a)
        return self.down_proj(a)

    def _swiglu_in_epilogue(self, x: torch.Tensor) -> bool:
        """Whether this call's SwiGLU goes into gate_up's decode epilogue: the switch says so, the step is
        decode-sized (decode_step_fusable, up to decode_rows(): the wide tiles' 33-64 rows too, where the
        rule takes no split K at gate_up's width: MergedLinear.swiglu_fusable) and gate_up runs kiln's decode
        matmul as a plain merged linear (not unmerged by tensor parallelism, no hooks), or is an int8 / int4
        QuantLinear at one token on its fma form (QuantLinear.swiglu_fusable). Shapes and flags only: fixed
        for a captured CUDA graph."""
        # is_compiling first: a traced step keeps the separate kernel, and Dynamo need not trace the
        # switch's environment read
        gate_up = self.gate_up_proj
        if torch.compiler.is_compiling() or decode_swiglu() != "epilogue":
            return False
        if isinstance(gate_up, QuantLinear):  # int8 / int4 at one row on the fma form; x not an FP8 Fp8Rows
            # (hooks checked on the module: a tensor-parallel gate_up is a SplitCall, neither class)
            return (
                not hooked(gate_up)
                and isinstance(x, torch.Tensor)
                and decode_step_fusable(x)
                and gate_up.swiglu_fusable(x)
            )
        return (
            isinstance(gate_up, MergedLinear)
            and decode_step_fusable(x, decode_rows())
            and gate_up.decode_fusable(x)
            and gate_up.swiglu_fusable(x)
        )


class GeluMLP(nn.Module):
    """down(gelu(up(x))) with biases: GPT-2 (its c_fc is up_proj, its mlp.c_proj is down_proj)."""

    def __init__(self, d_model: int, hidden: int, act: str, kernels: KernelConfig | None = None):
        super().__init__()
        kernels = kernels or KernelConfig()
        self.approximate = "tanh" if act == "gelu_tanh" else "none"
        self.up_proj = Linear(d_model, hidden, True, kernels.linear)
        self.down_proj = Linear(hidden, d_model, True, kernels.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
