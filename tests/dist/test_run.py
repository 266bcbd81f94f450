"""`kiln run` under torchrun with tensor + sequence parallel, pipeline parallel and expert parallel: the
loop's strategy path end to end, both checkpoint formats, a resume on another mesh and the export of its shards.

Two processes (tp=2, sequence parallel; pp=2, 1F1B; gloo) stop at step 2 with a checkpoint gathered
from the shards or stages, resume to step 4, and must log the losses of one uninterrupted process on
the same batches; validation (through the vocab-parallel loss, through the pipeline) and samples (from
the gathered weights) run too.
"""

import json
import subprocess
import sys

import pytest
import torch

from kiln.cli import main
from kiln.io.checkpoint import load_checkpoint
from kiln.model.hf import from_pretrained

COMMON = [
    "run",
    "--preset",
    "tiny",
    "--no-progress",
    "--device",
    "cpu",
    "--train.steps=4",
    "--train.log_interval=1",
    "--train.eval_interval=2",
    "--train.ckpt_interval=2",
    "--train.grad_accum=2",
    "--sample.max_new_tokens=4",
    "--train.batch_size=4",
]
TP = ["--parallel.dp_replicate=1", "--parallel.tp=2", "--parallel.sequence_parallel=true"]
PP = ["--parallel.dp_replicate=1", "--parallel.pp=2"]


LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "-m", "kiln.cli"]


def _records(run_dir, kind, key):
    recs = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in recs if r["kind"] == kind]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One uninterrupted process: the reference every launch below must match."""
    out = tmp_path_factory.mktemp("single") / "run"
    assert main([*COMMON, "--out", str(out)]) == 0
    return out


def _launch(nproc: int, args: list[str], common: list[str] = COMMON) -> subprocess.CompletedProcess:
    launch = [*LAUNCH[:4], f"--nproc_per_node={nproc}", *LAUNCH[4:]]
    r = subprocess.run([*launch, *common, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _same_losses(single, run_dir, tol=1e-5):
    a, b = _records(single, "train", "loss"), _records(run_dir, "train", "loss")
    assert len(a) == len(b) == 4
    assert b == pytest.approx(a, abs=tol, rel=0)
    assert _records(run_dir, "val", "val_loss") == pytest.approx(
        _records(single, "val", "val_loss"), abs=tol, rel=0
    )


@pytest.mark.slow
def test_tensor_parallel_run_stops_resumes_and_matches_one_process(single, tmp_path):
    tp = tmp_path / "tp"
    # the tensor-parallel ranks read the same rows: the global batch is 4 sequences, as in one process
    for extra in (["--stop-at", "2"], ["--resume"]):
        r = _launch(2, [*TP, "--out", str(tp), *extra])
    assert "tensor parallel + sequence parallel" in r.stdout
    _same_losses(single, tp)
    assert "--- prompt" in r.stdout  # rank 0 sampled from the gathered weights


@pytest.mark.slow
def test_pipeline_run_stops_resumes_and_matches_one_process(single, tmp_path):
    """pp=2, 1F1B: the step's 2 x 4 rows cut into 2 micro-batches; the loss from the last stage, the
    norm over both stages, validation forward through both, a checkpoint merged from the stages on
    rank 0 (stop at 2), the resume splitting it again, samples from the merged weights."""
    pp = tmp_path / "pp"
    args = [*PP, "--train.checkpoint_format=full", "--out", str(pp)]
    first = _launch(2, [*args, "--stop-at", "2"])
    assert "pipeline 1f1b, 2 micro-batches, bubble 33.3% of a step" in first.stdout
    assert not list((pp / "checkpoints").glob("*.dcp"))  # the full format: one merged .pt
    r = _launch(2, [*args, "--resume"])
    _same_losses(single, pp)
    assert "--- prompt" in r.stdout


@pytest.mark.slow
def test_sharded_checkpoint_resumes_on_another_mesh_and_exports(single, tmp_path):
    """pp=2 writes dcp checkpoints (auto for a pipelined run): each stage's shards in step_2.dcp, the
    rest of the state in step_2.pt, which LATEST.json names. The run resumes as tp=2 + sequence
    parallel (another mesh, the same data-parallel size): DCP reshards by name, the losses and
    validation are those of one uninterrupted process; then `kiln convert` of the run directory
    exports the final shards to HF safetensors equal to the one process's final weights."""
    run = tmp_path / "run"
    _launch(2, [*PP, "--out", str(run), "--stop-at", "2"])
    ckpts = run / "checkpoints"
    assert json.loads((ckpts / "LATEST.json").read_text())["file"] == "step_0000002.pt"
    assert (ckpts / "step_0000002.dcp" / ".metadata").is_file()
    r = _launch(2, [*TP, "--parallel.pp=1", "--out", str(run), "--resume"])  # the run's config has pp=2
    assert "resume: parallel.pp changed from 2 to 1" in r.stdout
    assert (ckpts / "step_0000004.dcp" / ".metadata").is_file()
    _same_losses(single, run)
    hf = tmp_path / "hf"
    assert main(["convert", str(run), str(hf)]) == 0
    got = from_pretrained(hf).state_dict()
    want = load_checkpoint(single / "checkpoints")["model"]  # the one process's step 4
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert (got[k] - v).abs().max().item() <= 1e-5, k


