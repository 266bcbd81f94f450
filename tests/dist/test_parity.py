"""Every parallel scheme trains like one process: per-step losses and final parameters within 1e-5,
gradient norms within 1e-5 relative.

One launch of 4 gloo processes (which also checks kiln.dist.collectives against all_reduce) (torch.multiprocessing) runs the whole matrix in sequence, each scheme
on its own DeviceMesh; the one-process reference trains in this process on the same global batches
from the same initialization (tests/dist/_worker.py). fp32 throughout: the differences left are
summation order (all-reduce vs one sum), a few 1e-7 on the loss.
"""

import pytest
import torch
import torch.multiprocessing as mp

from kiln.cli import main
from kiln.model.hf import from_pretrained
from tests.dist._worker import STEPS, Scheme, train, worker

QWEN3ISH = {"qk_norm": True, "qkv_bias": True, "tie_embeddings": True}  # q/k norms, q/k/v biases, tied head
# 8 experts, top-2. The load-balancing loss is off: each rank computes it over its own micro-batch (as HF,
# TorchTitan and Megatron's default do), a product of per-batch means that no data-parallel split of the
# batch reproduces; the cross-entropy and every gradient path through the experts and router are compared.
MOE = {"arch": "mixtral", "n_experts": 8, "n_experts_per_tok": 2, "router_aux_loss_coef": 0.0}
# ... except in a pipeline without data parallelism, whose micro-batches are the one process's accumulation
# chunks: there each micro-batch's aux is the one process's, so the loss (aux included, weighted high
# enough that leaving it out is ~0.2 of loss) matches exactly
MOE_AUX = {**MOE, "router_aux_loss_coef": 0.1, "n_layers": 4}

