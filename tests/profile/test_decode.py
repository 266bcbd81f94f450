"""`kiln profile decode` on the CPU: a tiny Qwen2-shaped model through the engine's eager reference path,
every layer's modules named, the rows summing to the step, and the files written."""

import json

import pytest

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile import decode


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(arch="qwen2", vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      max_seq_len=64, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    return build_model(cfg)


@pytest.fixture(scope="module")
def result(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    return decode.run(tiny, "tiny", batch=2, context=12, graphs=False, out=out, steps=3), out


def test_every_layer_is_named_and_the_rows_sum_to_the_step(result, tiny):
    res, out = result
    rows = res["rows"]
    for i in range(tiny.config.n_layers):
        ops = {r["op"] for r in rows if r["layer"] == f"layer.{i}"}
        assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "norm", "self_attn", "mlp"} <= ops
        assert sum(r["op"] == "norm" for r in rows if r["layer"] == f"layer.{i}") == 2
    assert any(r["layer"] == "embed" for r in rows) and any(r["layer"] == "final" for r in rows)
    total = sum(r["us"] for r in rows) + sum(o["us"] for o in res["other"])
    assert total == pytest.approx(res["wall_us"], rel=1e-6, abs=0.01)
    assert res["attributed_pct"] >= 95 and abs(res["remainder_us"]) < 0.01
    assert len(res["step_walls_us"]) == 3
    assert "The step takes" in res["summary"]
    for key in ("csv", "ops_png"):
        assert (out / res[key].split("/")[-1]).exists()
    import gzip

    trace = json.loads(gzip.decompress((out / "trace_tiny_b2_c12_graphsoff.json.gz").read_bytes()))
    assert any(e.get("name") == "kiln/model.layers.2.mlp.down_proj" for e in trace["traceEvents"])
    assert not list(out.glob(".*tmp*"))  # the uncompressed export is gone
    doc = json.loads((out / "decode_tiny_b2_c12_graphsoff.json").read_text())
    assert doc["wall_us"] == res["wall_us"] and len(doc["rows"]) == len(rows)


def test_rows_carry_the_catalogs_counts(result, tiny):
    res, _ = result
    cfg = tiny.config
    qkv = next(r for r in res["rows"] if r["scope"] == "model.layers.1.self_attn.qkv_proj")
    n = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    # fp32 on the CPU: M 2, N n, K 32 with a bias: 2 * 2 * n * 32 flops, (64 + 32 n + 2 n + n) * 4 bytes
    assert qkv["flops"] == 2 * 2 * n * 32 and qkv["bytes"] == 4 * (2 * 32 + n * 32 + 2 * n + n)
    attn = next(r for r in res["rows"] if r["scope"] == "model.layers.1.self_attn")
    # the module's own time holds rope, the cache write and attention over 12 keys: 4 * 2 * 4 * 12 * 8
    # flops for attention, 3 * 2 * (4 + 2) * 8 for rope
    assert attn["flops"] == 4 * 2 * 4 * 12 * 8 + 3 * 2 * 6 * 8
    norm0 = next(r for r in res["rows"] if r["scope"] == "model.layers.0.input_layernorm")
    norm1 = next(r for r in res["rows"] if r["scope"] == "model.layers.1.input_layernorm")
    assert norm0["bytes"] == 4 * (2 * 2 * 32 + 32) and norm1["bytes"] == 4 * (4 * 2 * 32 + 32)
    ops = {g["op"]: g for g in res["ops"]}
    assert ops["qkv_proj"]["kernels"] == cfg.n_layers
    assert sum(g["share_pct"] for g in res["ops"]) == pytest.approx(100, abs=0.1)


def test_fused_kernels_count_the_ops_they_do(tiny):
    # on CUDA a one-token step's q/k/v projection, RoPE and K/V write are one kernel launched from the
    # attention's range (op "qkv_proj" there): counted as the three ops it does
    cfg = tiny.config
    fn = decode.accounting(tiny, batch=1, context=12)
    fused = fn("layer.1", "qkv_proj", "model.layers.1.self_attn")
    proj = fn("layer.1", "qkv_proj", "model.layers.1.self_attn.qkv_proj")
    rope, kvw = (
        fn("layer.1", "rope", "model.layers.1.self_attn"),
        fn("layer.1", "kv_write", "model.layers.1.self_attn"),
    )
    assert fused[0] == proj[0] + rope[0] + kvw[0] and fused[1] == proj[1] + rope[1] + kvw[1]
    assert proj[1] >= 4 * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.d_model  # its fp32 weight
    # gate_up with the SwiGLU in its epilogue, launched from the MLP's range: the projection and the SwiGLU
    epi = fn("layer.1", "gate_up_proj", "model.layers.1.mlp")
    gate_up = fn("layer.1", "gate_up_proj", "model.layers.1.mlp.gate_up_proj")
    swi = fn("layer.1", "swiglu", "model.layers.1.mlp")
    assert epi[0] == gate_up[0] + swi[0] and epi[1] == gate_up[1] + swi[1]


def test_weight_and_kv_bytes(tiny):
    w, kv = decode.weight_and_kv_bytes(tiny, batch=2, context=10)
    assert w == sum(p.numel() * 4 for p in tiny.parameters())
    assert kv == 2 * 3 * 2 * 10 * 2 * 8 * 4  # K and V, layers, batch, context, kv heads, head_dim, fp32


def test_untied_float_head_is_counted(tmp_path):
    # an untied head is an nn.Linear module named lm_head: counted as the float (V, d) matmul
    cfg = ModelConfig(arch="llama", vocab_size=96, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                      max_seq_len=64, tie_embeddings=False)  # fmt: skip
    fn = decode.accounting(build_model(cfg), batch=2, context=12)
    flops, nbytes, _ = fn("head", "lm_head", "lm_head")
    assert flops == 2 * 2 * 96 * 32 and nbytes == 4 * (2 * 32 + 96 * 32 + 2 * 96)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32", "fp8"])
def test_quantized_step_counts_the_packed_weights(scheme, tmp_path):
    # --quant: the projections and the head counted at their quantized bytes, the weight total with the
    # quantized buffers (qweight, scales), every layer still named
    from kiln.model.quant_linear import QuantLinear
    from kiln.quant import QuantScheme

    cfg = ModelConfig(arch="qwen2", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    model = build_model(cfg)
    name = decode.quantize_for_profile(model, QuantScheme.parse(scheme), "tiny")
    assert name == f"tiny-{scheme}"
    res = decode.run(model, name, batch=2, context=12, graphs=False, out=tmp_path, steps=2)
    rows = {r["scope"]: r for r in res["rows"]}
    n = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    qkv = rows["model.layers.1.self_attn.qkv_proj"]
    x_y_bias = 4 * (2 * 64 + 2 * n)  # fp32 x and y on the CPU
    if scheme == "int8":  # int8 weight, a bf16 scale a row, the fp32 bias
        assert qkv["bytes"] == n * 64 + 2 * n + x_y_bias + 4 * n
    elif scheme == "int4-g32":  # two weights a byte, a bf16 scale per 32 inputs
        assert qkv["bytes"] == n * 32 + 2 * n * 2 + x_y_bias + 4 * n
    else:  # the FP8 op's catalog counts float32 row scales, no bias
        assert qkv["bytes"] == n * 64 + 4 * n + x_y_bias
    assert qkv["flops"] == 2 * 2 * n * 64
    head = next(r for r in res["rows"] if r["op"] == "lm_head")
    assert head["bytes"] < 4 * cfg.vocab_size * cfg.d_model  # not the float head's
    w, _ = decode.weight_and_kv_bytes(model, batch=2, context=12)
    packed = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantLinear)
                 for b in m.buffers())  # fmt: skip
    assert packed and w == packed + sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(KilnError, match="already quantized"):
        decode.quantize_for_profile(model, QuantScheme.parse(scheme), "tiny")


