"""Reading GPTQ checkpoints (the HF "gptq" format other tools write): the int32 word packing by a hand-worked
case, and a directory holding GPTQ tensors loading into the same quantized model kiln's own quantization
builds, through the inference loader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.infer.loading import load_for_inference
from kiln.model.config import ModelConfig
from kiln.model.hf import save_pretrained
from kiln.model.linear import MergedLinear
from kiln.model.quant_linear import QuantLinear
from kiln.model.transformer import build_model
from kiln.quant import QuantScheme, quantize_model
from kiln.quant.gptq_format import load_gptq, pack_words, to_gptq_tensors, unpack_words


def test_word_packing_by_hand():
    # one column of K = 8: q = 1..8 along K -> 0x87654321; along N the same nibble order
    q = torch.arange(1, 9).reshape(8, 1)
    w = pack_words(q, 0)
    assert w.shape == (1, 1) and w.item() == 0x87654321 - 2**32  # int32: the top nibble 8 sets the sign bit
    assert torch.equal(unpack_words(w, 0), q.to(torch.uint8))
    assert torch.equal(unpack_words(pack_words(q.T, 1), 1), q.T.to(torch.uint8))


def _gptq_dir(tmp_path, group=64, g_idx_perm=False):
    cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=256, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
    save_pretrained(build_model(cfg, seed=0), tmp_path)
    model = build_model(cfg, seed=0).eval()
    quantize_model(model, QuantScheme.parse(f"int4-g{group}", asymmetric=True, head=False))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        parent = name.rsplit(".", 1)[0]
        parts = m.parts or {name.rsplit(".", 1)[1]: m.out_features}
        start = 0
        for part, size in parts.items():
            rows = slice(start, start + size)
            start += size
            g = to_gptq_tensors(m.qweight[rows], m.scales[rows], m.zeros[rows], group)
            if g_idx_perm:
                g["g_idx"] = g["g_idx"].flip(0)
            del tensors[f"{parent}.{part}.weight"]
            tensors.update({f"{parent}.{part}.{k}": v for k, v in g.items()})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return model


def test_gptq_directory_loads_as_the_same_model(tmp_path):
    want = _gptq_dir(tmp_path)
    got, _ = load_for_inference(tmp_path, torch.device("cpu"), torch.float32)
    qkv = got.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.parts == {"q_proj": 128, "k_proj": 64, "v_proj": 64}
    assert qkv.scales.dtype == torch.float16 and not isinstance(
        got.model.layers[0].mlp.gate_up_proj, MergedLinear
    )
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(got(ids), want(ids), rtol=1e-5, atol=1e-5)


def test_reordered_groups_are_refused(tmp_path):
    _gptq_dir(tmp_path, group=32, g_idx_perm=True)
    with pytest.raises(KilnError, match="reorders groups"):
        load_gptq(tmp_path, "cpu", torch.float32)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_kiln_quantize_writes_gptq_that_loads_back(asymmetric, tmp_path):
    from kiln.cli import main
    from kiln.model.checkpoint import save_model_dir

    cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_hidden=256, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
    save_model_dir(build_model(cfg, seed=1), tmp_path / "src")
    argv = ["quantize", "--model", str(tmp_path / "src"), "--scheme", "int4-g32", "--out", str(tmp_path / "g"),
            "--format", "gptq", "--no-head", "--dtype", "float32"] + (["--asymmetric"] if asymmetric else [])  # fmt: skip
    assert main(argv) == 0
    qc = json.loads((tmp_path / "g" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["group_size"] == 32 and qc["sym"] is not asymmetric
    want = build_model(cfg, seed=1).eval()
    quantize_model(want, QuantScheme.parse("int4-g32", asymmetric=asymmetric, head=False))
    got = load_gptq(tmp_path / "g", "cpu", torch.float32)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(got(ids), want(ids), rtol=1e-5, atol=1e-5)
    head = [a for a in argv if a != "--no-head"]
    head[head.index("--out") + 1] = str(tmp_path / "h")
    assert main(head) == 2  # the GPTQ convention keeps the head in float
