"""The decoder-only Transformer: blocks, the causal-LM head and loss, construction and initialization.

Module tree (HF names, so checkpoints load by a rename table):
    model.embed_tokens (V, d)   model.embed_positions (max_seq_len, d) [GPT-2]
    model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.*}
    model.norm                  lm_head (V, d) [absent when tied: the head is embed_tokens]
Blocks are pre-norm: h = h + attn(norm(h)); h = h + mlp(norm(h)), with each residual add fused into the
next norm (Norm.forward takes the stream).

With KILN_DECODE_NORM=split (kiln.model.config.decode_norm; off by default), a decode-sized step (<= 16
flat tokens, no gradient, kiln's Triton kernels) splits each add + RMSNorm between the decode matmuls
around it: o_proj / down_proj add their output to the stream in their epilogue and return its partial
sums of squares, and the next gate_up / qkv normalizes in its prologue (kiln.kernels.matmul_decode). The
Decoder decides per call and per norm (Decoder.norm_split); layer 0's input norm (the stream is the
embedding) and the final norm stay the add + RMSNorm kernel, as does any norm next to a linear that does
not run the decode matmul (quantized, tensor-parallel, MoE, GPT-2's LayerNorm, prefill).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.decode_block import decode_block as fused_block
from kiln.kernels.decode_block import decode_block_supported
from kiln.kernels.linear_cross_entropy import linear_cross_entropy
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.cache import KVCache
from kiln.model.config import KernelConfig, ModelConfig, decode_block, decode_norm, decode_sum
from kiln.model.layers import Attention, GatedMLP, GeluMLP, Norm
from kiln.model.linear import Linear, MergedLinear, decode_step_fusable, hooked
from kiln.model.moe import SparseMoE
from kiln.model.rope import RotaryTables


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: KernelConfig):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = Norm(cfg.d_model, cfg.norm_eps, cfg.has_bias)
        self.self_attn = Attention(cfg, layer_idx, kernels)
        self.post_attention_layernorm = Norm(cfg.d_model, cfg.norm_eps, cfg.has_bias)
        if cfg.n_experts:
            self.mlp = SparseMoE(
                cfg.d_model, cfg.ffn_hidden, cfg.n_experts, cfg.n_experts_per_tok, kernels.moe
            )
        elif cfg.arch == "gpt2":
            self.mlp = GeluMLP(cfg.d_model, cfg.ffn_hidden, cfg.hidden_act, kernels)
        else:
            self.mlp = GatedMLP(cfg.d_model, cfg.ffn_hidden, kernels)

    def forward(self, h, residual, rope, meta, kv_cache=None, key_rope=None, defer_sum=False):
        """h: the previous sublayer's output (N, d), or its SplitSum (the previous block's down_proj
        partials, KILN_DECODE_SUM); residual: the stream it adds to (None before the first block).
        Returns (this block's MLP output, the stream before it, the MoE aux loss or None). defer_sum: the
        caller's next norm takes a SplitSum (Norm.takes_split_sum), so the MLP output may be one."""
        attn = self.self_attn
        norm = self.input_layernorm
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, GatedMLP) else None
        if (
            kv_cache is not None
            and isinstance(h, torch.Tensor)
            and attn.takes_input_norm(h, residual, norm, rope, meta, kv_cache)
        ):
            # one kernel: the add + RMSNorm, q/k/v, RoPE and the K/V write (KILN_DECODE_QKV=norm)
            h, residual = attn(h, rope, meta, kv_cache, key_rope, input_norm=(norm, residual))
        else:
            x, residual = norm(h, residual, into=attn.qkv_proj)
            # KILN_DECODE_SUM: o_proj may leave its split-K sum to the post-attention norm (is_compiling first:
            # a traced step keeps the sum kernel, and Dynamo need not read the switch)
            post_norm = self.post_attention_layernorm
            defer_o = not torch.compiler.is_compiling() and post_norm.takes_split_sum(gate_up)
            h = attn(x, rope, meta, kv_cache, key_rope, defer_sum=defer_o)
        x, residual = self.post_attention_layernorm(h, residual, into=gate_up)
        if isinstance(self.mlp, SparseMoE):
            h, aux = self.mlp(x)
            return h, residual, aux
        if defer_sum and isinstance(self.mlp, GatedMLP):
            return self.mlp(x, defer_sum=True), residual, None
        return self.mlp(x), residual, None

    def fusable(self, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether this block can run as one kernel (forward_fused) at a one-token paged decode step whose
        stream is x (1, d) (decode_step_fusable(x) already holds): a dense SwiGLU block with RMSNorms of one
        eps, no q/k norm, sinks or output bias, every linear on kiln's decode matmul (plain weights: not
        quantized, not sharded), no hooks, at shapes kiln.kernels.decode_block takes."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, GatedMLP) or any(hooked(m) for m in (self, attn, mlp)):
            return False
        norms = (self.input_layernorm, self.post_attention_layernorm)
        lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return (
            attn.q_norm is None
            and attn.sinks is None
            and attn.o_proj.bias is None
            and all(n.splittable(x) for n in norms)
            and norms[0].eps == norms[1].eps
            and all(type(lin) in (Linear, MergedLinear) and lin.decode_fusable(x) for lin in lins)
            and decode_block_supported(x, *(lin.weight for lin in lins), kv_cache[0], attn.n_heads)
        )

    def forward_fused(self, stream, rope, meta, kv_cache, timeline=None) -> torch.Tensor:
        """The block as one kernel (kiln.kernels.decode_block) at a one-token paged decode step: the stream
        (1, d) in, the stream after the block out (what forward's output plus its residual would round to).
        timeline: the kernel's timer probe (decode_block's), for bench/experiments/decode_block_sweep.py."""
        attn, mlp = self.self_attn, self.mlp
        k_cache, v_cache = kv_cache
        return fused_block(
            stream, self.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
            self.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
            self.input_layernorm.eps, rope[0], rope[1], rope[2].reshape(-1), k_cache, v_cache,
            meta.slot_mapping, meta.block_tables, meta.context_lens, attn.n_heads, window=attn.window,
            interleaved=attn.rope_interleaved, timeline=timeline,
        )  # fmt: skip

    def splittable(self, x: torch.Tensor) -> tuple[bool, bool, bool]:
        """Which of this block's matmuls can take the split add + RMSNorm at a step whose stream is x (N, d)
        (decode_step_fusable(x) already holds): (the qkv projection can normalize with input_layernorm
        in its prologue, o_proj + post_attention_layernorm + gate_up can split that norm, down_proj can add
        to the stream in its epilogue). Only dense SwiGLU blocks on plain decode linears, no hooks."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, GatedMLP) or any(hooked(m) for m in (self, attn, mlp)):
            return False, False, False
        fusable = lambda lin: isinstance(lin, Linear) and lin.decode_fusable(x)  # noqa: E731 (not a SplitCall)
        qkv = self.input_layernorm.splittable(x) and fusable(attn.qkv_proj)
        post = (
            self.post_attention_layernorm.splittable(x) and fusable(attn.o_proj) and fusable(mlp.gate_up_proj)
        )
        return qkv, post, fusable(mlp.down_proj)

    def forward_split(self, h, residual, sumsq, rope, meta, kv_cache, key_rope, post: bool, out: bool):
        """The block on a decode-sized step with some of its norms split across the decode matmuls
        (Decoder.norm_split chose which; nothing else changes).

        sumsq None: (h, residual) as forward takes them, input_layernorm runs as the add + RMSNorm kernel.
        sumsq (N, n) float32: the previous block's down_proj already added its output: `residual` is the
        stream (h unused) and sumsq its partial sums of squares; the qkv projection normalizes it in its
        prologue. post: o_proj adds to the stream and gate_up normalizes it (post_attention_layernorm).
        out: down_proj adds to the stream and the block returns (None, stream, its partials) for the next
        block's qkv; else (MLP output, stream before it, None) as forward returns."""
        if sumsq is None:
            x, residual = self.input_layernorm(h, residual)
            prenorm = None
        else:
            x, prenorm = residual, (self.input_layernorm, sumsq)
        if post:
            residual, sumsq = self.self_attn(
                x, rope, meta, kv_cache, key_rope, prenorm=prenorm, stream=residual
            )
            x, prenorm = residual, (self.post_attention_layernorm, sumsq)
        else:
            h = self.self_attn(x, rope, meta, kv_cache, key_rope, prenorm=prenorm)
            x, residual = self.post_attention_layernorm(h, residual)
            prenorm = None
        if out:
            residual, sumsq = self.mlp(x, prenorm=prenorm, stream=residual)
            return None, residual, sumsq
        return self.mlp(x, prenorm=prenorm), residual, None


