"""`kiln convert` both ways and `kiln model summary`."""

from __future__ import annotations

import json

import torch

from kiln.cli import main
from kiln.model import ModelConfig, build_model, from_pretrained
from kiln.model.checkpoint import load_model_dir

from ._helpers import assert_logits_close, hf_model, transformers


def test_convert_hf_to_kiln_and_back(tmp_path, capsys):
    hf = hf_model("qwen2", num_hidden_layers=2, tie_word_embeddings=True)
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "kiln")]) == 0
    assert "kiln model directory" in capsys.readouterr().out
    kiln = load_model_dir(tmp_path / "kiln")
    assert kiln.config.arch == "qwen2" and kiln.config.tie_embeddings
    assert main(["convert", str(tmp_path / "kiln"), str(tmp_path / "back"), "--shard-size", "100KB"]) == 0
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 1000, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits
        assert_logits_close(kiln(ids), want)
        assert_logits_close(back(ids).logits, want)
    # a non-empty output needs --force; bf16 output
    assert main(["convert", str(tmp_path / "kiln"), str(tmp_path / "back")]) == 2
    assert "--force" in capsys.readouterr().err
    assert (
        main(["convert", str(tmp_path / "kiln"), str(tmp_path / "back"), "--force", "--dtype", "bfloat16"])
        == 0
    )
    assert from_pretrained(tmp_path / "back", dtype=torch.bfloat16).head_weight.dtype == torch.bfloat16


def test_convert_training_checkpoint_to_hf(tmp_path, capsys):
    from kiln.train.checkpoint import save_checkpoint

    cfg = ModelConfig(
        arch="llama", vocab_size=64, d_model=24, n_layers=1, n_heads=3, ffn_hidden=40, max_seq_len=16
    )
    model = build_model(cfg, seed=5).eval()
    save_checkpoint(
        tmp_path / "run" / "checkpoints",
        10,
        {"model": model.state_dict(), "config": {"model": cfg.to_dict()}},
    )
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert "(training, llama" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_close(hf(ids).logits, model(ids))


def test_summary(tmp_path, capsys):
    cfg = ModelConfig(
        arch="mixtral",
        vocab_size=1000,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=96,
        max_seq_len=128,
        n_experts=4,
        sliding_window=32,
    )
    (tmp_path / "m.json").write_text(json.dumps(cfg.to_dict()))
    assert main(["model", "summary", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "mixtral" in out and "MoE 4 SwiGLU experts, top-2" in out and "sliding window 32" in out
    assert f"{cfg.num_params():,}" in out and f"{cfg.kv_bytes_per_token(torch.bfloat16):,} B in bf16" in out
    assert f"{cfg.flops_per_token(128):.4g}" in out
    assert main(["model", "summary", "gpu"]) == 0  # a run preset
    assert "llama" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text(json.dumps({"arch": "llama", "d_modle": 3}))
    assert main(["model", "summary", str(tmp_path / "bad.json")]) == 2
    assert "d_modle" in capsys.readouterr().err
    assert main(["model", "summary", str(tmp_path / "missing")]) == 2