def test_shape_config_is_qwen25_15b():
    cfg = decode.shape_config("qwen2.5-1.5b", 2048)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size) == (
        1536, 28, 12, 2, 128, 8960, 151936)  # fmt: skip
    assert cfg.tie_embeddings and cfg.qkv_bias


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_step_names_every_layers_kernels(graphs, tmp_path):
    import torch

    cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2,
                      ffn_hidden=256, max_seq_len=256, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    res = decode.run(model, "tiny", batch=4, context=64, graphs=graphs, out=tmp_path, steps=3)
    if graphs:
        assert res["alignment"]["identical"], res["alignment"]
    for i in range(cfg.n_layers):
        ops = {r["op"] for r in res["rows"] if r["layer"] == f"layer.{i}"}
        # the K/V write runs inside the rope kernel (kernels.rope.rope_kv_write) at decode
        assert {
            "qkv_proj",
            "o_proj",
            "gate_up_proj",
            "down_proj",
            "norm",
            "rope",
            "attention",
            "swiglu",
        } <= ops, ops
    assert any(r["op"] == "lm_head" for r in res["rows"])
    assert res["attributed_pct"] >= 95, res["summary"]
    total = sum(r["us"] for r in res["rows"]) + sum(o["us"] for o in res["other"])
    assert total == pytest.approx(res["wall_us"], rel=0.02)
    assert res["floor_us"] and 0 < res["floor_us"] < res["wall_us"]


