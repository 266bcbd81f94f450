"""The decode step as CUDA graphs: one graph per batch-size bucket, replayed every decode step.

A decode step of a 28-layer model is ~300 small kernels whose launches cost the host more than their
work costs the GPU (15-27 us per launch against a few us of GPU time each, on the H200's host). A CUDA
graph records the whole step once (embedding, every layer, final norm, LM head and the greedy argmax) and
replays it with one launch. A graph replays fixed addresses and shapes, so:

- the step's inputs live in static device buffers of the largest bucket, (Bmax,) for tokens, positions,
  cache slots and context lengths, and (Bmax, W) for the block tables, W = the most pages a sequence can
  hold (max_model_len / block_size): every bucket reads the first B rows;
- a batch of B sequences runs in the smallest bucket >= B (1, 2, 4, 8, ... up to max_graph_batch). The
  padding rows write nowhere (slot -1: paged_kv_write skips it) and attend to one key (context length 1,
  page 0), so every row stays finite and no real row reads them: rows of a decode step are independent;
- the host fills pinned staging buffers (int64 tokens/positions/slots; int32 context lengths, then the
  block tables) and copies the rows of the bucket to the device asynchronously, on the stream the graph
  then replays on (kernels read contiguous rows: the lengths are not a column of the tables);
- with asynchronous scheduling a row's token may be one the previous step sampled and the host has not
  seen yet: `run`'s `feed` names those rows and their rows in the previous step's id tensor, and one
  gather on the device writes them into the static token buffer before the replay (the two index lists
  travel in the same staging copy);
- the outputs are the bf16 logits (B, V) and the argmax ids (B,) of the bucket: views into the graphs'
  shared memory pool. Greedy steps take the ids (the step's one device-to-host copy); other sampling
  parameters run kiln.infer.sampler on the logits after the replay (its host-side branches, chosen per
  batch, are not a fixed graph).

Buckets are captured largest first into one memory pool, so smaller buckets reuse the largest one's
memory (PyTorch's documented pattern for graphs that never run concurrently). Each bucket runs once
eagerly before its capture: Triton compiles and autotunes there, and the rotary tables' memo is filled,
since neither may happen while capturing.

`backend="compile"` wraps the step in torch.compile first (Inductor fuses the PyTorch glue between kiln's
kernels, which stay opaque custom ops) and then captures the compiled step the same way.

On CPU there is no graph: `run` executes the same step eagerly over the same padded static buffers,
which is what the CPU tests check against the unpadded eager path.
"""

from __future__ import annotations

import torch

from kiln.model.attn_metadata import AttnMetadata
from kiln.model.transformer import Transformer


