"""ParallelConfig / ParallelDims: sizes resolved against the world, every mismatch one clear error."""

import pytest

from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.errors import KilnError
from kiln.model import ModelConfig

MODEL = ModelConfig(
    vocab_size=64, d_model=32, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden=64, max_seq_len=16
)


def test_defaults_are_ddp_over_the_world():
    d = ParallelDims.resolve(ParallelConfig(), 4, MODEL)
    assert (d.dp_replicate, d.dp_shard, d.tp, d.pp, d.zero, d.dp) == (4, 1, 1, 1, 0, 4)
    assert ParallelDims.resolve(ParallelConfig(), 1).describe().startswith("one process")


def test_fill_and_coordinates():
    d = ParallelDims.resolve(ParallelConfig(dp_replicate=1, dp_shard=-1, tp=2), 8, MODEL)
    assert (d.dp_shard, d.zero, d.world_size) == (4, 3, 8)
    # row-major over (pp, dp_replicate, dp_shard, tp): the tp pair (2k, 2k+1) reads one data slice
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert d.coords(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "tp": 1}
    h = ParallelDims.resolve(ParallelConfig(dp_replicate=2, dp_shard=2), 4, MODEL)
    assert [h.dp_rank(r) for r in range(4)] == [0, 1, 2, 3] and h.fsdp


@pytest.mark.parametrize(
    "cfg, world, message",
    [
        (dict(tp=3), 6, "model.n_heads (8) is not divisible by parallel.tp (3)"),
        (dict(tp=4), 4, "model.n_kv_heads (2) is not divisible by parallel.tp (4)"),
        (dict(pp=3), 3, "model.n_layers (4) is not divisible by the 3 pipeline stages"),
        (dict(pp=2, pp_schedule="interleaved_1f1b", stages_per_rank=4), 2, "not divisible by the 8 pipeline"),
        (dict(pp=2, pp_schedule="interleaved_1f1b", microbatches=3), 2, "multiple of parallel.pp (2)"),
        (dict(pp=2, tp=2, dp_replicate=1, sequence_parallel=True), 4, "sequence_parallel inside pipeline"),
        (dict(pp=2), 4, "whole replicas (parallel.dp_replicate=2) with pipeline stages"),
        (dict(pp=2, dp_replicate=1, tie_embeddings=None), 2, "pipeline parallel with a tied head"),
        (dict(dp_replicate=2, tp=2), 8, "= 4 processes, but the world size is 8"),
        (dict(tp=2), 5, "not divisible by tp x pp x the given dp size = 2"),
        (dict(zero=3), 4, "parallel.zero=3 shards parameters over parallel.dp_shard, which is 1"),
        (dict(dp_replicate=1, dp_shard=4, zero=1), 4, "parallel.zero=1 is DDP over whole replicas"),
        (dict(dp_replicate=1, zero=1, tp=2), 2, "parallel.zero=1 shards the optimizer state"),
    ],
)
def test_mismatches_name_the_fix(cfg, world, message):
    model = MODEL
    if "tie_embeddings" in cfg:  # a model-side setting, not a parallel one
        cfg = {k: v for k, v in cfg.items() if k != "tie_embeddings"}
        model = ModelConfig(**{**MODEL.to_dict(), "tie_embeddings": True})
    with pytest.raises(KilnError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims.resolve(ParallelConfig(**cfg), world, model)


def test_vocabulary_and_config_checks():
    odd_vocab = ModelConfig(vocab_size=63, d_model=32, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=64)
    with pytest.raises(KilnError, match="pad the vocabulary"):
        ParallelDims.resolve(ParallelConfig(dp_replicate=1, tp=2), 2, odd_vocab)
    for bad, msg in [
        (dict(dp_replicate=-1, dp_shard=-1), "cannot both be -1"),
        (dict(pp_schedule="zb"), "parallel.pp_schedule must be one of"),
        (dict(activation_checkpoint="some"), "parallel.activation_checkpoint must be one of"),
        (dict(sequence_parallel=True), "needs parallel.tp > 1"),
        (dict(zero=4), "parallel.zero must be"),
        (dict(pp=2, stages_per_rank=2), "needs parallel.pp_schedule=interleaved_1f1b"),
    ]:
        with pytest.raises(KilnError, match=msg):
            ParallelConfig(**bad)


def test_pipeline_stages_and_bubble():
    d = ParallelDims.resolve(ParallelConfig(dp_replicate=1, pp=2, pp_schedule="interleaved_1f1b"), 2, MODEL)
    assert (d.stages_per_rank, d.microbatches) == (2, 2)  # the defaults: 2 stages per rank, pp micro-batches
    # (p - 1) / (v m + p - 1) = 1 / 5
    assert "(2 stages per rank), 2 micro-batches, bubble 20.0% of a step" in d.describe()
    g = ParallelDims.resolve(
        ParallelConfig(dp_replicate=1, pp=4, pp_schedule="gpipe", microbatches=8), 4, MODEL
    )
    assert g.stages_per_rank == 1 and "bubble 27.3%" in g.describe()  # 3 / 11


MOE = ModelConfig(**{**MODEL.to_dict(), "arch": "mixtral", "n_experts": 8})


def test_expert_parallel_lies_inside_dp_shard():
    d = ParallelDims.resolve(ParallelConfig(dp_replicate=2, dp_shard=4, ep=2), 8, MOE)
    assert (d.ep, d.efsdp, d.dp, d.zero) == (2, 2, 8, 3)
    assert "expert parallel over 2 ranks (experts FSDP2-sharded over 2)" in d.describe()
    # the ep ranks read different data: ep takes no slice of its own
    assert [d.dp_rank(r) for r in range(8)] == list(range(8))
    for cfg, world, model, message in [
        (dict(dp_replicate=1, dp_shard=4, ep=3), 4, MOE, "parallel.ep=3 splits the experts over ranks of "
         "parallel.dp_shard (4), which it must divide"),
        (dict(ep=2), 2, MOE, "parallel.ep=2 splits the experts over ranks of parallel.dp_shard (1)"),
        (dict(dp_replicate=1, dp_shard=2, ep=2), 2, MODEL, "the model is dense (model.n_experts=0)"),
        (dict(dp_replicate=1, dp_shard=6, ep=6), 6, MOE, "model.n_experts (8) is not divisible by parallel.ep (6)"),
    ]:  # fmt: skip
        with pytest.raises(KilnError, match=message.replace("(", r"\(").replace(")", r"\)")):
            ParallelDims.resolve(ParallelConfig(**cfg), world, model)
    with pytest.raises(KilnError, match="parallel.ep must be >= 1"):
        ParallelConfig(ep=0)
