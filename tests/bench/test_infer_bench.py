"""The pieces of the inference benchmark: kiln.infer.bench's cost model, workloads, percentiles and drivers
(on a tiny CPU engine), and bench/peers/gptfast.py's decoder against kiln's model on the same weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model

BENCH = Path(__file__).resolve().parents[2] / "bench"
TINY = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    # tiny batched matmuls on the shared 2-core machine: OpenMP hand-offs cost more than the work
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the cost model -------------------------------------------------------------------------------------
def test_step_cost_of_qwen2p5_1p5b_by_hand():
    cfg = bench.qwen2_1p5b_config()
    cost = bench.decode_step_cost(cfg, batch=1, mean_context=384)
    # 1,543,714,304 parameters (the tied 151936 x 1536 head once) in bf16: PLATFORM.md's 3.09 GB
    assert cost["weight_bytes"] == 2 * 1_543_714_304
    # K and V, 28 layers x 2 KV heads x 128 dims x 2 bytes = 28672 bytes per token
    assert cost["kv_bytes"] == 384 * 28672
    assert cost["flops"] == 2 * cfg.active_matmul_params() + 4 * 28 * 12 * 128 * 384


@pytest.mark.parametrize("tied", [True, False])
def test_step_cost_counts_what_a_step_reads(tied):
    cfg = ModelConfig(arch="qwen2", qkv_bias=True, tie_embeddings=tied, **TINY)
    model = build_model(cfg)
    params = dict(model.named_parameters())
    read = sum(p.numel() for n, p in params.items() if tied or n != "model.embed_tokens.weight")
    cost = bench.decode_step_cost(cfg, batch=3, mean_context=10, itemsize=4)
    assert cost["weight_bytes"] == 4 * read
    assert cost["kv_bytes"] == 3 * 10 * 2 * 2 * 2 * 8 * 4  # B * ctx * (K, V) * layers * Hk * hd * 4 bytes
    # matmul weights: every 2-D tensor but an untied embedding table (looked up, not multiplied)
    matmul = sum(p.numel() for n, p in params.items() if p.dim() == 2 and (tied or "embed" not in n))
    assert cost["flops"] == 3 * (2 * matmul + 4 * 2 * 4 * 8 * 10)


def test_step_bound_takes_the_larger_and_needs_ceilings():
    cost = {"bytes": 4e9, "flops": 1e12}
    b = bench.step_bound(cost, copy_Bps=4e12, matmul_flops=2000e12)  # bytes 1 ms, FLOPs 0.5 ms
    assert b["bound_s"] == pytest.approx(1e-3) and b["bound_by"] == "bytes"
    b = bench.step_bound(cost, copy_Bps=4e12, matmul_flops=100e12)  # FLOPs 10 ms
    assert b["bound_s"] == pytest.approx(1e-2) and b["bound_by"] == "flops"
    assert bench.step_bound(cost, None, 1e12)["bound_s"] is None


# ---- workloads and percentiles ------------------------------------------------------------------------------
def test_percentiles_nearest_rank():
    s = bench.percentiles([float(x) for x in range(100, 0, -1)])  # 1..100, unsorted
    assert s == {"n": 100, "mean": 50.5, "p50": 51.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    assert bench.percentiles([])["p50"] is None
    assert bench.percentiles([2.5])["p99"] == 2.5


def test_workload_is_seeded_and_in_range():
    w = bench.workload(50, 100, 1024, 151936, seed=0)
    assert w == bench.workload(50, 100, 1024, 151936, seed=0) != bench.workload(50, 100, 1024, 151936, seed=1)
    assert all(100 <= len(p) <= 1024 and 100 <= m <= 1024 for p, m in w)
    assert all(0 <= t < 151936 for p, _ in w for t in p)
    assert bench.blocks_needed([([1] * 15, 1), ([1] * 15, 2), ([1] * 16, 16)], 16) == 1 + 2 + 2
    with pytest.raises(ValueError, match="lo <= hi"):
        bench.workload(1, 10, 5, 100)


def test_workload_matches_the_serve_benchmark():
    pytest.importorskip("httpx")
    serve = _load("bench_serve", BENCH / "serve.py")
    assert bench.workload(20, 4, 40, 1000, seed=3) == serve.make_requests(20, 4, 40, 1000, seed=3)


# ---- the drivers on a tiny CPU engine -----------------------------------------------------------------------
@pytest.fixture
def engine(one_thread):
    cfg = ModelConfig(arch="qwen3", qk_norm=True, head_dim=16, tie_embeddings=True, **TINY)
    llm = LLM(build_model(cfg).eval(), log=None, device="cpu", dtype="fp32", num_blocks=32, max_num_seqs=4,
              max_graph_batch=4, max_num_batched_tokens=24)  # fmt: skip
    return llm.engine


def test_steady_decode_times_full_batches_and_leaves_the_engine_idle(engine):
    r = bench.steady_decode(engine, batch=3, prompt_len=10, warm_steps=1, timed_steps=3, seed=0)
    assert r["batch"] == 3 and r["step_ms"]["n"] == 3 and r["tok_s"] > 0
    # 30 prompt tokens over 24-token steps: the first sequences decode while the last prefill
    assert 10 + 1 + 1 < r["mean_context"] < 10 + 1 + 3 + 3
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_throughput_counts_every_token(engine):
    reqs = bench.workload(5, 3, 9, engine.vocab_size, seed=0)
    r = bench.throughput(engine, reqs, temperature=0.6)
    assert r["output_tokens"] == sum(m for _, m in reqs) and r["input_tokens"] == sum(len(p) for p, _ in reqs)
    assert r["ttft_s"]["n"] == 5 and r["tpot_s"]["n"] == 5
    assert r["itl_s"]["n"] == sum(m - 1 for _, m in reqs)  # one gap per token after the first
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["time_s"], rel=0.01)
    assert not engine.has_unfinished()


# ---- the gpt-fast-style peer --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, extra",
    [("qwen2", {"qkv_bias": True}), ("qwen3", {"qk_norm": True, "head_dim": 16}), ("llama", {})],
)
def test_gptfast_peer_computes_kilns_function(arch, extra, one_thread):
    gptfast = _load("bench_peers_gptfast", BENCH / "peers" / "gptfast.py")
    cfg = ModelConfig(arch=arch, tie_embeddings=arch != "llama", **TINY, **extra)
    model = build_model(cfg, seed=1).eval()
    with torch.no_grad():  # norms and biases away from their init, so a dropped one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    peer = gptfast.GptFastDecoder.from_kiln(model, batch=2, max_len=40)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(peer(ids, torch.arange(12)), model(ids), atol=1e-5, rtol=1e-5)
    got, timings = peer.generate(ids, 8)
    assert torch.equal(got, model.generate(ids, 8, temperature=0.0)[:, 12:])
    assert timings["ttft_s"] > 0 and timings["decode_s"] > 0


def test_gptfast_peer_static_batch_of_padded_prompts(one_thread):
    # left-padded prompts of three lengths in one static batch, prefilled in slices shorter than the longest:
    # each row's greedy ids are those kiln's model gives its prompt alone
    gptfast = _load("bench_peers_gptfast", BENCH / "peers" / "gptfast.py")
    cfg = ModelConfig(arch="qwen3", qk_norm=True, head_dim=16, tie_embeddings=True, **TINY)
    model = build_model(cfg, seed=2).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 9)]
    peer = gptfast.GptFastDecoder.from_kiln(model, batch=3, max_len=24)
    got, timings = peer.generate_padded(prompts, 6, chunk=4)
    for row, prompt in zip(got, prompts, strict=True):
        want = model.generate(torch.tensor([prompt]), 6, temperature=0.0)[0, len(prompt) :]
        assert torch.equal(row, want)
    assert timings["ttft_s"] > 0 and timings["decode_s"] > 0
    with pytest.raises(ValueError, match="do not fit"):
        peer.generate_padded(prompts, 12)


def test_hf_peer_static_batch_of_padded_prompts(one_thread):
    # transformers' generate over left-padded prompts (attention mask zero on the padding): each row's
    # greedy ids are those kiln's model gives its prompt alone
    pytest.importorskip("transformers")
    hf_peer = _load("bench_peers_hf", BENCH / "peers" / "hf.py")
    cfg = ModelConfig(arch="qwen3", qk_norm=True, head_dim=16, tie_embeddings=True, **TINY)
    model = build_model(cfg, seed=2).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 9)]
    got, timings = hf_peer.static_batch(hf_peer.hf_from_kiln(model), prompts, 6)
    for row, prompt in zip(got, prompts, strict=True):
        want = model.generate(torch.tensor([prompt]), 6, temperature=0.0)[0, len(prompt) :]
        assert torch.equal(row, want)
    assert 0 < timings["ttft_s"] and 0 < timings["total_s"]


def test_gptfast_peer_refuses_what_it_does_not_model():
    gptfast = _load("bench_peers_gptfast", BENCH / "peers" / "gptfast.py")
    model = build_model(ModelConfig(arch="mistral", sliding_window=8, **TINY))
    with pytest.raises(ValueError, match="full attention"):
        gptfast.GptFastDecoder.from_kiln(model, batch=1, max_len=32)
