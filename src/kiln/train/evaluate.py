"""Validation: mean loss and bits per byte, plus the unigram baseline a trained model must beat.

bits per byte = total nats / (ln 2 * total bytes of the target text). It compares models across
tokenizers because it counts text, not tokens. Targets that decode to no bytes (special tokens such
as the document delimiter) are left out of both sums, as nanochat does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch


def token_byte_lengths(tokenizer) -> torch.Tensor:
    """(V,) int64: how many bytes of text each token id stands for (0 for special tokens)."""
    specials = set(tokenizer.special_tokens.values())
    return torch.tensor(
        [0 if i in specials else len(tokenizer.token_bytes(i)) for i in range(tokenizer.n_vocab)],
        dtype=torch.int64,
    )


@torch.no_grad()
def evaluate(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    byte_lengths: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """`loss_fn(x, y)` returns the summed nats over targets that are not -100.

    Under torchrun each rank evaluates its own slice of the validation batches and the sums are
    all-reduced, so every rank returns the figures of the whole validation set.
    """
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # nats, bytes, tokens
    for x, y in batches:
        nb = byte_lengths[y]
        y = y.masked_fill(nb == 0, -100)
        sums[0] += loss_fn(x.to(device), y.to(device)).double()
        sums[1] += int(nb.sum())
        sums[2] += int((nb > 0).sum())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    nats, n_bytes, n_tokens = sums.tolist()
    return {
        "val_loss": nats / max(1.0, n_tokens),
        "val_bpb": nats / (math.log(2) * max(1.0, n_bytes)),
        "val_tokens": int(n_tokens),
    }


def unigram_bpb(
    train_shards: Iterable[np.ndarray], val_tokens: np.ndarray, byte_lengths: torch.Tensor
) -> float:
    """Bits per byte of the add-one-smoothed unigram model of the train shards, on `val_tokens`.

    Counts shard by shard, so a corpus larger than memory is never loaded whole.
    """
    V = len(byte_lengths)
    counts = np.ones(V, dtype=np.float64)  # add-one smoothing
    for shard in train_shards:
        counts += np.bincount(np.asarray(shard, dtype=np.int64), minlength=V)[:V]
    logp = np.log(counts / counts.sum())
    nb = byte_lengths.numpy()
    val = np.asarray(val_tokens, dtype=np.int64)
    keep = nb[val] > 0
    return float(-logp[val[keep]].sum() / (math.log(2) * nb[val[keep]].sum()))