@pytest.mark.gpu
def test_cuda_quantized_step_names_every_layers_kernels(tmp_path):
    # an int4 step with graphs: the quantized kernels named per layer (gate_up with its SwiGLU epilogue),
    # the eager reference aligned with the replay, the floor counted at the packed bytes
    import torch

    from kiln.quant import QuantScheme

    cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2,
                      ffn_hidden=256, max_seq_len=256, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16)
    name = decode.quantize_for_profile(model, QuantScheme.parse("int4-g128"), "tiny")
    res = decode.run(model, name, batch=1, context=64, graphs=True, out=tmp_path, steps=3)
    assert res["alignment"]["identical"], res["alignment"]
    for i in range(cfg.n_layers):
        ops = {r["op"] for r in res["rows"] if r["layer"] == f"layer.{i}"}
        assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "norm", "attention"} <= ops, ops
    assert any(r["op"] == "lm_head" for r in res["rows"]) and res["attributed_pct"] >= 95
    w, _ = decode.weight_and_kv_bytes(model, 1, 64)
    assert res["weight_bytes"] == w < sum(p.numel() * 2 for p in build_model(cfg).parameters())


def test_fill_counts_gives_each_op_instance_its_counts_once(tiny):
    def row(i, scope, op, us, layer="layer.1"):
        return {
            "idx": i,
            "kernel": f"k{i}",
            "cat": "kernel",
            "scope": scope,
            "layer": layer,
            "op": op,
            "us": us,
        }

    rows = [
        row(0, "model.layers.1.input_layernorm", "norm", 2.0),
        row(1, "model.layers.1.self_attn.qkv_proj", "qkv_proj", 5.0),
        row(2, "model.layers.1.self_attn.qkv_proj", "qkv_proj", 1.0),  # the split-K sum
        row(3, "model.layers.1.self_attn", "attention", 4.0),
        row(4, "model.layers.1.self_attn", "attention", 1.0),  # the reduce kernel
        row(5, "model.layers.1.post_attention_layernorm", "norm", 3.0),
        row(6, None, "lm_head", 9.0, layer="head"),
    ]
    values = {"dram_read_TBps": 1.0, "matmul_bf16_TFLOPs": 100.0, "matmul_fp32_TFLOPs": 10.0}
    decode.fill_counts(rows, decode.accounting(tiny, batch=2, context=12), values)
    counted = [r["idx"] for r in rows if "bytes" in r]
    assert counted == [0, 1, 3, 5, 6]  # both norms, each op's longest kernel, the head
    norm = 4 * (4 * 2 * 32 + 32)  # fp32, with the residual: x, r, y, sum (2 x 32 each) and the weight
    assert rows[0]["bytes"] == rows[5]["bytes"] == norm
    assert rows[0]["bound_us"] == pytest.approx(norm / 1e12 * 1e6, abs=1e-3)  # memory bound at 1 TB/s
    assert rows[0]["pct_of_bound"] == pytest.approx(100 * rows[0]["bound_us"] / 2.0, abs=0.1)
    assert rows[6]["flops"] == 2 * 2 * 96 * 32  # the head: batch 2, vocab 96, d 32


def test_cli_quant_on_a_saved_model(tmp_path, capsys):
    # `kiln profile decode --model DIR --quant int8` on the CPU: the files named with the scheme
    from kiln.cli import main
    from kiln.model.hf import save_pretrained

    cfg = ModelConfig(arch="qwen2", vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                      max_seq_len=64, tie_embeddings=True, qkv_bias=True)  # fmt: skip
    save_pretrained(build_model(cfg), tmp_path / "m")
    out = tmp_path / "prof"
    args = ["profile", "decode", "--model", str(tmp_path / "m"), "--quant", "int8", "--device", "cpu", "--context",
            "8", "--steps", "2", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    doc = json.loads((out / "decode_m-int8_b1_c8_graphsoff.json").read_text())
    assert doc["model"] == "m-int8" and (out / "decode_summary.md").exists()
    capsys.readouterr()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch", "0"], "--batch takes positive integers"),
        (["--batch", "1,x"], "--batch takes integers"),
        (["--graphs", "maybe"], "--graphs takes on, off or on,off"),
        (["--context", "1"], "--context must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--quant", "int3"], "unknown quantization scheme 'int3'"),
    ],
)
def test_cli_rejects_bad_arguments_before_building_anything(args, message, capsys):
    from kiln.cli import main

    assert main(["profile", "decode", "--shape", "qwen2.5-1.5b", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and message in err
