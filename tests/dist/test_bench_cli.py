"""`kiln bench collectives`: bad arguments are one clean error; a tiny run on 2 gloo ranks prints the fit
beside every measurement and writes them."""

import json

import pytest
import torch

from kiln.cli import main

TOO_MANY_GPUS = str(max(2, torch.cuda.device_count() + 1))  # an error on any machine, never a real run


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nprocs", "1"], "needs 2 or more ranks"),
        (["--min-bytes", "4096", "--max-bytes", "8192"], "give one size"),
        (["--backend", "nccl", "--nprocs", TOO_MANY_GPUS], "one GPU per rank"),
    ],
)
def test_bad_arguments_are_one_error(capsys, argv, message):
    rc = main(["bench", "collectives", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.startswith("kiln: error: ") and message in err, err


@pytest.mark.slow
def test_tiny_run_on_two_gloo_ranks(capsys, tmp_path):
    out = tmp_path / "c.json"
    assert main(["bench", "collectives", "--max-bytes", "4096", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["p"] == 2 and len(doc["fits"]) == 6 and len(doc["cases"]) == 6 * 2  # 6 ops x {1 KB, 4 KB}
    for case in doc["cases"]:
        assert case["seconds"] > 0 and case["model_us"] > 0 and case["busbw_GBps"] > 0
        assert f"| {case['op']} | {case['bytes']} |" in text
