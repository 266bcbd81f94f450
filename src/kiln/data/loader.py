"""A deterministic, exactly resumable loader of (input, target) windows from token shards.

Every window is seq_len + 1 consecutive tokens inside one shard (inputs are the first seq_len,
targets the last seq_len). Windows tile each shard without overlap. Each epoch visits them in a
permutation drawn from (seed, epoch); global batch g of an epoch takes windows
perm[g * world * B : (g + 1) * world * B], and rank r takes its B-window slice of it, so DDP ranks
see disjoint data and a single process with world=1 sees the same global batches.

The whole state is (epoch, batch index): `state_dict()` / `load_state_dict()` resume exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from kiln.data.shards import read_shard
from kiln.errors import KilnError


class TokenLoader:
    def __init__(
        self,
        shard_paths: Sequence[str | Path],
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.shards = [read_shard(p) for p in shard_paths]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size = rank, world_size
        # windows as (shard index, start offset), in file order
        shard_idx, starts = [], []
        for i, s in enumerate(self.shards):
            n = (len(s) - 1) // seq_len
            shard_idx.append(np.full(n, i, dtype=np.int64))
            starts.append(np.arange(n, dtype=np.int64) * seq_len)
        self.win_shard = np.concatenate(shard_idx) if shard_idx else np.zeros(0, np.int64)
        self.win_start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.per_step = batch_size * world_size
        if len(self.win_start) < self.per_step:
            total = sum(len(s) for s in self.shards)
            # shards.py names shards {split}_NNN.bin: say which split is short, and what would fix it
            split = Path(shard_paths[0]).name.split("_")[0] if shard_paths else ""
            fix = {
                "val": "raise data.val_fraction, use more data",
                "train": "use more data (or lower data.val_fraction)",
            }.get(split, "use more data")
            raise KilnError(
                f"too little data: the {({'val': 'validation', 'train': 'training'}).get(split, 'token')} split "
                f"has {total} tokens, too few for one batch of {batch_size} x {seq_len} tokens on "
                f"{world_size} rank(s); {fix}, or lower train.batch_size / train.seq_len"
            )
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.win_start) // self.per_step

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.win_start))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.win_start), generator=g).numpy()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (inputs, targets), each (batch_size, seq_len) int64 on the CPU."""
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        first = self.index * self.per_step + self.rank * self.batch_size
        wins = self._perm[first : first + self.batch_size]
        rows = [
            np.asarray(
                self.shards[self.win_shard[w]][self.win_start[w] : self.win_start[w] + self.seq_len + 1]
            )
            for w in wins
        ]
        self.index += 1
        buf = torch.from_numpy(np.stack(rows).astype(np.int64))
        return buf[:, :-1], buf[:, 1:]
