"""Every benchmark script runs end to end: `python bench/<area>.py --smoke` on the CPU (tiny shapes,
Triton's interpreter) exits 0 and writes a result with its provenance and cases.

The GPU runs take the same code path with the full shapes; only the timer (do_bench instead of one call),
the device and the shapes differ. bench/tokenizer.py is tested by its own area.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SRC = BENCH.parent / "src"
SCRIPTS = [
    "norms",
    "gemm_ce",
    "attention",
    "matmul_decode",
    "host_overhead",
    "infer",
    "infer_overlap",
    "moe",
    "quant",
    "collectives",
    "distributed",
]


def run_smoke(script: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test"}
    # kiln is installed in CI's venv; a checkout run from the source tree finds it through src/ too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(BENCH / f"{script}.py"), "--smoke", "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_smoke(script, tmp_path):
    out = tmp_path / f"{script}.json"
    proc = run_smoke(script, out)
    assert proc.returncode == 0, (
        f"bench/{script}.py --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    doc = json.loads(out.read_text())
    for key in ("area", "gpu", "torch", "triton", "python", "commit", "date", "ceilings", "wall_s"):
        assert key in doc, f"{script}: result lacks {key!r}"
    assert doc["area"] == script and doc["smoke"] is True and doc["commit"] == "smoke-test"
    cases = doc.get("cases") or doc.get("prefill") or doc.get("host_us_per_call")
    assert cases, f"{script}: no cases in the result"
    if script == "infer":  # every part and peer ran without error, and the float32 decoders agreed
        ran = {(c["part"], c["config"]) for c in cases}
        for part, config in [("latency", "kiln-compile"), ("latency", "gpt-fast"), ("latency", "hf"),
                             ("steady", "kiln-eager"), ("steady", "hf"), ("throughput", "kiln-eager"),
                             ("throughput", "gpt-fast-static"), ("throughput", "hf-static")]:  # fmt: skip
            assert (part, config) in ran, f"infer: no {config} figure in the {part} part"
        assert not [c for c in cases if c.get("error")], [c["error"] for c in cases if c.get("error")]
        agree = doc["agreement"]
        assert set(agree["equal_prefix"].values()) == {agree["steps"]}, agree
        assert len(set(agree["tokens"]["kiln"])) > 1, agree  # not a model that repeats one token
        assert max(agree["logits"]["max_abs_diff"].values()) < 1e-3, agree
    if script == "collectives":  # every op at every size on 2 gloo ranks, each with a fit beside it
        assert {c["op"] for c in cases} == {f["op"] for f in doc["fits"]} and len(doc["fits"]) == 6, doc[
            "fits"
        ]
        assert all(c["p"] == 2 and c["seconds"] > 0 and c["model_us"] > 0 for c in cases), cases
    if script == "distributed":  # every scheme trained on 2 gloo ranks, as one process does (fp32)
        status = {c["case"]: c["status"] for c in cases}
        assert status.pop("pp2_interleaved") in ("ok", "not available"), cases
        assert set(status.values()) == {"ok"}, {c["case"]: c.get("error") for c in cases}
        assert {"plain_1gpu", "plain_1gpu_split", "ddp_ws1", "fsdp2_ws1", "ac_full", "ddp", "zero1", "zero2",
                "fsdp2", "tp2", "tp2_sp", "pp2_1f1b", "fsdp2_ep2"} <= set(status), status  # fmt: skip
        assert {c["model"] for c in cases if c["case"] == "fsdp2_ep2"} == {"tiny_moe"}, cases
        for c in cases:
            if c["case"] != "plain_1gpu" and c["status"] == "ok":
                # summation order only (the parity tests' 1e-5 is per step over 10 steps; these are 6)
                assert c["loss_max_abs_diff"] < 1e-5, (c["case"], c["loss_max_abs_diff"])
                assert c["tokens_per_s"] > 0 and len(c["losses"]) == doc["settings"]["steps"], c
        assert cases[0]["losses"][-1] < cases[0]["losses"][0], cases[0]["losses"]  # the loss moves
        coll = doc["collectives"]
        assert coll["p"] == 2 and len(coll["fits"]) == 6 and coll["cases"], coll


def test_every_bench_script_is_smoke_tested():
    # tokenizer and serve are smoke-tested by their own areas; compile has no CPU smoke (an inductor
    # compile of even the tiny preset takes ~40 s on 2 cores): it runs on the GPU only
    # cuda_ladder has no CPU path at all (CUDA C++ kernels): tests/kernels/cuda tests its error path
    # train: tests/train/test_bench_train.py (its compiled contenders are too slow to compile here)
    # speedrun: tests/train/test_speedrun.py runs its smoke and checks its two runs
    # dist_host_profile: tests/bench/test_dist_host_profile.py (a profile, not a measurement with --smoke)
    # fp8_check: tests/kernels/test_fp8_train.py runs its smoke (a check with a verdict, not a timing)
    # moe_imbalance: tests/bench/test_moe_imbalance.py runs its smoke and checks its figures and --replot
    owned_elsewhere = {
        "fp8_check",
        "tokenizer",
        "compile",
        "serve",
        "cuda_ladder",
        "train",
        "speedrun",
        "dist_host_profile",
        "moe_imbalance",
    }
    scripts = {p.stem for p in BENCH.glob("*.py")} - owned_elsewhere
    assert scripts == set(SCRIPTS), f"bench scripts without a smoke test: {scripts - set(SCRIPTS)}"


@pytest.mark.slow
def test_quant_quality_smoke(tmp_path):
    """bench/quant.py --case quality: the logit error and, with --quality-model, perplexity of a model on
    held-out text for every scheme (here a random-init qwen2 model with a tokenizer trained in the test)."""
    import inspect
    import textwrap

    from kiln.model.config import ModelConfig
    from kiln.model.hf import save_pretrained
    from kiln.model.transformer import build_model
    from kiln.tokenizer.train import train_bpe

    text = inspect.getsource(textwrap) + inspect.getsource(json)
    tok = train_bpe([text[:6000]], 300, progress=False, processes=1)
    cfg = ModelConfig(arch="qwen2", vocab_size=tok.n_vocab, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2,
                      ffn_hidden=256, max_seq_len=32, qkv_bias=True)  # fmt: skip
    model_dir = tmp_path / "model"
    save_pretrained(build_model(cfg, seed=0), model_dir)
    tok.save(model_dir)
    held = tmp_path / "held_out.txt"
    held.write_text(text)
    out = tmp_path / "quality.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(BENCH / "quant.py"), "--smoke", "--case", "quality", "--out", str(out),
           "--quality-model", str(model_dir), "--quality-text", str(held), "--quality-tokens", "256"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and not doc["failed"] and doc["dtype"] == "float32"
    assert {r["scheme"] for r in doc["logits"]} == {"int8", "int4-g128", "fp8"}
    ppl = {r["scheme"]: r["ppl"] for r in doc["perplexity"]}
    assert {"bf16", "int8", "int4-g128", "int4-g128-gptq", "int4-g128-gptq-act-order", "fp8"} <= set(ppl)
    assert all(1.0 < p < 2 * tok.n_vocab for p in ppl.values()), ppl  # finite, no worse than chance by 2x
    assert abs(ppl["int8"] / ppl["bf16"] - 1) < 0.01, ppl  # int8 per channel: within 1% of float


@pytest.mark.slow
def test_quant_fp8_prefill_smoke(tmp_path):
    """bench/quant.py --case fp8-prefill: the FP8 tile candidates checked against the reference, the layer
    chain in every form, and the model's prefill with and without the fused producers (the same bits)."""
    out = tmp_path / "fp8_prefill.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(BENCH / "quant.py"), "--smoke", "--case", "fp8-prefill", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and not doc["failed"]
    res = doc["fp8_prefill"]
    assert [r["shape"] for r in res["tiles"]] == ["qkv", "o", "gate_up", "down"]
    assert {"bf16", "fp8_unfused", "fp8_fused"} <= set(res["layer"]) and res["model"][
        "fused_bits_equal_unfused"
    ]


def test_gpu_suite_parses():
    """bench/gpu_suite.sh (the H200 command) is valid bash: a broken line there costs a device run."""
    proc = subprocess.run(["bash", "-n", str(BENCH / "gpu_suite.sh")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
