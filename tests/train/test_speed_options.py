"""Training-speed options of the loop (kiln.train.loop, kiln.train.kernels): the kernel choice set on the
model ("auto" attention is kiln on the CPU), activation checkpointing and the memory report in one process,
and no host reads of device values between log steps (the loss and grad norm stay on the device)."""

from __future__ import annotations

import pytest
import torch

from kiln.dist.parallel_dims import ParallelConfig
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig
from kiln.train.config import (
    RunConfig,
    TokenizerConfig,
    TrainConfig,
    TrainKernelConfig,
    config_from_dict,
    resolve_config,
    to_dict,
)
from kiln.train.env import DistEnv
from kiln.train.kernels import resolve_kernels
from kiln.train.loop import Trainer

MODEL = dict(arch="llama", vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
             max_seq_len=16)  # fmt: skip


class Batches:
    """A loader of fixed random batches (what Trainer reads of a TokenLoader)."""

    def __init__(self, B: int, T: int, V: int):
        g = torch.Generator().manual_seed(0)
        self.data = [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(4)]
        self.i = 0

    def next_batch(self):
        b = self.data[self.i % len(self.data)]
        self.i += 1
        return b[:, :-1], b[:, 1:]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


def make_trainer(tmp_path, steps=10, log_interval=5, ac="none", kernels=None, device="cpu"):
    cfg = RunConfig(
        out_dir=str(tmp_path),
        model=ModelConfig(**MODEL),
        tokenizer=TokenizerConfig(vocab_size=300),
        train=TrainConfig(steps=steps, batch_size=2, seq_len=16, log_interval=log_interval, eval_interval=1000,
                          ckpt_interval=1000, warmup_steps=2, lr=1e-3),
        parallel=ParallelConfig(activation_checkpoint=ac),
        kernels=kernels or TrainKernelConfig(),
    )  # fmt: skip
    model = build_model(cfg.model, device=device, seed=0)
    # fused AdamW takes the skip flag on the device: the loop's sync-free path (the one CUDA runs)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, fused=True)
    loader = Batches(2, 16, 300)
    val = [loader.data[0][:, :-1], loader.data[0][:, 1:]]
    t = Trainer(cfg, model, opt, loader, [tuple(val)], torch.ones(300), torch.device(device), DistEnv(),
                tmp_path, progress=False)  # fmt: skip
    return t, model


def test_default_kernels_auto_resolve_to_kiln_on_cpu(tmp_path, capsys):
    assert RunConfig.__dataclass_fields__["kernels"].default_factory().attention == "auto"
    # a partial override keeps training's default for the rest of the section
    cfg = resolve_config("tiny", None, ["--kernels.linear=fp8"])
    assert (cfg.kernels.linear, cfg.kernels.attention) == ("fp8", "auto")
    kernels, why = resolve_kernels(KernelConfig(attention="auto"), ModelConfig(**MODEL), 2, 16,
                                   torch.device("cpu"), None)  # fmt: skip
    assert kernels.attention == "kiln" and "auto on cpu" in why
    t, model = make_trainer(tmp_path)
    assert model.kernels.attention == "kiln" and t.kernels.attention == "kiln"
    assert all(m.attention_backend == "kiln" for m in model.modules() if hasattr(m, "attention_backend"))
    out = capsys.readouterr().out
    assert "kernels: linear auto, auto on cpu: kiln" in out and "memory, estimated: parameters" in out
    # the section round-trips through a saved config, and an old config without it reads as the default
    d = to_dict(t.cfg)
    assert config_from_dict(d).kernels == t.cfg.kernels
    del d["kernels"]
    assert config_from_dict(d).kernels.attention == "auto"


def test_fp8_kernels_reach_the_block_linears(tmp_path):
    _, model = make_trainer(tmp_path, kernels=TrainKernelConfig(linear="fp8", attention="kiln"))
    backends = {
        m.backend for n, m in model.named_modules() if n.startswith("model.layers") and hasattr(m, "backend")
    }
    assert backends == {"fp8"}
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head stays in the fused bf16 linear + CE


def test_activation_checkpointing_one_process_same_gradients(tmp_path, capsys):
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for ac in ("none", "selective", "full"):
        _, model = make_trainer(tmp_path / ac, ac=ac)
        wrapped = [b.forward is not type(b).forward.__get__(b) and hasattr(b.forward, "__wrapped__")
                   for b in model.model.layers]  # fmt: skip
        assert wrapped == {"none": [False, False], "selective": [True, False], "full": [True, True]}[ac]
        model.loss(x, x).backward()
        grads[ac] = [p.grad.clone() for p in model.parameters()]
        assert f"activation checkpointing: {ac}" in capsys.readouterr().out
    for ac in ("selective", "full"):  # recomputation replays the same ops: the same gradients, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[ac], strict=True))


def test_no_host_reads_between_log_steps(tmp_path, monkeypatch):
    """Every read of a device value on the host (item, float, int, bool, tolist) is counted by the step it
    happens in: only the first step (the divergence reference) and the log steps may read."""
    t, _ = make_trainer(tmp_path, steps=12, log_interval=4)
    reads: dict[int, int] = {}
    for name in ("item", "__float__", "__int__", "__bool__", "tolist"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            reads[t.state.step] = reads.get(t.state.step, 0) + 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    step_losses = []
    train_step = t.train_step

    def recording_step():
        out = train_step()
        step_losses.append(out[0].detach().clone())
        return out

    t.train_step = recording_step
    logged = []
    write = t.metrics.write
    t.metrics.write = lambda rec: (logged.append(rec), write(rec))
    t.fit()
    monkeypatch.undo()
    # state.step is already advanced when the loop reads: the first step reads at 1, log lines at 4, 8, 12
    assert set(reads) <= {1, 4, 8, 12}, reads
    assert not any(s in reads for s in (2, 3, 5, 6, 7, 9, 10, 11)), reads
    # the logged loss is the mean of the steps' losses in its interval, as read from the device at the end
    train = [r for r in logged if r["kind"] == "train"]
    assert [r["step"] for r in train] == [4, 8, 12]
    for r, chunk in zip(train, (step_losses[0:4], step_losses[4:8], step_losses[8:12]), strict=True):
        assert abs(r["loss"] - float(torch.stack(chunk).sum()) / 4) < 1e-6


@pytest.mark.gpu
def test_train_step_has_no_cuda_sync(tmp_path):
    """On CUDA, every train step after the first runs with torch's sync debug mode set to "error": any
    implicit device-to-host sync inside the step (an item(), a data-dependent shape, a blocking copy) fails."""
    t, _ = make_trainer(tmp_path, steps=6, log_interval=3, device="cuda")
    train_step = t.train_step

    def strict_step():
        if t.state.step == 0:  # the first step compiles / autotunes kernels
            return train_step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return train_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    t.train_step = strict_step
    assert t.fit()["step"] == 6