SCHEMES = [
    # delay=True: the last rank sleeps before each of its collectives (DDP's buckets, FSDP2's gathers,
    # TP/SP redistributions, pipeline sends): the same losses and parameters, to the bit of the tolerance
    Scheme("ddp", {"dp_replicate": 4}, delay=True),
    Scheme("zero1", {"dp_replicate": 4, "zero": 1}, delay=True),
    # activation checkpointing rides along (it changes memory, never the math)
    Scheme(
        "zero2_selective_ac",
        {"dp_replicate": 1, "dp_shard": 4, "zero": 2, "activation_checkpoint": "selective"},
    ),
    Scheme("fsdp_full_ac", {"dp_replicate": 1, "dp_shard": 4, "activation_checkpoint": "full"}, delay=True),
    Scheme("hsdp", {"dp_replicate": 2, "dp_shard": 2}),
    Scheme("tp", {"dp_replicate": 1, "tp": 4}),
    Scheme("tp_sp", {"dp_replicate": 1, "tp": 4, "sequence_parallel": True}, delay=True),
    # export=True: its final state saved sharded (DCP), then `kiln convert` to HF in one process
    Scheme("dp_x_tp", {"dp_replicate": 1, "dp_shard": 2, "tp": 2}, export=True),
    # 5 steps on dp_shard=4, a sharded (DCP) checkpoint, 5 more on dp_shard=2 x tp=2 from it
    Scheme(
        "dcp_resume_fsdp4_as_dp2_x_tp2",
        {"dp_replicate": 1, "dp_shard": 4},
        resume_as=Scheme("dp2_x_tp2", {"dp_replicate": 1, "dp_shard": 2, "tp": 2}),
    ),
    # pipelines: the accumulation chunks become micro-batches (4 layers so that 4 stages hold one each)
    Scheme(
        "pp_gpipe", {"dp_replicate": 1, "pp": 4, "pp_schedule": "gpipe", "microbatches": 4}, {"n_layers": 4}
    ),
    Scheme(
        "pp_1f1b",
        {"dp_replicate": 1, "pp": 4, "pp_schedule": "1f1b", "microbatches": 8},
        {"n_layers": 4},
        delay=True,
    ),
    Scheme(
        "dp_x_pp_1f1b", {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2}
    ),
    # interleaved 1F1B: 2 stages per rank (rank r holds stages r and r + pp), alone and under FSDP2
    Scheme(
        "pp_interleaved_1f1b",
        {"dp_replicate": 1, "pp": 4, "pp_schedule": "interleaved_1f1b", "microbatches": 8},
        {"n_layers": 8},
    ),
    Scheme(
        "dp_x_pp_interleaved_1f1b",
        {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "pp_schedule": "interleaved_1f1b", "microbatches": 2},
        {"n_layers": 4},
    ),
    # a sharded checkpoint of pipeline stages (each stage's ranks write their own shards) resumed without
    # a pipeline: 5 steps on dp_shard=2 x pp=2, 5 more on dp_shard=2 x tp=2
    Scheme(
        "dcp_resume_dp2_x_pp2_as_dp2_x_tp2",
        {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
        resume_as=Scheme("dp2_x_tp2", {"dp_replicate": 1, "dp_shard": 2, "tp": 2}),
    ),
    # tp x pp: a 2D mesh, tensor parallel inside each stage, the vocab-parallel loss on the last
    Scheme("tp_x_pp_1f1b", {"dp_replicate": 1, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2}),
    Scheme(
        "dp_x_tp_sp_qwen3ish",
        {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "sequence_parallel": True},
        QWEN3ISH,
    ),  # fmt: skip
    # MoE: FSDP2 alone, then expert parallel (kiln.dist.expert_parallel) with 2 whole experts a rank, with
    # the experts also FSDP2-sharded (ep=2 inside dp_shard=4), under HSDP, and on the grouped-GEMM path
    Scheme("moe_fsdp", {"dp_replicate": 1, "dp_shard": 4}, MOE),
    Scheme("moe_ep4", {"dp_replicate": 1, "dp_shard": 4, "ep": 4}, MOE, delay=True, export=True),
    # activation checkpointing re-runs the all-to-alls (and their host sync) in backward, on every rank alike
    Scheme(
        "moe_fsdp2_x_ep2", {"dp_replicate": 1, "dp_shard": 4, "ep": 2, "activation_checkpoint": "full"}, MOE
    ),
    Scheme("moe_hsdp_ep2_zero2", {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "zero": 2}, MOE),
    Scheme("moe_ep2_grouped", {"dp_replicate": 1, "dp_shard": 4, "ep": 2}, MOE, kernels={"moe": "kiln"}),
    # experts re-laid out through a sharded checkpoint: 4 ranks of 2 experts -> 2 ranks of 4, FSDP2 over 2
    Scheme(
        "dcp_resume_moe_ep4_as_ep2",
        {"dp_replicate": 1, "dp_shard": 4, "ep": 4},
        MOE,
        resume_as=Scheme("moe_fsdp2_x_ep2", {"dp_replicate": 1, "dp_shard": 4, "ep": 2}, MOE),
    ),
    # MoE pipelines: the stages pass on their aux-loss sum; expert parallel inside FSDP2-sharded stages
    Scheme(
        "pp_gpipe_moe_aux", {"dp_replicate": 1, "pp": 4, "pp_schedule": "gpipe", "microbatches": 2}, MOE_AUX
    ),
    # MoE under tensor parallel: experts split by expert over tp, every rank routing all the tokens (no data
    # parallelism in the first, second and last: the load-balancing loss stays on)
    Scheme("moe_tp4_aux", {"dp_replicate": 1, "tp": 4}, MOE_AUX),
    Scheme("moe_tp4_sp_aux", {"dp_replicate": 1, "tp": 4, "sequence_parallel": True}, MOE_AUX),
    Scheme("moe_dp_x_tp_sp", {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "sequence_parallel": True}, MOE),
    Scheme(
        "moe_tp_x_pp_aux",
        {"dp_replicate": 1, "tp": 2, "pp": 2, "pp_schedule": "1f1b", "microbatches": 2},
        MOE_AUX,
    ),
    Scheme(
        "dp_x_pp_x_ep_moe",
        {"dp_replicate": 1, "dp_shard": 2, "pp": 2, "ep": 2, "pp_schedule": "1f1b", "microbatches": 2},
        MOE,
        delay=True,
    ),
]
WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_parity")
    mp.spawn(worker, args=(WORLD, str(out / "init"), str(out), SCHEMES), nprocs=WORLD)
    refs = {}
    for s in SCHEMES:
        if s.reference_key not in refs:
            refs[s.reference_key] = train(Scheme("reference", {}, s.model, kernels=s.kernels))
    found = {s.name: (torch.load(out / f"{s.name}.pt"), refs[s.reference_key]) for s in SCHEMES}
    found["collectives"] = torch.load(out / "collectives.pt")
    found["out"] = out
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCHEMES])
def test_losses_and_parameters_match_one_process(results, name):
    got, ref = results[name]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5, abs=0)
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # the reference trains (a real comparison)
    assert got["params"].keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        err = (got["params"][k] - v).abs().max().item()
        assert err <= 1e-5, f"{name}: {k} differs by {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCHEMES if s.model.get("n_experts")])
