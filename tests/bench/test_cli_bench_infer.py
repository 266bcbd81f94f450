"""`kiln bench infer` on a tiny saved model on the CPU: the batch points, the nano-vllm throughput workload
(--requests) with its JSON, and its bad input as one `kiln: error:` line."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.cli import main
from kiln.model.config import ModelConfig
from kiln.model.hf import save_pretrained
from kiln.model.transformer import build_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-infer") / "tiny"
    cfg = ModelConfig(arch="qwen3", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      ffn_hidden=64, max_seq_len=64, qk_norm=True, tie_embeddings=True)  # fmt: skip
    save_pretrained(build_model(cfg), path)
    return path


@pytest.fixture(autouse=True)
def one_thread():
    # tiny batched matmuls on the shared 2-core machine: OpenMP hand-offs cost more than the work
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_batch_points(model_dir, capsys):
    argv = ["bench", "infer", "--model", str(model_dir), "--device", "cpu", "--batch-sizes", "1,3"]
    assert main(argv + ["--prompt-len", "6", "--output-len", "4", "--decode-backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "batch    1:" in out and "batch    3:" in out


def test_throughput_workload(model_dir, capsys, tmp_path):
    out_json = tmp_path / "tp.json"
    argv = ["bench", "infer", "--model", str(model_dir), "--device", "cpu", "--requests", "5"]
    assert main(argv + ["--min-len", "3", "--max-len", "9", "--out", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "TTFT  p50" in out and "ITL   p50" in out
    doc = json.loads(out_json.read_text())
    r = doc["throughput"]
    assert doc["decode_backend"] == "graphs" and r["requests"] == 5
    assert r["itl_s"]["n"] == r["output_tokens"] - 5  # one gap per token after each request's first


def test_bad_lengths_are_one_error(model_dir, capsys):
    argv = ["bench", "infer", "--model", str(model_dir), "--device", "cpu", "--requests", "2"]
    assert main(argv + ["--min-len", "9", "--max-len", "3"]) == 2
    assert "kiln: error: --min-len 9 is larger than --max-len 3" in capsys.readouterr().err
    assert main(argv + ["--min-len", "4", "--max-len", "40"]) == 2  # 2 x 40 tokens past the model's 64
    assert "kiln: error: 2 x --max-len = 80 exceeds the model's context of 64" in capsys.readouterr().err
    assert main(argv + ["--prompt-len", "4"]) == 2  # a batch-point flag with --requests: not ignored silently
    assert "kiln: error: --prompt-len: not used with --requests" in capsys.readouterr().err
    assert main(["bench", "infer", "--model", str(model_dir), "--device", "cpu", "--seed", "3"]) == 2
    assert "kiln: error: --seed: not used without --requests" in capsys.readouterr().err
