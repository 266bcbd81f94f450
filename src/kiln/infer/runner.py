"""ModelRunner: the paged KV cache, and one model forward per scheduled batch.

The runner turns a ScheduledBatch (kiln.infer.scheduler) into the model's flat-token inputs
(kiln.model.attn_metadata): the new tokens of every sequence packed one after another, their positions,
and the metadata that routes attention (dense prefill, prefill over a cached prefix, or paged decode).
It owns one (k_cache, v_cache) pair per layer, each (num_blocks, block_size, Hk, D), sized at start from
free device memory (CUDA) or a byte budget (CPU). The metadata is built on the host from the sequences'
block tables and copied to the device once per step (from pinned memory, asynchronously on CUDA); the
forward then runs with no device-to-host sync.

With asynchronous scheduling a decode row's token may be one the previous step sampled and the host has
not seen: `execute`'s `feed` names those rows and where their ids are in the previous step's sampled-id
tensor, which is gathered into the step's token tensor on the device (never through the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.infer.config import EngineConfig
from kiln.infer.cuda_graph import DecodeGraphs
from kiln.infer.scheduler import ScheduledBatch
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.transformer import Transformer


@dataclass
class StepInputs:
    """The flat batch of one step: tokens and positions (N,), the metadata, and the host row bounds."""

    tokens: torch.Tensor
    positions: torch.Tensor
    meta: AttnMetadata
    cu_seqlens: list[int]  # host copy of cu_seqlens_q

    def sample_rows(self, batch: ScheduledBatch) -> list[int]:
        """Rows of the flat batch whose hidden state is sampled: each sampling sequence's last new token."""
        return [self.cu_seqlens[i + 1] - 1 for i in batch.sampling_indices]


@dataclass
class StepOutput:
    """What a step leaves for sampling. logits (rows, V): one row per sampling sequence (float32 from
    the eager path, the model dtype from a graph); greedy_ids (rows,): their argmax when the step computed
    it (graphs), else None. inputs and hidden: the eager path's flat batch (prompt logprobs read them)."""

    logits: torch.Tensor | None
    greedy_ids: torch.Tensor | None = None
    inputs: StepInputs | None = None
    hidden: torch.Tensor | None = None


@dataclass
class Feed:
    """Tokens a step takes from the previous step's sampled ids on the device: batch row rows[j]'s (only)
    new token is prev_ids[src[j]]. prev_ids: (R,) int64, the previous step's sampling rows."""

    prev_ids: torch.Tensor
    rows: list[int]
    src: list[int]


def _token_slice(seq, start: int, end: int) -> list[int]:
    """seq.token_ids[start:end] without building prompt + output first (O(n), not O(length), per step)."""
    P = seq.num_prompt_tokens
    if start >= P:
        return seq.output_token_ids[start - P : end - P]
    if end <= P:
        return seq.prompt_token_ids[start:end]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[: end - P]


