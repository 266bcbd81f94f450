"""How a run splits over its processes: the `parallel` config section, its checks, and the one DeviceMesh.

The world factors as pp x dp_replicate x dp_shard x tp (outermost first, TorchTitan's order, so the
tp group is the innermost: consecutive ranks, one host's fast links). Each axis:
- dp_replicate: data parallel with whole replicas (DDP; with zero=1 the optimizer state is sharded
  over it by ZeroRedundancyOptimizer). Combined with dp_shard > 1 it is HSDP.
- dp_shard: data parallel with sharded parameters, gradients and optimizer state (FSDP2 `fully_shard`;
  zero=3 reshards the parameters after forward, zero=2 keeps them gathered until backward).
- tp: tensor parallel inside each block (heads and FFN columns split, see kiln.dist.tp); with
  sequence_parallel the norms and residual stream are split by tokens between the matmuls.
- pp: pipeline stages by layers.
- ep: expert parallel, inside dp_shard (TorchTitan's choice: the ep ranks are data-parallel ranks that
  also split the MoE experts between them, each holding n_experts / ep whole experts and exchanging
  tokens all-to-all, kiln.dist.expert_parallel). For the experts the dp_shard axis is laid out as
  (efsdp, ep), ep innermost (`expert_mesh`): FSDP2 shards the other parameters over all of dp_shard and
  the experts over efsdp = dp_shard / ep only (with dp_replicate: HSDP for both).
-1 on dp_replicate or dp_shard means "what the world size leaves" (one of them at most).

`ParallelConfig` is the static, self-validated config section (`--parallel.*`); `ParallelDims.resolve`
checks it against the world size and the model (heads, KV heads, layers, vocabulary) and every mismatch
is a KilnError naming the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import KilnError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CHECKPOINTING = ("none", "selective", "full")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise KilnError(msg)


@dataclass
class ParallelConfig:
    dp_replicate: int = -1  # -1: the rest of the world (plain DDP by default, kiln's behaviour before)
    dp_shard: int = 1  # -1: the rest of the world
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallel (MoE models): experts split over this many ranks of dp_shard
    pp_schedule: str = "1f1b"  # gpipe, 1f1b, interleaved_1f1b
    microbatches: int = 0  # pipeline micro-batches per step; 0: pp (the fewest that fill the pipeline)
    stages_per_rank: int = 0  # pipeline stages on each rank; 0: 2 for interleaved_1f1b, else 1
    zero: int | None = None  # None: 3 when dp_shard > 1, else 0 (plain DDP); 1: DDP + sharded optimizer
    sequence_parallel: bool = False  # with tp: norms and the residual stream split by tokens
    activation_checkpoint: str = "none"  # none, selective (every other block), full (every block)
    compile_blocks: bool = False  # torch.compile each block after sharding
    hang_timeout_s: float = 600.0  # a collective that takes longer names its rank and op, then exits

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard"):
            v = getattr(self, name)
            _require(v == -1 or v >= 1, f"parallel.{name} must be >= 1, or -1 (the rest), got {v}")
        _require(
            not (self.dp_replicate == -1 and self.dp_shard == -1),
            "parallel.dp_replicate and parallel.dp_shard cannot both be -1: give one of them a size",
        )
        for name in ("tp", "pp", "ep"):
            _require(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _require(
            self.pp_schedule in SCHEDULES,
            f"parallel.pp_schedule must be one of {', '.join(SCHEDULES)}, got {self.pp_schedule!r}",
        )
        _require(self.microbatches >= 0, f"parallel.microbatches must be >= 0, got {self.microbatches}")
        _require(
            self.stages_per_rank >= 0, f"parallel.stages_per_rank must be >= 0, got {self.stages_per_rank}"
        )
        _require(
            self.stages_per_rank <= 1 or self.pp_schedule == "interleaved_1f1b",
            f"parallel.stages_per_rank={self.stages_per_rank} needs parallel.pp_schedule=interleaved_1f1b "
            f"(gpipe and 1f1b run one stage per rank)",
        )
        _require(
            self.zero in (None, 0, 1, 2, 3), f"parallel.zero must be 0, 1, 2, 3 or null, got {self.zero}"
        )
        _require(
            self.activation_checkpoint in CHECKPOINTING,
            f"parallel.activation_checkpoint must be one of {', '.join(CHECKPOINTING)}, "
            f"got {self.activation_checkpoint!r}",
        )
        _require(self.hang_timeout_s > 0, f"parallel.hang_timeout_s must be > 0, got {self.hang_timeout_s}")
        _require(
            not (self.sequence_parallel and self.tp == 1),
            "parallel.sequence_parallel needs parallel.tp > 1 (it splits tokens over the tp group)",
        )


@dataclass(frozen=True)
class ParallelDims:
    """The resolved sizes (no -1 left) and the strategy they imply."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    zero: int  # 0 DDP, 1 DDP + sharded optimizer state, 2 FSDP2 without reshard, 3 FSDP2
    sequence_parallel: bool
    pp_schedule: str
    microbatches: int
    stages_per_rank: int = 1  # pipeline stages per pp rank (interleaved 1F1B: >= 2)
    ep: int = 1  # expert parallel degree, a divisor of dp_shard

    @property
    def efsdp(self) -> int:
        """How many ranks of dp_shard shard each expert (FSDP2 of the experts): dp_shard / ep."""
        return self.dp_shard // self.ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on each mesh dim (row-major over MESH_DIMS, as init_device_mesh lays it)."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(MESH_DIMS, self.shape))):
            out[name] = rest % size
            rest //= size
        return {n: out[n] for n in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch `rank` reads: ranks of one tp group / pipeline read the same."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def describe(self) -> str:
        parts = [f"{n}={s}" for n, s in zip(MESH_DIMS, self.shape) if s > 1] or ["one process"]
        scheme = {0: "DDP", 1: "ZeRO-1 (DDP + sharded optimizer)", 2: "ZeRO-2 (FSDP2, no reshard)",
                  3: "FSDP2 (ZeRO-3)"}[self.zero]  # fmt: skip
        if self.dp == 1:
            scheme = "no data parallelism"
        extra = [scheme]
        if self.ep > 1:
            extra.append(f"expert parallel over {self.ep} ranks (experts FSDP2-sharded over {self.efsdp})")
        if self.tp > 1:
            extra.append("tensor parallel" + (" + sequence parallel" if self.sequence_parallel else ""))
        if self.pp > 1:
            from kiln.dist.pipeline import bubble_fraction

            v = self.stages_per_rank
            bubble = bubble_fraction(self.pp, self.microbatches, v)
            extra.append(
                f"pipeline {self.pp_schedule}"
                + (f" ({v} stages per rank)" if v > 1 else "")
                + f", {self.microbatches} micro-batches, bubble {bubble:.1%} of a step"
                + " = (pp - 1) / ("
                + ("stages_per_rank x " if v > 1 else "")
                + "micro-batches + pp - 1)"
            )
        return " x ".join(parts) + ": " + ", ".join(extra)

    @staticmethod
    def resolve(cfg: ParallelConfig, world_size: int, model=None) -> ParallelDims:
        """Fill -1, check the product against `world_size` and the model (a ModelConfig, optional)."""
        fixed = cfg.tp * cfg.pp * max(cfg.dp_replicate, 1) * max(cfg.dp_shard, 1)
        rep, shard = cfg.dp_replicate, cfg.dp_shard
        if -1 in (rep, shard):
            _require(
                world_size % fixed == 0,
                f"the world size {world_size} is not divisible by tp x pp x the given dp size = {fixed}: "
                f"launch a multiple of {fixed} processes, or change the parallel.* sizes",
            )
            if rep == -1:
                rep = world_size // fixed
            else:
                shard = world_size // fixed
        dims_product = rep * shard * cfg.tp * cfg.pp
        _require(
            dims_product == world_size,
            f"parallel sizes dp_replicate={rep} x dp_shard={shard} x tp={cfg.tp} x pp={cfg.pp} = "
            f"{dims_product} processes, but the world size is {world_size}: launch {dims_product} "
            f"(torchrun --nproc_per_node={dims_product}) or set one of them to -1",
        )
        zero = cfg.zero if cfg.zero is not None else (3 if shard > 1 else 0)
        if zero in (2, 3):
            _require(
                shard > 1,
                f"parallel.zero={zero} shards parameters over parallel.dp_shard, which is 1: set "
                "parallel.dp_shard > 1 (e.g. -1 with parallel.dp_replicate=1), or parallel.zero=0/1",
            )
        else:
            _require(
                shard == 1,
                f"parallel.zero={zero} is DDP over whole replicas, but parallel.dp_shard={shard}: set "
                "parallel.zero=2 or 3 (FSDP2), or move the data parallelism to parallel.dp_replicate",
            )
            _require(
                zero == 0 or rep > 1,
                "parallel.zero=1 shards the optimizer state over parallel.dp_replicate, which is 1: "
                "launch more processes or drop parallel.zero",
            )
        micro = cfg.microbatches or cfg.pp
        interleaved = cfg.pp_schedule == "interleaved_1f1b"
        v = (cfg.stages_per_rank or (2 if interleaved else 1)) if cfg.pp > 1 else 1
        if interleaved and cfg.pp > 1:
            _require(
                micro % cfg.pp == 0,
                f"parallel.microbatches ({micro}) must be a multiple of parallel.pp ({cfg.pp}) for "
                "interleaved_1f1b",
            )
        if cfg.pp > 1:
            _require(
                not cfg.sequence_parallel,
                "parallel.sequence_parallel inside pipeline stages is not built (the stages pass whole "
                "(b, T, d) activations): use parallel.tp without sequence_parallel with parallel.pp",
            )
            _require(
                rep == 1 or shard > 1,
                f"data parallel by whole replicas (parallel.dp_replicate={rep}) with pipeline stages is not "
                "built: use parallel.dp_shard for the data-parallel size (FSDP2 over each stage)",
            )
        _require(
            shard % cfg.ep == 0,
            f"parallel.ep={cfg.ep} splits the experts over ranks of parallel.dp_shard ({shard}), which it must "
            "divide: set parallel.dp_shard to a multiple of parallel.ep (e.g. -1 with parallel.dp_replicate=1)",
        )
        dims = ParallelDims(rep, shard, cfg.tp, cfg.pp, zero, cfg.sequence_parallel, cfg.pp_schedule, micro, v,
                            cfg.ep)  # fmt: skip
        if model is not None:
            dims.check_model(model)
        return dims

    def check_model(self, m) -> None:
        """Heads, KV heads, FFN width and vocabulary must divide by tp; layers by the pipeline stages;
        experts by ep."""
        if self.ep > 1:
            _require(
                m.n_experts > 0,
                f"parallel.ep={self.ep} splits MoE experts, but the model is dense (model.n_experts=0): "
                "drop parallel.ep",
            )
            _require(
                m.n_experts % self.ep == 0,
                f"model.n_experts ({m.n_experts}) is not divisible by parallel.ep ({self.ep}): each ep rank "
                "holds the same number of whole experts; choose an ep that divides it",
            )
        tp = self.tp
        if tp > 1:
            _require(
                m.n_heads % tp == 0,
                f"model.n_heads ({m.n_heads}) is not divisible by parallel.tp ({tp}): each tp rank takes "
                "whole query heads; choose a tp that divides it",
            )
            _require(
                m.n_kv_heads % tp == 0,
                f"model.n_kv_heads ({m.n_kv_heads}) is not divisible by parallel.tp ({tp}): each tp rank "
                "takes whole key/value heads (GQA groups stay on one rank); choose a tp that divides it",
            )
            if m.n_experts:
                _require(
                    m.n_experts % tp == 0,
                    f"model.n_experts ({m.n_experts}) is not divisible by parallel.tp ({tp}): under tensor "
                    "parallel each rank holds n_experts / tp whole experts; choose a tp that divides it",
                )
                _require(
                    self.ep == 1,
                    "parallel.ep with parallel.tp splits the experts twice: the MoE blocks are split by expert "
                    "over tp already; drop parallel.ep (or parallel.tp)",
                )
            else:
                _require(
                    m.ffn_hidden % tp == 0,
                    f"model.ffn_hidden ({m.ffn_hidden}) is not divisible by parallel.tp ({tp}): choose a tp "
                    "that divides it",
                )
            _require(
                m.vocab_size % tp == 0,
                f"model.vocab_size ({m.vocab_size}) is not divisible by parallel.tp ({tp}): the embedding "
                "and head are split by vocabulary rows; pad the vocabulary (tokenizer.vocab_size) to a "
                "multiple of tp",
            )
            _require(
                not m.attn_sinks,
                "tensor parallel with attention sinks (model.attn_sinks) is not supported: use parallel.tp=1",
            )
            _require(
                m.arch != "gpt2",
                "tensor parallel covers the SwiGLU families (llama, qwen2, qwen3, mistral): gpt2 needs "
                "parallel.tp=1",
            )
        if self.pp > 1:
            n = self.pp * self.stages_per_rank
            _require(
                m.n_layers % n == 0,
                f"model.n_layers ({m.n_layers}) is not divisible by the {n} pipeline stages (parallel.pp="
                f"{self.pp} x {self.stages_per_rank} stages per rank): each stage takes the same number of "
                "blocks; choose a pp (or parallel.stages_per_rank) that divides it",
            )
            _require(
                not m.tie_embeddings,
                "pipeline parallel with a tied head (model.tie_embeddings) is not supported: the embedding "
                "and the head sit on different stages; untie them or use parallel.pp=1",
            )

    def build_mesh(self, device_type: str):
        """One DeviceMesh over MESH_DIMS (size-1 dims included, so every strategy slices it by name)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)

    def expert_mesh(self, mesh):
        """`mesh` with dp_shard laid out as (efsdp, ep), ep innermost: the same ranks, as the 5-D mesh
        (pp, dp_replicate, efsdp, ep, tp) that expert parallel slices "ep" and "efsdp" from (a second
        view of one layout, DeviceMesh._unflatten: torch >= 2.10)."""
        if not hasattr(mesh, "_unflatten"):
            import torch

            raise KilnError(
                f"parallel.ep needs torch >= 2.10 (DeviceMesh._unflatten); this is {torch.__version__}"
            )
        return mesh._unflatten(MESH_DIMS.index("dp_shard"), (self.efsdp, self.ep), ("efsdp", "ep"))
