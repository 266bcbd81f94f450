"""The per-rank memory estimate's arithmetic, and a dead peer turning into a KilnError, not a hang."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.dist.hang import collective_errors
from kiln.dist.memory import estimate
from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.errors import KilnError
from kiln.model import ModelConfig

M = ModelConfig(
    vocab_size=1024, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=512, max_seq_len=64
)


def _est(world=4, ac="none", **kw):
    return estimate(M, ParallelDims.resolve(ParallelConfig(**kw), world, M), 2, 64, ac, 4)


def test_memory_estimate_of_moe_blocks():
    """k experts a token keep k times the dense block's MLP activations (and the rows they route); under
    expert parallel a rank gathers only its share of a block's experts."""
    moe = ModelConfig(**{**M.to_dict(), "arch": "mixtral", "n_experts": 8, "n_experts_per_tok": 2})

    def est(model, **kw):
        return estimate(model, ParallelDims.resolve(ParallelConfig(**kw), 4, model), 2, 64, "none", 4)

    dense, sparse = est(M), est(moe)
    tokens, d, F, L = 2 * 64, M.d_model, M.ffn_hidden, M.n_layers
    assert sparse["activations"] - dense["activations"] == pytest.approx(tokens * L * (3 * F + 4 * d) * 4)
    fsdp, ep4 = est(moe, dp_replicate=1, dp_shard=4), est(moe, dp_replicate=1, dp_shard=4, ep=4)
    experts_per_block = 8 * 3 * d * F
    # the two gathered blocks hold 2 of 8 experts each instead of all 8 (resident shards are the same)
    assert fsdp["parameters"] - ep4["parameters"] == pytest.approx(4 * 2 * experts_per_block * 3 / 4)
    assert fsdp["gradients"] == ep4["gradients"] and fsdp["optimizer"] == ep4["optimizer"]


def test_memory_estimate_follows_each_scheme():
    P = M.num_params()
    ddp, zero1 = _est(), _est(zero=1)
    assert ddp["parameters"] == ddp["gradients"] == 4 * P and ddp["optimizer"] == 8 * P
    assert zero1["optimizer"] == pytest.approx(8 * P / 4) and zero1["parameters"] == 4 * P
    fsdp = _est(dp_replicate=1, dp_shard=4)
    zero2 = _est(dp_replicate=1, dp_shard=4, zero=2)
    assert fsdp["gradients"] == pytest.approx(P) and fsdp["optimizer"] == pytest.approx(2 * P)
    assert fsdp["parameters"] < zero2["parameters"]  # ZeRO-2 keeps every block's gathered copy
    # in bf16 mixed precision those copies take 2 bytes: fp32 shards + bf16 copies < fp32 replicas
    bf16 = estimate(
        M, ParallelDims.resolve(ParallelConfig(dp_replicate=1, dp_shard=4, zero=2), 4, M), 2, 64, "none", 2
    )
    assert bf16["parameters"] == pytest.approx(P + 2 * P) and bf16["parameters"] < ddp["parameters"]
    assert _est(dp_replicate=1, dp_shard=4, ac="full")["activations"] < fsdp["activations"]
    tp, sp = _est(dp_replicate=1, tp=4), _est(dp_replicate=1, tp=4, sequence_parallel=True)
    assert tp["parameters"] < ddp["parameters"] / 3 and sp["activations"] < tp["activations"]


def _dies(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=10))  # fmt: skip
    if rank == 1:
        os._exit(0)  # a rank that dies mid-run, without a word
    t0 = time.perf_counter()
    try:
        with collective_errors(rank, 10):
            dist.all_reduce(torch.ones(4))
    except KilnError as e:
        with open(out, "w") as f:
            f.write(f"{time.perf_counter() - t0:.1f}\n{e}")


@pytest.mark.slow
def test_a_dead_rank_makes_the_other_fail_with_a_clear_error(tmp_path):
    out = tmp_path / "error.txt"
    ctx = mp.start_processes(
        _dies, args=(str(tmp_path / "init"), str(out)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5) and time.monotonic() < deadline:  # join returns as each process ends
        pass
    seconds, message = out.read_text().split("\n", 1)
    assert float(seconds) < 15  # within the timeout, not forever
    assert message.startswith(
        "rank 0: a collective failed or did not finish within parallel.hang_timeout_s=10s"
    )
