"""`kiln quantize`: a model directory with its tokenizer -> a quantized directory the engine loads (RTN and
GPTQ on a calibration file); each bad input one `kiln: error:` line with exit status 2."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.cli import main
from kiln.model.checkpoint import save_model_dir
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.quant.apply import QUANT_CONFIG, load_quantized
from kiln.tokenizer import train_bpe

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "pack my box with five dozen liquor jugs. " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    cfg = ModelConfig(arch="llama", vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=128, max_seq_len=64, tie_embeddings=True)  # fmt: skip
    save_model_dir(build_model(cfg, seed=0), d)
    train_bpe([TEXT], vocab_size=300, progress=False).save(d)
    return d


def test_rtn_and_gptq(model_dir, tmp_path, capsys):
    out = tmp_path / "q8"
    assert main(["quantize", "--model", str(model_dir), "--scheme", "int8", "--out", str(out)]) == 0
    assert "with int8 (rtn)" in capsys.readouterr().out
    cfg = json.loads((out / QUANT_CONFIG).read_text())
    assert cfg["scheme"]["kind"] == "int8" and "lm_head" in cfg["modules"]
    assert (out / "kiln_tokenizer.json").is_file()  # the tokenizer travels with the weights
    model = load_quantized(out, "cpu", torch.float32)
    assert model.lm_head.kind == "int8"
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT)
    out4 = tmp_path / "q4"
    argv = ["quantize", "--model", str(model_dir), "--scheme", "int4-g32", "--out", str(out4), "--method", "gptq",
            "--calib", str(calib), "--calib-seq-len", "32", "--act-order", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads((out4 / QUANT_CONFIG).read_text())["scheme"]["act_order"] is True
    outg = tmp_path / "gptq"
    argv = ["quantize", "--model", str(model_dir), "--scheme", "int4-g32", "--no-head", "--format", "gptq",
            "--out", str(outg)]  # fmt: skip
    assert main(argv) == 0
    out8 = tmp_path / "fp8"
    assert main(["quantize", "--model", str(model_dir), "--scheme", "fp8", "--out", str(out8)]) == 0
    # `kiln generate` takes each output as it takes the float model: greedy text from the engine
    capsys.readouterr()
    for d in (model_dir, out, out4, outg, out8):
        assert main(["generate", "--model", str(d), "--prompt", "the ", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0, d  # fmt: skip
        text, err = capsys.readouterr()
        assert text.startswith("the ") and len(text) > len("the \n") and err == "", (d, text, err)


def test_bad_inputs_are_clear_errors(model_dir, tmp_path, capsys):
    calib = tmp_path / "short.txt"
    calib.write_text("too short")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    base = ["quantize", "--model", str(model_dir), "--out", str(tmp_path / "o")]
    cases = [
        (["quantize", "--model", str(tmp_path / "nope"), "--scheme", "int8", "--out", str(tmp_path / "o")], "does not exist"),
        (["quantize", "--model", str(model_dir), "--scheme", "int8", "--out", str(full)], "not empty"),
        ([*base, "--scheme", "int4", "--method", "gptq"], "pass --calib FILE"),
        ([*base, "--scheme", "int4", "--calib", str(calib)], "GPTQ only"),
        ([*base, "--scheme", "fp8", "--method", "gptq", "--calib", str(calib)], "integer schemes"),
        ([*base, "--scheme", "int4-g32", "--method", "gptq", "--calib", str(calib)], "fewer than one window"),
        ([*base, "--scheme", "int4-g32", "--method", "gptq", "--calib", str(tmp_path / "missing.txt")], "does not exist"),
        ([*base, "--scheme", "int4-g128"], "not a multiple of the int4 group size 128"),
    ]  # fmt: skip
    for argv, match in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kiln: error:") and match in err, (argv, err)
    assert (full / "x").read_text() == "keep me" and not (tmp_path / "o" / QUANT_CONFIG).exists()