class ModelRunner:
    def __init__(self, model: Transformer, config: EngineConfig, device: torch.device, max_model_len: int):
        self.model = model
        self.config = config
        self.device = device
        self.dtype = model.head_weight.dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        # an eager decode step's block tables are this many pages wide, as a captured step's: the width, and
        # with it decode attention's split count and kernel specialization, then follow the batch alone,
        # so warm_up compiles every one a served step can meet
        self.table_width = -(-max_model_len // config.block_size)
        cfg = model.config
        self.cache_shape_tail = (config.block_size, cfg.n_kv_heads, cfg.head_dim)
        self.bytes_per_block = 2 * cfg.n_layers * int(np.prod(self.cache_shape_tail)) * self.dtype.itemsize
        self.num_blocks = config.num_blocks or self._blocks_that_fit()
        self.kv_caches = [
            (
                torch.zeros(self.num_blocks, *self.cache_shape_tail, dtype=self.dtype, device=device),
                torch.zeros(self.num_blocks, *self.cache_shape_tail, dtype=self.dtype, device=device),
            )
            for _ in range(cfg.n_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        # a module that syncs with the host (the eager MoE dispatch) cannot be captured: decode eagerly
        capturable = all(getattr(m, "capturable", True) for m in model.modules())
        if config.decode_backend != "eager" and capturable:
            self.graphs = DecodeGraphs(
                model,
                self.kv_caches,
                max_batch=min(config.max_graph_batch, config.max_num_seqs),
                max_blocks_per_seq=self.table_width,
                block_size=config.block_size,
                backend=config.decode_backend if device.type == "cuda" else "graphs",
            )
            self.graphs.capture()

    def warm_up(self) -> int:
        """Tune and compile the attention kernels of every step shape the engine can meet, so
        no served step stops for seconds to do it (at a4104d9 `kiln serve` spent 5-6 s in single steps
        autotuning the prefill attention for a length bucket it met mid-load): the packed prefill at each
        length bucket up to a step's budget, with and without a cached prefix, and, where decode steps
        can run without a graph, decode attention at every batch size such a step can have (the graphs'
        largest bucket + 1 up to max_num_seqs; all of them without graphs). One pass per distinct layer kind
        (window, sinks). Returns the number of layer kinds warmed. (It runs on CPU too, through the
        references or the interpreter, with nothing to tune: the engine calls it on CUDA.)"""
        max_len = min(self.config.max_num_batched_tokens, self.max_model_len)
        first_eager = 1 if self.graphs is None else self.graphs.buckets[-1] + 1
        eager_batches = range(first_eager, self.config.max_num_seqs + 1)
        kinds = {}
        for block in self.model.model.layers:
            attn = block.self_attn
            kinds.setdefault((attn.window, attn.sinks is not None), attn)
        for attn in kinds.values():
            attn.warm_up_packed(max_len, self.device, self.dtype)
            if eager_batches:
                attn.warm_up_decode(self.kv_caches[attn.layer_idx], self.table_width, eager_batches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(kinds)

    # ---- capacity ----------------------------------------------------------------------------------------
    def _blocks_that_fit(self) -> int:
        """KV pages the budget holds. CUDA: free memory after the weights, times memory_fraction, less
        the peak of a profiling step of max_num_batched_tokens tokens (activations and logits)."""
        if self.device.type != "cuda":
            return max(1, self.config.cpu_kv_cache_bytes // self.bytes_per_block)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_step()
        activations = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(free * self.config.memory_fraction) - activations
        return max(1, budget // self.bytes_per_block)

    @torch.inference_mode()
    def _profile_step(self) -> None:
        n = self.config.max_num_batched_tokens
        lens = [min(n - i, self.max_model_len) for i in range(0, n, self.max_model_len)]
        cu = np.concatenate(([0], np.cumsum(lens))).tolist()
        tokens = torch.zeros(n, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(k, device=self.device) for k in lens])
        meta = AttnMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device), max_seqlen_q=max(lens)
        )
        h, _ = self.model.model(tokens, positions, meta)
        rows = min(self.config.max_num_seqs, n)
        self.model.compute_logits(h[:rows]).float()

    # ---- a step ------------------------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, feed: Feed | None = None) -> StepOutput:
        """Run one scheduled step: a decode-only batch through the captured graphs when it fits a bucket,
        anything else (prefill, mixed, or no graphs) eagerly. feed: rows whose token is on the device only."""
        if self.graphs is not None and batch.is_decode_only and self.graphs.bucket(len(batch.seqs)):
            seqs = batch.seqs
            positions = batch.computed_before
            # a fed row's token is a placeholder here (0), overwritten on the device
            tokens = [seq.last_token_id if p < seq.num_known_tokens else 0 for seq, p in zip(seqs, positions)]
            graph_feed = None if feed is None else (feed.prev_ids, feed.src, feed.rows)
            logits, ids = self.graphs.run(tokens, positions, [seq.block_table for seq in seqs], graph_feed)
            return StepOutput(logits=logits, greedy_ids=ids)
        inputs = self.prepare(batch, feed)
        hidden = self.forward(inputs)
        rows = inputs.sample_rows(batch)
        logits = self.logits(hidden[self._to_device(rows, torch.int64)]) if rows else None
        return StepOutput(logits=logits, inputs=inputs, hidden=hidden)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A host list or array as a device tensor; on CUDA through pinned memory, without waiting for the
        GPU (a pageable copy would wait for the step before it: the host could not run ahead)."""
        host = torch.as_tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch, feed: Feed | None = None) -> StepInputs:
        """Host lists -> one device copy each. Sequence i's new tokens are positions
        computed_before[i] .. + num_new_tokens[i] - 1; its keys are positions 0 .. that end. A fed row's
        token (a decode of a token the host does not know yet) is gathered from feed.prev_ids."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        cu_q, cu_k, ctx_lens = [0], [0], []
        key_slots: list[np.ndarray] = []
        has_prefix = False
        tables = [np.asarray(seq.block_table, dtype=np.int64) for seq in batch.seqs]
        for seq, table, n, start in zip(batch.seqs, tables, batch.num_new_tokens, batch.computed_before):
            end = start + n
            if start >= seq.num_known_tokens:  # a pending token (n is 1): a placeholder, fed below
                tokens.append(0)
            else:
                tokens.extend(_token_slice(seq, start, end))
            pos = np.arange(start, end, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + end)
            ctx_lens.append(end)
            if start > 0:
                has_prefix = True
        decode = batch.is_decode_only
        has_prefix = has_prefix and not decode
        dev = self._to_device
        fields = {}
        if decode:
            padded = np.zeros((len(tables), self.table_width), dtype=np.int32)
            for i, t in enumerate(tables):
                padded[i, : len(t)] = t
            fields["block_tables"] = dev(padded, torch.int32)
            fields["context_lens"] = dev(ctx_lens, torch.int32)
        elif has_prefix:
            for table, end in zip(tables, ctx_lens):
                pos = np.arange(end, dtype=np.int64)
                key_slots.append(table[pos // bs] * bs + pos % bs)
            fields["key_slots"] = dev(np.concatenate(key_slots), torch.int64)
            fields["cu_seqlens_k"] = dev(cu_k, torch.int32)
            fields["max_seqlen_k"] = max(ctx_lens)
        meta = AttnMetadata(
            cu_seqlens_q=dev(cu_q, torch.int32),
            max_seqlen_q=max(batch.num_new_tokens),
            slot_mapping=dev(np.concatenate(slots), torch.int64),
            decode=decode,
            has_prefix=has_prefix,
            **fields,
        )
        token_t = dev(tokens, torch.int64)
        if feed is not None and feed.rows:
            # (m,) flat positions of the fed rows <- their ids in the previous step's output
            where = dev([cu_q[i] for i in feed.rows], torch.int64)
            token_t.index_copy_(0, where, feed.prev_ids.index_select(0, dev(feed.src, torch.int64)))
        return StepInputs(
            tokens=token_t,
            positions=dev(np.concatenate(positions), torch.int64),
            meta=meta,
            cu_seqlens=cu_q,
        )

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The final hidden states (N, d) of the step's tokens; their K/V are now in the cache."""
        h, _ = self.model.model(inputs.tokens, inputs.positions, inputs.meta, self.kv_caches)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, d) -> float32 logits (rows, V)."""
        return self.model.compute_logits(hidden).float()
