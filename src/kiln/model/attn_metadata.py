"""AttnMetadata: what one forward pass over a flat batch of tokens needs to know about its sequences.

The decoder takes N tokens of S sequences packed one sequence after another: tokens (N,), positions (N,).
Sequence i contributes the rows cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1 of the batch: the last
q_len_i tokens of its first k_len_i tokens (its keys), so one step can mix a whole prompt (q = k), the
next chunk of a long prompt or a prompt whose prefix is already cached (q < k), and decodes (q = 1).
Three ways to run attention follow from it, chosen by host-side fields only (no device-to-host sync):

- dense: `batch_shape = (B, T)`, every sequence is T new tokens with no cache (training, HF parity), or
  the dense `legacy_cache` of `model.generate`; an optional `attn_mask` (padded batches);
- prefill: varlen FlashAttention over the new tokens; where some sequence attends to keys it does not
  compute in this pass (`has_prefix`), its keys are gathered from the paged cache by `key_slots` and
  run with cu_seqlens_k;
- decode (`decode`): one new token per sequence, `decode_attention` over the paged cache through
  `block_tables` and `context_lens`.
New keys and values go into the paged cache at `slot_mapping` (`paged_kv_write`) before attention.
Everything a decode step reads is a device tensor of fixed shape or a host constant, so it can be captured
in a CUDA graph and replayed with new contents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttnMetadata:
    """See the module docstring. Tensors live on the model's device; ints and bools on the host.

    cu_seqlens_q  (S+1,) int32   row bounds of each sequence's new tokens in the flat batch
    max_seqlen_q  int            the most new tokens of one sequence
    cu_seqlens_k  (S+1,) int32   bounds of each sequence's keys (cached prefix + new) in `key_slots`
    max_seqlen_k  int            the most keys of one sequence
    slot_mapping  (N,) int64     paged-cache slot (page * block_size + offset) of each new token; -1 skips
    block_tables  (S, max_blocks) int32   each sequence's cache pages
    context_lens  (S,) int32     keys per sequence (= its position of the last new token + 1)
    key_slots     (total_k,) int64   cache slot of every key of every sequence, in cu_seqlens_k order
                                 (only when has_prefix)
    decode        every sequence has exactly one new token: run the paged decode kernel
    has_prefix    some sequence attends to keys this pass does not compute: gather them from the cache
    batch_shape   (B, T) for the dense path, else None
    attn_mask     dense only: bool (B, 1, T, S + T) allowed pairs, or None
    legacy_cache  dense only: a kiln.model.cache.KVCache extended by this pass (model.generate)
    """

    cu_seqlens_q: torch.Tensor | None = None
    max_seqlen_q: int = 0
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    key_slots: torch.Tensor | None = None
    decode: bool = False
    has_prefix: bool = False
    batch_shape: tuple[int, int] | None = None
    attn_mask: torch.Tensor | None = None
    legacy_cache: object | None = None

    def __post_init__(self) -> None:
        if self.batch_shape is None:
            if self.cu_seqlens_q is None:
                raise ValueError("AttnMetadata needs cu_seqlens_q, or batch_shape for a dense batch")
            if self.decode and self.has_prefix:
                raise ValueError("AttnMetadata: a decode step reads its keys from the cache, not key_slots")
            if self.has_prefix and (self.key_slots is None or self.cu_seqlens_k is None):
                raise ValueError("AttnMetadata: has_prefix needs key_slots and cu_seqlens_k")
            if self.decode and (self.block_tables is None or self.context_lens is None):
                raise ValueError("AttnMetadata: decode needs block_tables and context_lens")
        elif self.attn_mask is not None or self.legacy_cache is not None:
            if self.slot_mapping is not None:
                raise ValueError(
                    "AttnMetadata: a dense mask or legacy cache cannot be used with a paged cache"
                )

    @classmethod
    def dense(
        cls, B: int, T: int, attn_mask: torch.Tensor | None = None, legacy_cache: object | None = None
    ) -> AttnMetadata:
        """B sequences of T new tokens each, attending to themselves (and to a legacy cache)."""
        return cls(
            max_seqlen_q=T, max_seqlen_k=T, batch_shape=(B, T), attn_mask=attn_mask, legacy_cache=legacy_cache
        )