@pytest.mark.slow
def test_expert_parallel_run_stops_resumes_and_matches_one_process(tmp_path):
    """A Mixtral-style model (4 experts, top-2) on dp_shard=2 x ep=2: each rank holds 2 whole experts and
    routes its own 2 rows a micro-batch to them all-to-all. Stop at 2 (dcp), resume: the losses, gradient
    norms and validation of one process on the same 4-row batches. The load-balancing loss is off (it is
    computed per rank's micro-batch, tests/dist/test_parity.py)."""
    moe = ["--model.arch=mixtral", "--model.n_experts=4", "--model.router_aux_loss_coef=0"]
    single, run = tmp_path / "single", tmp_path / "ep"
    assert main([*COMMON, *moe, "--out", str(single)]) == 0
    ep = [
        *moe,
        "--train.batch_size=2",
        "--parallel.dp_replicate=1",
        "--parallel.dp_shard=2",
        "--parallel.ep=2",
    ]
    for extra in (["--stop-at", "2"], ["--resume"]):
        r = _launch(2, [*ep, "--out", str(run), *extra])
    assert "expert parallel over 2 ranks" in r.stdout
    _same_losses(single, run)
    norms = _records(run, "train", "grad_norm")
    assert norms == pytest.approx(_records(single, "train", "grad_norm"), rel=1e-5, abs=0)
    assert "--- prompt" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_pipeline_on_two_gpus(tmp_path):
    """The CPU tests above on 2 GPUs (NCCL, kiln's Triton kernels): pp=2 in fp32 logs the losses of one
    GPU, stops with a dcp checkpoint and resumes as tp=2; interleaved 1F1B in bf16 autocast (4 layers)
    logs the losses of one GPU in bf16. Tolerances: 1e-4 in fp32 (the stages' unmerged q/k/v and gate/up
    GEMMs and the tp shards accumulate in another order than one GPU's merged ones); 2e-2 in bf16 (its
    8-bit mantissa, over 4 steps)."""
    gpu = ["cuda" if a == "cpu" else a for a in COMMON]  # --device cuda (cuda:LOCAL_RANK under torchrun)
    fp32, single, run = [*gpu, "--train.dtype=fp32"], tmp_path / "single", tmp_path / "pp"
    assert main([*fp32, "--out", str(single)]) == 0
    _launch(2, [*PP, "--out", str(run), "--stop-at", "2"], fp32)
    r = _launch(2, ["--parallel.dp_replicate=1", "--parallel.tp=2", "--parallel.pp=1", "--out", str(run),
                    "--resume"], fp32)  # fmt: skip
    assert "resume: parallel.pp changed from 2 to 1" in r.stdout
    _same_losses(single, run, tol=1e-4)
    deep = [*gpu, "--model.n_layers=4"]
    single_bf16, inter = tmp_path / "single_bf16", tmp_path / "interleaved"
    assert main([*deep, "--out", str(single_bf16)]) == 0
    r = _launch(2, [*PP, "--parallel.pp_schedule=interleaved_1f1b", "--out", str(inter)], deep)
    assert "interleaved_1f1b (2 stages per rank), 2 micro-batches, bubble 20.0%" in r.stdout
    _same_losses(single_bf16, inter, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_expert_parallel_on_two_gpus(tmp_path):
    """The CPU expert-parallel test on 2 GPUs: NCCL's all-to-all and, on CUDA, the grouped GEMM kernels
    for the local experts (kernels.moe auto). fp32 against one GPU within 1e-4 (the one GPU runs the
    same kernels over all experts at once, so the tiles accumulate in another order), a dcp stop and
    resume; then bf16 autocast within 2e-2, as the pipeline test on two GPUs."""
    gpu = ["cuda" if a == "cpu" else a for a in COMMON]
    moe = ["--model.arch=mixtral", "--model.n_experts=4", "--model.router_aux_loss_coef=0"]
    ep = ["--train.batch_size=2", "--parallel.dp_replicate=1", "--parallel.dp_shard=2", "--parallel.ep=2"]
    fp32 = [*gpu, *moe, "--train.dtype=fp32"]
    single, run = tmp_path / "single", tmp_path / "ep"
    assert main([*fp32, "--out", str(single)]) == 0
    for extra in (["--stop-at", "2"], ["--resume"]):
        r = _launch(2, [*ep, "--out", str(run), *extra], fp32)
    assert "expert parallel over 2 ranks" in r.stdout
    _same_losses(single, run, tol=1e-4)
    bf16, single_bf16, run_bf16 = [*gpu, *moe], tmp_path / "single_bf16", tmp_path / "ep_bf16"
    assert main([*bf16, "--out", str(single_bf16)]) == 0
    _launch(2, [*ep, "--out", str(run_bf16)], bf16)
    _same_losses(single_bf16, run_bf16, tol=2e-2)