class Decoder(nn.Module):
    """The decoder stack on the flat-token contract (kiln.model.attn_metadata):

        forward(tokens (N,), positions (N,), meta, kv_caches=None) -> (final-norm output (N, d), aux)

    kv_caches: one (k_cache, v_cache) pair per layer, (num_blocks, block_size, Hk, D) each, when `meta`
    is paged. For dense metadata, positions may be (B, T) (one row expanded over the batch shares its
    RoPE table rows). aux is the mean MoE load-balancing loss over layers, or None.
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig | None = None):
        super().__init__()
        kernels = kernels or KernelConfig()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg, i, kernels) for i in range(cfg.n_layers))
        self.norm = Norm(cfg.d_model, cfg.norm_eps, cfg.has_bias)
        self.rope = RotaryTables(cfg) if cfg.uses_rope else None

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        meta: AttnMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be flat (N,), got shape {tuple(tokens.shape)}")
        if kv_caches is not None and len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries for {len(self.layers)} layers")
        h = self.embed_tokens(tokens)  # (N, d)
        rope = key_rope = None
        if self.rope is not None:
            pos = positions if positions.dim() == 2 else positions[None]  # (B, T) or (1, N)
            rope = self.rope(pos)
            cache = meta.legacy_cache
            if cache is not None and cache.rotate_keys_in_cache:
                B, T = meta.batch_shape
                past = cache.seq_len
                key_rope = self.rope(torch.arange(past + T, device=tokens.device).expand(B, past + T))
        else:
            h = h + self.embed_positions(positions.reshape(-1))
        residual, sumsq, auxes = None, None, []
        fused = self.fused_blocks(h, rope, meta, kv_caches)
        split = None if fused is not None else self.norm_split(h)
        # KILN_DECODE_SUM (norm, all): a down_proj that splits K leaves its sum to the next norm; not beside the
        # fused or split-norm forms (their blocks take a tensor), nor traced (Dynamo need not read the switch)
        defer = (
            fused is None
            and split is None
            and not torch.compiler.is_compiling()
            and decode_sum() != "separate"
        )
        for i, layer in enumerate(self.layers):
            kv = kv_caches[i] if kv_caches is not None else None
            if fused is not None and fused[i]:  # the stream in, the stream out
                h = layer.forward_fused(h if residual is None else h + residual, rope, meta, kv)
                residual = None
                continue
            if split is not None and any(split[i]):
                h, residual, sumsq = layer.forward_split(
                    h, residual, sumsq, rope, meta, kv, key_rope, *split[i][1:]
                )
                continue
            if defer and self._defers_into(i):  # the next norm adds this block's down_proj partials
                h, residual, aux = layer(h, residual, rope, meta, kv, key_rope, defer_sum=True)
            else:
                h, residual, aux = layer(h, residual, rope, meta, kv, key_rope)
            if aux is not None:
                auxes.append(aux)
        h, _ = self.norm(h, residual)
        return h, (torch.stack(auxes).mean() if auxes else None)

    def _defers_into(self, i: int) -> bool:
        """Whether block i may hand its MLP output to the norm after it as a SplitSum (KILN_DECODE_SUM,
        checked by the caller): block i is a plain Block and the norm after it (block i + 1's input norm, or
        the final norm) takes one. The MLP defers only where its down_proj splits K (GatedMLP.forward).
        Module types only: fixed for a captured CUDA graph."""
        if not isinstance(self.layers[i], Block):
            return False
        if i + 1 == len(self.layers):
            return self.norm.takes_split_sum()
        nxt = self.layers[i + 1]
        return isinstance(nxt, Block) and nxt.input_layernorm.takes_split_sum(nxt.self_attn.qkv_proj)

    def fused_blocks(self, h: torch.Tensor, rope, meta: AttnMetadata, kv_caches) -> list[bool] | None:
        """Per block, whether it runs as one kernel (Block.forward_fused) at this step: the switch
        KILN_DECODE_BLOCK=fused (kiln.model.config.decode_block), one token of a paged decode step with RoPE
        on kiln's kernels (decode_step_fusable), and the block qualifies (Block.fusable); None where no block
        does. A fused block takes and returns the stream itself, so fused and separate blocks can alternate.
        Shapes, module types and flags only: fixed for a captured CUDA graph."""
        # is_compiling first: a traced step keeps the separate kernels, and Dynamo need not trace the
        # switch's environment read
        if (
            torch.compiler.is_compiling()
            or decode_block() != "fused"
            or h.shape[0] != 1
            or rope is None
            or kv_caches is None
            or not meta.decode
            or meta.batch_shape is not None
            or not decode_step_fusable(h)
        ):
            return None
        plan = [isinstance(b, Block) and b.fusable(h, kv) for b, kv in zip(self.layers, kv_caches)]
        return plan if any(plan) else None

    def norm_split(self, h: torch.Tensor) -> list[tuple[bool, bool, bool]] | None:
        """Per block (input norm split, post-attention norm split, down_proj adds to the stream) for a step
        whose embedded tokens are h (N, d); None: every norm runs as the add + RMSNorm kernel (the switch
        is off, the step is not decode-sized, nothing qualifies). A norm splits only when the matmul
        before it and the one after it both run kiln's decode matmul: layer 0's input norm has no matmul
        before it and the final norm none after it (the head), so 2 L - 1 of a dense model's 2 L + 1 norms
        split (55 of 57 at 28 layers). Shapes and module types only: fixed for a captured CUDA graph."""
        # is_compiling first: a traced step (the engine's decode_backend="compile") keeps the separate norms,
        # and Dynamo need not trace the switch's environment read
        if torch.compiler.is_compiling() or decode_norm() != "split" or not decode_step_fusable(h):
            return None
        # a wrapped block (activation checkpointing, a compiled module) is called whole, as today
        ready = [b.splittable(h) if isinstance(b, Block) else (False, False, False) for b in self.layers]
        # block i's input norm: block i - 1's down_proj before it, block i's qkv after it
        inp = [i > 0 and ready[i - 1][2] and ready[i][0] for i in range(len(ready))]
        plan = [(inp[i], ready[i][1], i + 1 < len(inp) and inp[i + 1]) for i in range(len(ready))]
        return plan if any(any(p) for p in plan) else None


class Transformer(nn.Module):
    """Causal LM. `model` is the flat-token Decoder (the engine's contract); forward(input_ids (B, T))
    -> logits (B, T, V), loss and generate are the dense wrapper over it (README, "The model")."""

    def __init__(self, cfg: ModelConfig, kernels: KernelConfig | None = None):
        super().__init__()
        self.config = cfg
        self.kernels = kernels or KernelConfig()
        self.model = Decoder(cfg, self.kernels)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def set_kernels(self, kernels: KernelConfig) -> None:
        """Switch the per-op kernel choice of a built model (e.g. one loaded from a checkpoint)."""
        self.kernels = kernels
        for m in self.modules():
            if isinstance(m, Linear):
                m.backend = kernels.linear
            elif isinstance(m, Attention):
                m.attention_backend = kernels.attention
            elif isinstance(m, SparseMoE):
                m.backend = kernels.moe

    @property
    def rope(self) -> RotaryTables | None:
        return self.model.rope

    @property
    def quantized_head(self) -> bool:
        """Whether the head is a quantized module (kiln.model.quant_linear): no float weight to read."""
        return self.lm_head is not None and not isinstance(self.lm_head, nn.Linear)

    @property
    def head_weight(self) -> torch.Tensor:
        """(V, d): the untied head, or the token embedding when tied. With a quantized head, the token
        embedding: it is in the activations' dtype and on the model's device, which is what callers read
        of it (the head's own weight is not a float tensor); `loss` refuses a quantized head."""
        return (
            self.model.embed_tokens.weight
            if self.lm_head is None or self.quantized_head
            else self.lm_head.weight
        )

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (..., d) -> logits (..., V) (the engine calls it on the rows it samples)."""
        if self.quantized_head:
            return self.lm_head(h)
        return F.linear(h, self.head_weight)

    # ---- forward -------------------------------------------------------------------------------------------
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-norm output (B, T, d) and the mean MoE aux loss over layers (None for dense models):
        the dense wrapper, which builds dense AttnMetadata and runs the flat Decoder."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        dev = input_ids.device
        past = cache.seq_len if cache is not None else 0
        default_positions = position_ids is None
        if default_positions:
            position_ids = torch.arange(past, past + T, device=dev).expand(B, T)
        elif position_ids.shape != (B, T):
            raise ValueError(f"position_ids must be {(B, T)}, got {tuple(position_ids.shape)}")
        attn_mask = None
        if attention_mask is not None:
            if attention_mask.shape != (B, past + T):
                raise ValueError(
                    f"attention_mask must be (batch, past + seq) = {(B, past + T)}, got {tuple(attention_mask.shape)}"
                )
            attn_mask = attention_mask.bool()[:, None, None, :].expand(B, 1, T, past + T)
        if self.rope is None and default_positions and past + T > self.config.max_seq_len:
            raise ValueError(
                f"positions up to {past + T} exceed the {self.config.max_seq_len} learned positions"
            )
        meta = AttnMetadata.dense(B, T, attn_mask=attn_mask, legacy_cache=cache)
        h, aux = self.model(input_ids.reshape(-1), position_ids, meta)
        if cache is not None:
            cache.advance(T)
        return h.view(B, T, -1), aux

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """input_ids (B, T) long -> logits (B, T, V).

        position_ids (B, T): default cache.seq_len + arange(T). attention_mask (B, S + T): 1 for real tokens,
        0 for padding, over the cached and the new tokens. cache: a KVCache that this call extends.
        """
        h, _ = self.hidden_states(input_ids, position_ids, attention_mask, cache)
        return self.compute_logits(h)

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        reduction: str = "mean",
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next-token cross-entropy of targets (B, T) (-100 = ignored), through the fused linear + CE op so
        full logits are never held. In training mode, MoE models add router_aux_loss_coef * aux (times the
        number of counted tokens for reduction="sum", so sum / tokens = mean)."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets {tuple(targets.shape)} must match input_ids {tuple(input_ids.shape)}")
        if self.quantized_head:
            raise ValueError(
                "loss() trains through a float head; this model's head is quantized (inference only)"
            )
        h, aux = self.hidden_states(input_ids, position_ids, attention_mask)
        w = self.head_weight
        dev = h.device.type
        if torch.is_autocast_enabled(dev):
            # autocast does not reach custom ops: cast as it would for the head's nn.Linear, so the
            # fused head + loss runs its 16-bit matmul (the loss math itself stays float32)
            dt = torch.get_autocast_dtype(dev)
            h, w = h.to(dt), w.to(dt)
        loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, targets.reshape(-1), reduction=reduction)
        coef = self.config.router_aux_loss_coef
        if self.training and aux is not None and coef:
            scale = coef if reduction == "mean" else coef * (targets != -100).sum()
            loss = loss + scale * aux
        return loss

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        streaming: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Sample up to max_new_tokens after input_ids (B, T) with a KV cache; returns (B, T + new).
        See kiln.model.generate.generate for the arguments."""
        from kiln.model.generate import generate

        return generate(
            self,
            input_ids,
            max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            generator=generator,
            attention_mask=attention_mask,
            streaming=streaming,
        )

    # ---- optimizer groups ----------------------------------------------------------------------------------
    def no_weight_decay_param_names(self) -> set[str]:
        """Names of parameters to exclude from weight decay: every tensor with fewer than 2 dims (norm
        weights, biases, attention sinks). Matrices, embeddings and experts are decayed (nanoGPT's rule)."""
        return {n for n, p in self.named_parameters() if p.dim() < 2}

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two optimizer groups by `no_weight_decay_param_names`, for torch.optim.AdamW(model.param_groups(wd))."""
        skip = self.no_weight_decay_param_names()
        named = list(self.named_parameters())
        return [
            {"params": [p for n, p in named if n not in skip], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n in skip], "weight_decay": 0.0},
        ]

    # ---- initialization ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic init from `seed` (same ids, device and dtype -> the same weights).

        GPT-2 scheme (arch gpt2): every matrix and embedding N(0, std); residual projections (o_proj,
        down_proj) N(0, std / sqrt(2 * n_layers)).
        Llama scheme (the rest, as TorchTitan): matrices truncated normal (+-3 sigma) with std; the
        residual-side projections (o_proj, up_proj, down_proj, experts) std / sqrt(2 * (layer + 1));
        token embedding N(0, 1) with an untied head of std d_model^-0.5 (tied: both d_model^-0.5).
        Norm weights are 1, biases and sink logits 0.
        Tensors are visited by their checkpoint names (merged q/k/v and gate/up by part, see
        kiln.model.linear), so each part gets its own scale and the draws do not depend on the fusion.
        """
        cfg = self.config
        std, L, d = cfg.init_std, cfg.n_layers, cfg.d_model
        gen = torch.Generator(device=self.head_weight.device).manual_seed(seed)
        gpt2 = cfg.arch == "gpt2"
        for name, p in self.state_dict(keep_vars=True).items():
            if p.dim() < 2:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            if name in ("model.embed_tokens.weight", "lm_head.weight", "model.embed_positions.weight"):
                if gpt2:
                    s = std
                elif name == "model.embed_tokens.weight" and not cfg.tie_embeddings:
                    s = 1.0
                else:
                    s = d**-0.5
            elif gpt2:
                s = std / math.sqrt(2 * L) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            else:
                residual_side = name.endswith(("o_proj.weight", "up_proj.weight", "down_proj.weight")) or (
                    ".experts." in name
                )
                layer = int(name.split(".")[2])
                s = std / math.sqrt(2 * (layer + 1)) if residual_side else std
            if gpt2 or "embed_tokens" in name:
                nn.init.normal_(p, 0.0, s, generator=gen)
            else:
                nn.init.trunc_normal_(p, 0.0, s, -3 * s, 3 * s, generator=gen)


def build_model(
    cfg: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    kernels: KernelConfig | None = None,
) -> Transformer:
    """Build on the meta device (no memory, no init work), allocate on `device`, initialize in float32
    from `seed`, then cast to `dtype`."""
    with torch.device("meta"):
        model = Transformer(cfg, kernels)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.to(dtype)
