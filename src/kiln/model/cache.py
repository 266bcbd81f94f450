"""The KV-cache interface the attention layers see, and the two caches `generate` uses.

A forward pass with a cache processes T new tokens per sequence. Each layer calls
    y = cache.attend(layer_idx, q, k, v, window=..., sinks=..., attn_mask=...)
with this pass's q (B, T, Hq, D) and k, v (B, T, Hk, D). The default `attend` stores k, v with
    k_all, v_all = cache.update(layer_idx, k, v)      # (B, S + T, Hk, D)
and runs `kiln.kernels.attention.attention` over all of them (causal alignment to the end handles
S > 0); a paged cache overrides `attend` to write its pages and call a paged decode kernel instead,
with no change to the layers. After the last layer the model calls `cache.advance(T)`.
`cache.seq_len` is S, the tokens stored before this pass.

`rotate_keys_in_cache` tells the layer where RoPE is applied:
- False: keys are rotated at their absolute positions before they are stored (the usual way);
- True: keys are stored unrotated, and all of them are rotated at their slot in the cache on every pass,
  as StreamingLLM does, so that positions stay within what the model was trained on after eviction.
An inference engine's paged cache only has to implement this small interface.
"""

from __future__ import annotations

import abc

import torch

from kiln.kernels.attention import attention


class KVCache(abc.ABC):
    """Interface; see the module docstring."""

    rotate_keys_in_cache: bool = False

    @property
    @abc.abstractmethod
    def seq_len(self) -> int:
        """Tokens stored per sequence before the current pass."""

    @abc.abstractmethod
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this pass's k, v (B, T, Hk, D) of `layer`; return all keys and values (B, S + T, Hk, D)."""

    @abc.abstractmethod
    def advance(self, n: int) -> None:
        """Called once per pass after the last layer: n new tokens are now stored."""

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k, v and attend q (B, T, Hq, D) causally to every stored key: (B, T, Hq, D)."""
        k_all, v_all = self.update(layer, k, v)
        return attention(q, k_all, v_all, causal=True, window=window, sinks=sinks, attn_mask=attn_mask)


class ContiguousKVCache(KVCache):
    """Preallocated (n_layers, B, max_len, Hk, D) buffers for keys and values; positions are absolute."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (n_layers, batch, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self._len + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens do not fit in {self.max_len}")
        self.k[layer, :, self._len : end] = k
        self.v[layer, :, self._len : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def advance(self, n: int) -> None:
        self._len += n


class StreamingKVCache(KVCache):
    """StreamingLLM's policy: keep the first `n_sink` tokens and the last `window` tokens, evict the rest.

    Keys are stored unrotated and rotated at their cache slot each pass (`rotate_keys_in_cache`), so the
    largest position the model ever sees is n_sink + window + T - 1, however long generation runs.
    """

    rotate_keys_in_cache = True

    def __init__(self, n_layers: int, n_sink: int, window: int):
        if n_sink < 0 or window <= 0:
            raise ValueError(f"streaming cache needs n_sink >= 0 and window > 0, got {n_sink}, {window}")
        self.n_sink, self.window = n_sink, window
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k = torch.cat((self.k[layer], k), dim=1)  # (B, S + T, Hk, D)
            v = torch.cat((self.v[layer], v), dim=1)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, n: int) -> None:
        self._len += n
        budget = self.n_sink + self.window
        if self._len <= budget:
            return
        for i, (k, v) in enumerate(zip(self.k, self.v)):
            if k is not None:  # (B, S, Hk, D): sinks, then the most recent `window`
                self.k[i] = torch.cat((k[:, : self.n_sink], k[:, -self.window :]), dim=1)
                self.v[i] = torch.cat((v[:, : self.n_sink], v[:, -self.window :]), dim=1)
        self._len = budget