def buckets_up_to(max_batch: int) -> list[int]:
    """1, 2, 4, ... below max_batch, then max_batch itself: [1, 2, 4, 8, 16, 32, 64, 128, 256] for 256."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class DecodeGraphs:
    """Static buffers, one captured decode step per bucket, and `run` (fill, copy, replay)."""

    def __init__(
        self,
        model: Transformer,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        backend: str = "graphs",
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = buckets_up_to(max_batch)
        self.device = device = kv_caches[0][0].device
        self.use_graphs = device.type == "cuda"
        Bmax, W = self.buckets[-1], max_blocks_per_seq
        pin = self.use_graphs
        # host staging and its device copy: rows 0-2 of the int64 buffer are tokens, positions, slots,
        # rows 3-4 the fed rows' source (in the previous step's ids) and destination (in this batch);
        # the int32 buffer holds the context lengths (Bmax,) then the block tables (Bmax, W)
        # Two staging sets, used in turn: with asynchronous scheduling the host fills step N+1's inputs
        # while step N's copy from its set may still wait in the stream behind step N-1; the set is
        # filled again at step N+2, after the engine has waited for step N (kiln.infer.engine).
        self._staging = []
        for _ in range(2):
            h64 = torch.zeros(5, Bmax, dtype=torch.int64, pin_memory=pin)
            h32 = torch.zeros(Bmax * (1 + W), dtype=torch.int32, pin_memory=pin)
            lens, tables = h32[:Bmax], h32[Bmax:].view(Bmax, W)
            self._staging.append((h64, h32, h64.numpy(), lens.numpy(), tables.numpy(), lens, tables))
        self._turn = 0
        self._select(0)
        self.dev64 = torch.zeros(5, Bmax, dtype=torch.int64, device=device)
        self.dev32 = torch.zeros(Bmax * (1 + W), dtype=torch.int32, device=device)
        self.dev_lens, self.dev_tables = self.dev32[:Bmax], self.dev32[Bmax:].view(Bmax, W)
        self.cu_seqlens = torch.arange(Bmax + 1, dtype=torch.int32, device=device)
        self.step_fn = self._step
        if backend == "compile":
            self.step_fn = torch.compile(self._step, dynamic=False)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _select(self, i: int) -> None:
        """Make staging set i the one `run` fills (host tensors and their numpy views)."""
        (
            self.host64,
            self.host32,
            self.np64,
            self.np_lens,
            self.np_tables,
            self.host_lens,
            self.host_tables,
        ) = self._staging[i]

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` rows, or None when the batch is larger than all."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def _meta(self, B: int) -> AttnMetadata:
        return AttnMetadata(
            cu_seqlens_q=self.cu_seqlens[: B + 1],
            max_seqlen_q=1,
            slot_mapping=self.dev64[2, :B],
            context_lens=self.dev_lens[:B],
            block_tables=self.dev_tables[:B],
            decode=True,
        )

    def _step(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode step over the first B rows of the static buffers -> logits (B, V), argmax (B,)."""
        h, _ = self.model.model(self.dev64[0, :B], self.dev64[1, :B], self._meta(B), self.kv_caches)
        logits = self.model.compute_logits(h)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (CUDA only; a no-op on CPU)."""
        if not self.use_graphs:
            return
        self._fill_padding(0, self.buckets[-1])
        self.dev64.copy_(self.host64)
        self.dev32.copy_(self.host32)
        pool = None
        for B in reversed(self.buckets):
            self.step_fn(B)  # compile, autotune, memoize outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[B] = self.step_fn(B)
            pool = graph.pool()
            self.graphs[B] = graph
        torch.cuda.synchronize(self.device)

    def _fill_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 of the staging buffers become padding: token 0 at position 0, no cache write
        (slot -1), one key (page 0)."""
        self.np64[:2, start:end] = 0
        self.np64[2, start:end] = -1
        self.np_lens[start:end] = 1
        self.np_tables[start:end] = 0

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        tables: list[list[int]],
        feed: tuple[torch.Tensor, list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of B = len(tokens) sequences: each sequence's newest token at its position,
        its cache pages `tables[i]`. feed = (prev_ids (R,) int64 on the device, src, dst): row dst[j]'s
        token is prev_ids[src[j]] (its entry in `tokens` is a placeholder), gathered on the device.
        Returns views of the bucket's logits (B, V) and argmax ids (B,), valid until the next run."""
        B = len(tokens)
        Bb = self.bucket(B)
        if Bb is None:
            raise ValueError(
                f"DecodeGraphs.run: batch {B} is larger than the largest bucket {self.buckets[-1]}"
            )
        self._turn ^= 1
        self._select(self._turn)
        bs = self.block_size
        width = self.np_tables.shape[1]
        if max(map(len, tables)) > width:
            raise ValueError(f"DecodeGraphs.run: a block table exceeds the {width} pages captured")
        # Python ints for the per-row arithmetic (numpy scalars cost more), one numpy write per row
        self.np64[0, :B] = tokens
        self.np64[1, :B] = positions
        self.np64[2, :B] = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        self.np_lens[:B] = self.np64[1, :B] + 1
        self.np_tables[:B] = 0
        for i, table in enumerate(tables):
            self.np_tables[i, : len(table)] = table
        self._fill_padding(B, Bb)
        m = 0
        if feed is not None:
            prev_ids, src, dst = feed
            m = len(src)
            self.np64[3, :m] = src
            self.np64[4, :m] = dst
        self.dev64.copy_(self.host64, non_blocking=True)  # (5, Bmax): a few KB, one copy
        self.dev_lens[:Bb].copy_(self.host_lens[:Bb], non_blocking=True)
        self.dev_tables[:Bb].copy_(self.host_tables[:Bb], non_blocking=True)
        if m:
            # stream order: after the previous step wrote prev_ids, before this replay reads the tokens
            self.dev64[0].index_copy_(0, self.dev64[4, :m], prev_ids.index_select(0, self.dev64[3, :m]))
        if self.use_graphs:
            self.graphs[Bb].replay()
            logits, ids = self.outputs[Bb]
        else:
            logits, ids = self.step_fn(Bb)
        return logits[:B], ids[:B]
