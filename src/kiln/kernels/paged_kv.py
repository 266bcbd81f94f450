"""The paged KV cache layout, and the kernel that writes new keys and values into it.

Layout (the one `decode_attention` reads; vLLM-v1 / FlashAttention's paged layout):
- k_cache, v_cache (num_blocks, block_size, Hk, D): a pool of fixed-size pages. Page p, slot s holds
  the key/value of one token for all Hk heads, D contiguous.
- block_table (B, max_blocks) int32: sequence b's i-th page is block_table[b, i]; token t of sequence
  b lives at page block_table[b, t // block_size], slot t % block_size. Unused entries are ignored.
- seq_lens (B,) int32: tokens cached per sequence (including the one being decoded).
- slot_mapping (N,) int64: where each of N new tokens goes, flattened as page * block_size + slot;
  negative entries (padding) are skipped. `slot_mapping` below builds it from a block table.

Write: k_cache.view(-1, Hk, D)[slot_mapping[i]] = k[i] for every i with slot_mapping[i] >= 0, and the
same for v. k, v (N, Hk, D) in the cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import pdl, pdl_prologue
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import pow2


# ----------------------------------------------------------------------------------------- reference
def slot_mapping(block_table: torch.Tensor, seq_ids: torch.Tensor, positions: torch.Tensor, block_size: int):
    """Flat cache slots (N,) int64 for tokens at `positions` (N,) of sequences `seq_ids` (N,)."""
    pages = block_table[seq_ids.long(), positions.long() // block_size].long()
    return pages * block_size + positions.long() % block_size


def paged_kv_write_ref(k_cache, v_cache, k, v, slots) -> None:
    keep = slots >= 0
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])  # (num_blocks * block_size, Hk, D)
        flat[slots[keep].long()] = new[keep].to(cache.dtype)


# ------------------------------------------------------------------------------------- Triton kernel
# fmt: off
@triton.jit
def _paged_kv_write_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,  # k, v (N, Hk, D); caches (num_blocks, PAGE_SIZE, Hk, D); slots (N,)
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    Hk, D, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):
    pdl_prologue(PDL)  # before the padding rows' early return too (see pdl_prologue)
    i = tl.program_id(0)  # one new token: all its heads at once
    slot = tl.load(SLOTS + i).to(tl.int64)
    if slot < 0:  # padding
        return
    page = slot // PAGE_SIZE
    pos = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_h[:, None] < Hk) & (offs_d[None, :] < D)
    src_k = K + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = K_CACHE + page * stride_kcp + pos * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = V_CACHE + page * stride_vcp + pos * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=ok).to(K_CACHE.dtype.element_ty), mask=ok)
    tl.store(dst_v, tl.load(src_v, mask=ok).to(V_CACHE.dtype.element_ty), mask=ok)
# fmt: on


# ------------------------------------------------------------------------------------------ launcher
def paged_kv_write_triton(k_cache, v_cache, k, v, slots) -> None:
    N, Hk, D = k.shape
    if N == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    # fmt: off
    _paged_kv_write_kernel[(N,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], Hk, D,
        PAGE_SIZE=k_cache.shape[1], BLOCK_H=pow2(Hk), BLOCK_D=pow2(D), PDL=pdl(k), launch_pdl=pdl(k),
    )
    # fmt: on


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launch): an op that writes into
# the caches in place, declared so (the compiler orders it against reads of the caches).
@torch.library.custom_op("kiln::paged_kv_write", mutates_args=("k_cache", "v_cache"))
def paged_kv_write_op(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    paged_kv_write_triton(k_cache, v_cache, k, v, slots)


@paged_kv_write_op.register_fake
def _(k_cache, v_cache, k, v, slots):
    return None


# ------------------------------------------------------------------------------------------ public op
def paged_kv_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Write k, v (N, Hk, D) into the caches at flat `slots` (N,) (see the module doc), in place."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_kv_write: caches must both be (num_blocks, block_size, Hk, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"paged_kv_write: k, v must be (N, Hk, D) = (N, {k_cache.shape[2]}, {k_cache.shape[3]}), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if slots.shape != (k.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"paged_kv_write: slots must be ({k.shape[0]},) int32/int64, got {tuple(slots.shape)}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_kv_write: the caches' last dim must be contiguous")
    if use_triton(k_cache, v_cache, k, v, slots) and torch.compiler.is_compiling():
        paged_kv_write_op(k_cache, v_cache, k, v, slots)
    elif use_triton(k_cache, v_cache, k, v, slots):
        paged_kv_write_triton(k_cache, v_cache, k, v, slots)
    else:
        paged_kv_write_ref(k_cache, v_cache, k, v, slots)
