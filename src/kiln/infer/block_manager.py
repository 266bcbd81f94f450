"""BlockManager: which KV-cache blocks each sequence owns, with prefix caching of full, computed blocks.

The KV cache is `num_blocks` blocks of `block_size` token slots (the runner owns the tensors; this class
owns the ids). A sequence's block table maps its positions to slots: position p lives in block
block_table[p // block_size] at offset p % block_size.

Prefix caching. A FULL block is identified by a chained content hash:
    h_i = BLAKE2b-128(h_{i-1} || token ids of block i as int64 little-endian),   h_{-1} = b""
so equal hashes mean equal whole prefixes (128 bits: a collision is not a practical concern; a hit also
compares the block's own token ids). A block enters the hash table only once it is full AND its K/V are
computed (`mark_computed`, called after each step), so a hit never reads slots that a chunked prefill
has yet to write. Blocks are reference counted: a hit on a block another sequence holds shares it (its
contents never change again: sequences write only past their computed prefix, into blocks of their own).

Freed blocks (ref count 0) go to the back of the free queue but keep their hash: until the queue hands
them out again they can still be hit (and a hit takes them back out of the queue). Allocation takes from
the front, so the least recently freed block is evicted first; a sequence frees its blocks tail first, so
the end of a prefix is evicted before its start (the start is the part other requests share).

The last token is never a hit: `allocate` reuses at most (num_tokens - 1) // block_size full blocks, so at
least one token is computed and its logits sampled. When the whole sequence is cached blocks (num_tokens a
multiple of block_size), the last full block is not reused: it is recomputed into a fresh block (at most
block_size tokens of extra prefill; the alternative, copying the block to recompute one slot, needs a
device copy the runner would have to schedule).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from kiln.errors import KilnError
from kiln.infer.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The chained hash of a full block: BLAKE2b-128 of the parent's hash and the block's int64 token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise KilnError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise KilnError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.reset_state()

    def reset_state(self) -> None:
        self.ref_counts = [0] * self.num_blocks
        self._hash: list[bytes | None] = [None] * self.num_blocks  # registered hash of each block
        self._tokens: list[list[int] | None] = [None] * self.num_blocks  # its token ids, checked on a hit
        self._cached: dict[bytes, int] = {}  # hash -> block id, for registered blocks (used or free)
        # free block ids; front = next to hand out (least recently freed). An OrderedDict, not a deque:
        # a hit on a free cached block removes it from the middle in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))

    def reset(self) -> None:
        """Forget every block and the whole prefix cache. Only valid with no sequence holding blocks."""
        if self.num_used_blocks:
            raise KilnError(
                f"cannot reset the block manager while {self.num_used_blocks} blocks are in use: "
                "finish or abort the running requests first"
            )
        self.reset_state()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache can currently hit (in use or free)."""
        return len(self._cached)

    # -- prefix matching -------------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """seq.block_hashes extended to cover its first n_blocks full blocks (a content cache)."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < n_blocks:
            i = len(hashes)
            hashes.append(block_hash(hashes[-1] if i else b"", seq.block_token_ids(i, bs)))
        return hashes

    def _match(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of seq's full blocks, leaving its last token uncached.
        None for a request that asks for prompt logprobs: they come from the logits at every prompt
        position, which a cached prefix skips (vLLM does the same)."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        bs = self.block_size
        i = 0
        while i < max_blocks:
            # hash lazily: a miss on block 0 costs one hash, not one per block of a long prompt
            h = self._full_block_hashes(seq, i + 1)[i]
            block = self._cached.get(h)
            if block is None or self._tokens[block] != seq.block_token_ids(i, bs):
                break
            hits.append(block)
            i += 1
        return hits

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that `allocate` would take from the prefix cache now."""
        return len(self._match(seq)) * self.block_size

    # -- allocation ------------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match(seq)
        # a hit on a free cached block takes it out of the free queue, like a new block
        revived = sum(1 for b in hits if self.ref_counts[b] == 0)
        needed = seq.num_blocks_needed(self.block_size) - len(hits) + revived
        return needed <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing the longest cached prefix."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"sequence {seq.seq_id}: not enough free blocks (check can_allocate first)")
        hits = self._match(seq)
        for b in hits:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1
        seq.block_table = hits + [
            self._take_free() for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))
        ]
        del seq.block_hashes[len(hits) :]  # the invariant: one hash per registered block
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * self.block_size

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        h = self._hash[block]
        if h is not None:  # evict: this block's contents are about to be overwritten
            if self._cached.get(h) == block:
                del self._cached[h]
            self._hash[block] = None
            self._tokens[block] = None
        self.ref_counts[block] = 1
        return block

    def _blocks_to_append(self, seq: Sequence) -> int:
        return max(0, seq.num_blocks_needed(self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        """Whether the block table can be grown to cover all current tokens (before a decode step)."""
        return self._blocks_to_append(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Grow the block table to cover all current tokens: a new block when the last token starts one."""
        if not seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} holds no blocks; allocate it first")
        n = self._blocks_to_append(seq)
        if n > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id}: no free block to append (check can_append first)")
        seq.block_table.extend(self._take_free() for _ in range(n))

    # -- after a step ----------------------------------------------------------------------------------

    def mark_computed(self, seq: Sequence, upto: int | None = None) -> None:
        """Register the blocks that became full and computed: those within the first `upto` positions
        (default seq.num_computed_tokens), whose K/V a finished step has written."""
        if not self.enable_prefix_caching:
            return
        n_full = (seq.num_computed_tokens if upto is None else upto) // self.block_size
        bs = self.block_size
        for i in range(len(seq.block_hashes), n_full):
            tokens = seq.block_token_ids(i, bs)
            h = block_hash(seq.block_hashes[-1] if i else b"", tokens)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h in self._cached:
                # another sequence computed the same block first (both prefilled it concurrently): keep
                # that one; this copy stays private and returns to the free list unhashed
                continue
            self._cached[h] = block
            self._hash[block] = h
            self._tokens[block] = tokens

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks; those no one else holds go to the back of the free queue, tail first."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
            elif self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
        seq.block_table = []
        # seq.block_hashes stays: content hashes, valid for the next allocate's prefix match
        seq.num_computed_tokens = 0  # num_cached_tokens stays: the last admission's hit, for statistics
