"""The speed run's pieces on the CPU: the Python-sources corpus, its fixed split, and stopping at a target."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.data.pysources import held_out, load_python_corpus, source_files, zlib_bits_per_byte
from kiln.errors import KilnError
from kiln.train.config import resolve_config
from kiln.train.run import run, stage_settings


def test_corpus_is_named_files_in_a_fixed_order_with_a_fixed_held_out_set():
    names, docs, fp = load_python_corpus(["jinja2"], max_bytes=400_000)
    again, docs2, fp2 = load_python_corpus(["jinja2"], max_bytes=400_000)
    assert names == again and docs == docs2 and fp == fp2
    assert fp["bytes"] == sum(len(d.encode("utf-8")) for d in docs) >= 400_000
    assert {n.split("/")[0] for n in names} <= {"stdlib", "pydoc_data", "jinja2"}
    # the held-out set depends on a file's name only: adding a package moves no file across the split
    whole = dict(zip(*load_python_corpus(["jinja2", "tqdm"], max_bytes=800_000)[:2]))
    for n in set(names) & set(whole):
        assert held_out(n, 0.1) == held_out(n, 0.1)
    files = [n for n, _ in source_files(["jinja2"])]
    frac = sum(held_out(n, 0.1) for n in files) / len(files)
    assert 0.07 < frac < 0.13  # about val_fraction of the files
    assert "jinja2/__init__.py" in files and "stdlib/json/__init__.py" in files


def test_the_repetition_filter_leaves_out_exactly_the_files_zlib_compresses_below_the_bound():
    names, docs, fp = load_python_corpus(["jinja2"], max_bytes=3_000_000)
    kept, kept_docs, kfp = load_python_corpus(["jinja2"], max_bytes=3_000_000, min_zlib_bpb=1.2)
    assert "min_zlib_bpb" not in fp  # off: the fingerprint reads as before the option existed
    rate = {n: zlib_bits_per_byte(d.encode("utf-8")) for n, d in zip(names, docs)}
    low = {n for n, r in rate.items() if r < 1.2}
    assert low and len(low) < len(names) / 2  # a few files at this bound (~4%), not most of them
    # the same order with the repetitive files taken out (and, under max_bytes, more files after them)
    assert [n for n in names if n not in low] == kept[: len(names) - len(low)]
    assert all(zlib_bits_per_byte(d.encode("utf-8")) >= 1.2 for d in kept_docs)
    assert kfp["min_zlib_bpb"] == 1.2 and kfp["dropped_files"] >= len(low) and kfp["dropped_bytes"] > 0
    # a table of repeated rows compresses far below hand-written code
    assert zlib_bits_per_byte(b"'aten::add': ['Tensor', 'Tensor'],\n" * 2000) < 0.1
    assert 1.2 < zlib_bits_per_byte(Path(__file__).read_bytes()) < 3.5
    with pytest.raises(KilnError, match="min_zlib_bpb must be in"):
        resolve_config("speedrun", overrides=["--data.min_zlib_bpb=9"])
    with pytest.raises(KilnError, match="set data.packages too"):
        resolve_config("cpu", overrides=["--data.min_zlib_bpb=0.8"])
    assert resolve_config("speedrun").data.min_zlib_bpb == 0.8
    # off, the reuse check reads a run's stages.json as written before the option existed
    assert "min_zlib_bpb" not in stage_settings(resolve_config("cpu"))["data"]
    assert stage_settings(resolve_config("speedrun"))["data"]["min_zlib_bpb"] == 0.8


def test_a_missing_package_is_a_clear_error():
    with pytest.raises(KilnError, match="not an installed package.*leave it out of data.packages"):
        load_python_corpus(["no_such_package_kiln"])
    with pytest.raises(KilnError, match="set only one"):
        resolve_config("speedrun", overrides=["--data.path=x.txt"])


def test_the_preset_resolves_to_muon_with_a_target():
    cfg = resolve_config("speedrun")
    assert cfg.train.optimizer == "muon" and cfg.train.target_val_bpb and cfg.train.compile
    assert cfg.data.packages and cfg.model.vocab_size == cfg.tokenizer.vocab_size


TINY = [
    '--data.packages=["jinja2"]',
    "--data.max_bytes=300000",
    "--data.val_fraction=0.2",
    "--tokenizer.vocab_size=300",
    "--tokenizer.train_bytes=100000",
    "--model.d_model=32",
    "--model.n_layers=1",
    "--model.n_heads=2",
    "--model.n_kv_heads=1",
    "--model.ffn_hidden=64",
    "--model.max_seq_len=32",
    "--train.steps=60",
    "--train.batch_size=4",
    "--train.seq_len=32",
    "--train.warmup_steps=2",
    "--train.eval_interval=4",
    "--train.eval_batches=2",
    "--train.log_interval=4",
    "--train.compile=false",
    "--sample.max_new_tokens=0",
]


def test_a_run_stops_at_its_target_and_at_its_time_limit(tmp_path):  # two tiny runs, 2.5 s measured
    # the untrained model is near log2(300) / 1.3 bytes per token = 6.3 bits per byte: 6.2 is met after a
    # few evaluations (about step 28), long before train.steps
    cfg = resolve_config(
        "speedrun", overrides=[f"--out_dir={tmp_path}", "--device=cpu", "--train.target_val_bpb=6.2", *TINY]
    )
    summary = run(cfg, progress=False)
    assert summary["stop"] == "target" and summary["steps"] < 60
    assert summary["val_bpb"] <= 6.2 and summary["train_time_s"] > 0
    assert summary["corpus"]["packages"] == ["jinja2"] and len(summary["corpus"]["list_sha256"]) == 64
    vals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if r["kind"] == "val"]
    assert vals[-1]["stop"] == "target" and all(r["val_bpb"] > 6.2 for r in vals[:-1]) and len(vals) > 1
    times = [r["train_time_s"] for r in vals]
    assert times == sorted(times)
    assert (tmp_path / "checkpoints" / "LATEST.json").exists()  # the stop is checkpointed
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["corpus"] == summary["corpus"]

    cfg = resolve_config(
        "speedrun",
        overrides=[
            f"--out_dir={tmp_path}",
            "--device=cpu",
            "--train.target_val_bpb=null",
            "--train.max_time_s=1e-6",
            *TINY,
        ],
    )
    summary = run(cfg, progress=False, overwrite=True)
    assert summary["stop"] == "time" and summary["steps"] == 4  # the first evaluation


@pytest.mark.slow  # 15 s measured with one thread: data, two tiny runs, JSON and PNG
def test_bench_speedrun_smoke(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "KILN_COMMIT": "smoke-test", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    out = tmp_path / "speedrun.json"
    cmd = [
        sys.executable,
        str(root / "bench" / "speedrun.py"),
        "--smoke",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "w"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["area"] == "speedrun" and doc["smoke"] is True and doc["commit"] == "smoke-test"
    assert (tmp_path / "speedrun.png").stat().st_size > 0
    for name in ("kiln", "baseline"):
        run_ = doc["runs"][name]
        assert "error" not in run_ and run_["reached"], run_
        assert run_["curve"][-1]["val_bpb"] <= doc["target_val_bpb"] < run_["curve"][0]["val_bpb"]
    assert doc["ratio"] == pytest.approx(
        doc["runs"]["baseline"]["train_time_s"] / doc["runs"]["kiln"]["train_time_s"], abs=1e-3
    )
    assert doc["corpus"]["packages"] == ["jinja2"] and doc["tokens_per_step"] == 128
