"""The gpt-fast-style decoder: bench/infer.py's compiled static-cache peer, in plain PyTorch.

What gpt-fast (pytorch-labs/gpt-fast) does to decode fast without an engine, applied to the weights of a
kiln Transformer (copied from its state dict, so both models compute the same function):
- a static KV cache per layer, (B, Hk, max_len, hd), written in place at the step's positions
  (index_copy_), and attention over the WHOLE cache with a causal mask row per query (SDPA with a boolean
  mask and GQA), so every step has the same shapes whatever the context;
- the one-token decode step (forward + greedy argmax) under torch.compile(mode="reduce-overhead",
  fullgraph=True): Inductor fuses the elementwise glue and CUDA graphs remove the per-kernel launches;
- the prompt's prefill runs eagerly (its shape changes with the prompt length).
A static batch of prompts of different lengths (`generate_padded`, bench/infer.py's throughput peer) is
left-padded to the longest: row b's first pads[b] cache slots hold padding, which no real query attends to,
and its RoPE positions start at 0 on its first real token; every row decodes as many steps as the longest
request asks for (static batching: the shorter requests' extra steps are the cost of having no scheduler).
The layers follow gpt-fast's model.py: one fused q/k/v projection (wqkv), one fused gate/up (w13),
RMSNorm in float32 then cast back, residual adds in the model dtype, RoPE in float32 on half-rotated pairs
(HF's layout, kiln's default).

It supports the dense RoPE families kiln's benchmarks use (llama, qwen2 with q/k/v biases, qwen3 with q/k
norm; default RoPE, no window, no sinks, no experts) and refuses anything else. On PLATFORM.md's H200 the
anchor version of this loop (shared/anchors/measure_peers.py) decoded the Qwen2.5-1.5B shape at 503 tok/s
at batch 1 after a 45 s compile.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # gpt-fast's RMSNorm: normalize in float32, back to the model dtype, then scale
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, hd) rotated by cos/sin (T, hd/2) on half-rotated pairs (x[i], x[i + hd/2]), float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class _Layer(nn.Module):
    def __init__(self, cfg, batch: int, max_len: int, dtype: torch.dtype, device):
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.norm_eps
        d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        kw = dict(dtype=dtype, device=device)
        self.wqkv = nn.Linear(d, q + 2 * kv, bias=cfg.qkv_bias, **kw)
        self.wo = nn.Linear(q, d, bias=False, **kw)
        self.w13 = nn.Linear(d, 2 * cfg.ffn_hidden, bias=False, **kw)  # [gate | up]
        self.w2 = nn.Linear(cfg.ffn_hidden, d, bias=False, **kw)
        self.attn_norm = nn.Parameter(torch.ones(d, **kw))
        self.ffn_norm = nn.Parameter(torch.ones(d, **kw))
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.register_buffer("k_cache", torch.zeros(batch, cfg.n_kv_heads, max_len, cfg.head_dim, **kw))
        self.register_buffer("v_cache", torch.zeros(batch, cfg.n_kv_heads, max_len, cfg.head_dim, **kw))

    def forward(self, x, pos, cos, sin, mask):
        """x (B, T, d) at cache slots pos (T,); cos / sin (T, hd/2) or per row (B, 1, T, hd/2); mask
        (1 or B, 1, T, max_len) -> (B, T, d)."""
        B, T, _ = x.shape
        q_w, kv_w = self.n_heads * self.hd, self.n_kv * self.hd
        q, k, v = self.wqkv(_rms_norm(x, self.attn_norm, self.eps)).split([q_w, kv_w, kv_w], dim=-1)
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = _rms_norm(q, self.q_norm, self.eps), _rms_norm(k, self.k_norm, self.eps)
        q = _rope(q.transpose(1, 2), cos, sin)  # (B, Hq, T, hd)
        k = _rope(k.transpose(1, 2), cos, sin)  # (B, Hk, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, q_w))
        gate, up = self.w13(_rms_norm(x, self.ffn_norm, self.eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class GptFastDecoder(nn.Module):
    """Static-cache decoder for `batch` sequences of up to `max_len` tokens; `from_kiln` fills it."""

    def __init__(self, cfg, batch: int, max_len: int, dtype: torch.dtype, device):
        super().__init__()
        if cfg.arch not in ("llama", "qwen2", "qwen3", "mistral") or cfg.n_experts:
            raise ValueError(f"the gpt-fast peer runs dense llama/qwen2/qwen3 shapes, not arch {cfg.arch!r}")
        if cfg.rope_scaling is not None or cfg.rope_interleaved or cfg.sliding_window or cfg.attn_sinks:
            raise ValueError("the gpt-fast peer has default half-rotated RoPE and full attention only")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds the model's {cfg.max_seq_len} positions")
        self.cfg, self.batch, self.max_len = cfg, batch, max_len
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, **kw))
        self.layers = nn.ModuleList(_Layer(cfg, batch, max_len, dtype, device) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.d_model, **kw))
        self.head = (
            None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model, **kw))
        )
        hd = cfg.head_dim
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float().to(device) / hd)
        )
        angles = torch.outer(torch.arange(max_len, device=device).float(), inv_freq)  # (max_len, hd/2)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril())
        self.compiled = False
        self._step = self.decode_step

    @classmethod
    @torch.no_grad()
    def from_kiln(cls, model, batch: int, max_len: int) -> GptFastDecoder:
        """A peer holding a copy of `model`'s weights (a kiln Transformer), on its device and dtype."""
        w = model.head_weight
        peer = cls(model.config, batch, max_len, w.dtype, w.device)
        sd = model.state_dict()
        peer.embed.copy_(sd["model.embed_tokens.weight"])
        peer.norm.copy_(sd["model.norm.weight"])
        if peer.head is not None:
            peer.head.copy_(sd["lm_head.weight"])
        for i, layer in enumerate(peer.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            layer.wqkv.weight.copy_(torch.cat([sd[f"{a}{x}_proj.weight"] for x in "qkv"]))
            if layer.wqkv.bias is not None:
                layer.wqkv.bias.copy_(torch.cat([sd[f"{a}{x}_proj.bias"] for x in "qkv"]))
            layer.wo.weight.copy_(sd[a + "o_proj.weight"])
            layer.w13.weight.copy_(torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]))
            layer.w2.weight.copy_(sd[p + "mlp.down_proj.weight"])
            layer.attn_norm.copy_(sd[p + "input_layernorm.weight"])
            layer.ffn_norm.copy_(sd[p + "post_attention_layernorm.weight"])
            if layer.q_norm is not None:
                layer.q_norm.copy_(sd[a + "q_norm.weight"])
                layer.k_norm.copy_(sd[a + "k_norm.weight"])
        return peer.eval()

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, pads: torch.Tensor | None = None) -> torch.Tensor:
        """ids (B, T) at cache slots pos (T,) -> logits (B, T, V); their K/V go into the static cache.
        pads (B,) int64: row b's first pads[b] slots are left padding (module doc); None: no padding."""
        x = F.embedding(ids, self.embed)
        mask = self.causal[pos][None, None]  # (1, 1, T, max_len): keys up to each query's position
        if pads is None:
            cos, sin = self.cos[pos], self.sin[pos]  # (T, hd/2) float32
        else:
            rope_pos = (pos[None, :] - pads[:, None]).clamp_min(0)  # (B, T): 0 at each row's first real token
            cos, sin = self.cos[rope_pos][:, None], self.sin[rope_pos][:, None]  # (B, 1, T, hd/2)
            slots = torch.arange(self.max_len, device=ids.device)
            real = slots[None, :] >= pads[:, None]  # (B, max_len): keys that are not padding
            # a padding query attends to itself only (finite rows, no NaN written into the cache)
            own = slots[None, :] == pos[:, None]  # (T, max_len)
            mask = mask & (real[:, None, None, :] | own[None, None])  # (B, 1, T, max_len)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        head = self.embed if self.head is None else self.head
        return F.linear(_rms_norm(x, self.norm, self.cfg.norm_eps), head)

    def decode_step(
        self, tok: torch.Tensor, pos: torch.Tensor, pads: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tok (B, 1) at cache slot pos (1,) (rows left-padded by pads) -> the greedy next ids (B, 1)."""
        return self(tok, pos, pads)[:, -1:].argmax(dim=-1)

    def compile_decode(self) -> None:
        """gpt-fast's decode: the one-token step compiled with CUDA graphs (first calls compile it)."""
        self._step = torch.compile(self.decode_step, mode="reduce-overhead", fullgraph=True)
        self.compiled = True

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, dict]:
        """Greedy: prompt (B, P) -> (n new ids (B, n), timings). Timings: ttft_s (the prefill and its
        argmax) and decode_s (the n - 1 decode steps), with the device synchronized at both ends."""
        B, P = prompt.shape
        if B != self.batch or P + n > self.max_len:
            raise ValueError(f"prompt {tuple(prompt.shape)} + {n} tokens does not fit batch {self.batch}, "
                             f"max_len {self.max_len}")  # fmt: skip
        dev = prompt.device
        positions = torch.arange(P + n, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        tok = self(prompt, positions[:P])[:, -1:].argmax(dim=-1)  # (B, 1)
        out = [tok]
        _sync(dev)
        t1 = time.perf_counter()
        for i in range(P, P + n - 1):
            # a CUDA-graph output is overwritten by the next replay: keep a copy
            tok = self._step(tok, positions[i : i + 1]).clone()
            out.append(tok)
        _sync(dev)
        t2 = time.perf_counter()
        return torch.cat(out, dim=1), {"ttft_s": t1 - t0, "decode_s": t2 - t1}

    @torch.no_grad()
    def generate_padded(
        self, prompts: list[list[int]], n: int, chunk: int = 128
    ) -> tuple[torch.Tensor, dict]:
        """Greedy, one static batch: `batch` prompts of any lengths, left-padded to the longest (module doc),
        then n new ids each -> (ids (B, n), timings: ttft_s, decode_s as `generate`). The prefill runs in
        slices of `chunk` positions, so that attention over the padded batch never holds a (B, heads,
        longest prompt, max_len) score tensor at once."""
        B, P = len(prompts), max(len(p) for p in prompts)
        if B != self.batch or P + n > self.max_len:
            raise ValueError(f"{B} prompts of up to {P} tokens + {n} do not fit batch {self.batch}, "
                             f"max_len {self.max_len}")  # fmt: skip
        dev = self.embed.device
        ids = torch.zeros(B, P, dtype=torch.int64)
        for b, p in enumerate(prompts):
            ids[b, P - len(p) :] = torch.tensor(p)
        ids = ids.to(dev)
        pads = torch.tensor([P - len(p) for p in prompts], device=dev)
        positions = torch.arange(P + n, device=dev)
        _sync(dev)
        t0 = time.perf_counter()
        for c0 in range(0, P, chunk):
            logits = self(ids[:, c0 : c0 + chunk], positions[c0 : min(c0 + chunk, P)], pads)
        tok = logits[:, -1:].argmax(dim=-1)  # (B, 1)
        out = [tok]
        _sync(dev)
        t1 = time.perf_counter()
        for i in range(P, P + n - 1):
            tok = self._step(tok, positions[i : i + 1], pads).clone()  # a CUDA-graph output: copy it
            out.append(tok)
        _sync(dev)
        t2 = time.perf_counter()
        return torch.cat(out, dim=1), {"ttft_s": t1 - t0, "decode_s": t2 - t1}


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