def test_moe_schemes_split_the_experts_as_asked(results, name):
    """Rank 0's MoE blocks (all, or its pipeline stage's) ran their experts split over the ep ranks
    (all-to-all) or over the tp ranks, as the scheme asks; plain data parallel none."""
    got, _ = results[name]
    scheme = next(s for s in SCHEMES if s.name == name)
    par = (scheme.resume_as or scheme).parallel
    layers = scheme.model.get("n_layers", 2) // par.get("pp", 1)
    assert got["ep_blocks"] == (layers if par.get("ep", 1) > 1 else 0), (name, got["ep_blocks"])
    assert got["tp_expert_blocks"] == (layers if par.get("tp", 1) > 1 else 0), (name, got["tp_expert_blocks"])


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCHEMES if s.delay])
def test_injected_delays_happened(results, name):
    """The schemes above that pass with delay=True did see the delays: the last rank slept before
    collectives of every kind it runs (tests/dist/_worker.delayed_collectives), at least one per step."""
    got, _ = results[name]
    assert got["delayed_calls"] >= STEPS, (name, got["delayed_calls"])


@pytest.mark.slow
def test_ring_and_recursive_doubling_all_reduce_match_the_library(results):
    """Run in the same launch (kiln.dist.collectives): 4 ranks and 3 of them, uneven and tiny sizes."""
    errors = results["collectives"]
    assert len(errors) == 2 * 2 * 5 * 2  # algorithms x groups x shapes x dtypes
    for key, err in errors.items():
        # integers exactly; float64 sums of 4 values of ~100 in another order: rounding only
        assert err <= (0 if "int64" in key[3] else 1e-12), (key, err)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s.name for s in SCHEMES if s.export])
def test_sharded_checkpoint_exports_to_one_hf_directory(results, name, tmp_path):
    """dp_shard=2 x tp=2 (FSDP2's and TP's DTensors) and ep=4 (experts split by expert over the ep ranks)
    saved their final states as DCP shards; `kiln convert` reads them in one process and writes HF
    safetensors that kiln loads back: the same parameters as the run's own gathered ones (exactly) and
    the one-process run's (within 1e-5)."""
    got, ref = results[name]
    hf = tmp_path / "hf"
    assert main(["convert", str(results["out"] / f"{name}.dcp"), str(hf)]) == 0
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors"))
    params = from_pretrained(hf).state_dict()
    assert params.keys() == got["params"].keys()
    for k, v in params.items():
        assert torch.equal(v, got["params"][k]), k
        assert (v - ref["params"][k]).abs().max().item() <= 1e-5, k
