"""kiln's kernels under torch.compile: each op registered as a custom op passes torch.library.opcheck
(schema, fake tensors, autograd registration), and a tiny Transformer compiles with fullgraph=True (no
graph breaks) for a training step and for the inference forward, equal to eager."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kiln.kernels.attention import attention_bwd_op, attention_fwd_op
from kiln.kernels.dispatch import use_backend
from kiln.kernels.layernorm import layernorm_bwd_op, layernorm_fwd_op
from kiln.kernels.linear_cross_entropy import linear_cross_entropy_bwd_op, linear_cross_entropy_fwd_op
from kiln.kernels.rmsnorm import rmsnorm_bwd_op, rmsnorm_fwd_op
from kiln.kernels.rope import rope_op
from kiln.kernels.swiglu import swiglu_bwd_op, swiglu_fwd_op

# opcheck's utilities: the schema, fake-tensor and autograd-registration checks (its aot_dispatch checks
# run the op through AOTAutograd too, which the compile tests below do end to end)
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args, kwargs=None):
    with use_backend("triton"):
        torch.library.opcheck(op, args, kwargs, test_utils=CHECKS)


def _rand(*shape, g, grad=True, dtype=torch.float32):
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_ops(residual):
    g = torch.Generator().manual_seed(0)
    x, w = _rand(2, 3, 40, g=g), _rand(40, g=g)
    r = _rand(2, 3, 40, g=g) if residual else None
    _opcheck(rmsnorm_fwd_op, (x, w, r, 1e-6, 0.5, True))
    _opcheck(rmsnorm_fwd_op, (x.detach(), w.detach(), None, 1e-6, 0.0, False))  # inference: no statistics
    with torch.no_grad(), use_backend("triton"):
        y, h, rstd = rmsnorm_fwd_op(x, w, r, 1e-6, 0.5, True)
    dh = torch.randn_like(y) if residual else None
    _opcheck(rmsnorm_bwd_op, (torch.randn_like(y), h if residual else x.detach(), w.detach(), rstd, dh, 0.5))


@pytest.mark.parametrize("bias, residual", [(True, False), (False, True)])
def test_layernorm_ops(bias, residual):
    g = torch.Generator().manual_seed(1)
    x, w = _rand(3, 40, g=g), _rand(40, g=g)
    b = _rand(40, g=g) if bias else None
    r = _rand(3, 40, g=g) if residual else None
    _opcheck(layernorm_fwd_op, (x, w, b, r, 1e-5, True))
    with torch.no_grad(), use_backend("triton"):
        y, h, stats = layernorm_fwd_op(x, w, b, r, 1e-5, True)
    dh = torch.randn_like(y) if residual else None
    b = None if b is None else b.detach()  # the backward ops have no backward of their own
    _opcheck(layernorm_bwd_op, (torch.randn_like(y), h if residual else x.detach(), w.detach(), b, stats, dh))


@pytest.mark.parametrize("positions, interleaved", [(False, False), (True, True)])
def test_rope_op(positions, interleaved):
    g = torch.Generator().manual_seed(2)
    q, k = _rand(2, 3, 4, 8, g=g), _rand(2, 3, 2, 8, g=g)
    cos, sin = _rand(5, 4, g=g, grad=False), _rand(5, 4, g=g, grad=False)
    pos = torch.tensor([[0, 1, 4], [2, 3, 3]]) if positions else None
    _opcheck(rope_op, (q, k, cos, sin, pos, interleaved, False))


@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_ops(fused):
    g = torch.Generator().manual_seed(3)
    gate = _rand(3, 5, 24 if fused else 12, g=g)
    up = None if fused else _rand(3, 5, 12, g=g)
    _opcheck(swiglu_fwd_op, (gate, up))
    _opcheck(swiglu_bwd_op, (torch.randn(3, 5, 12), gate.detach(), None if up is None else up.detach()))


@pytest.mark.parametrize("sinks, window, varlen", [(True, 3, False), (False, None, True)])
def test_attention_ops(sinks, window, varlen):
    g = torch.Generator().manual_seed(4)
    # fp16: the interpreter's bf16 tl.dot is broken, fp16 is exact (docs/PLATFORM-NOTES.md)
    # few programs: the interpreter runs each op many times here
    lead = (7,) if varlen else (1, 5)
    q, k, v = (_rand(*lead, h, 16, g=g, dtype=torch.float16) for h in (2, 1, 1))
    s = _rand(2, g=g) if sinks else None
    cu = torch.tensor([0, 3, 7], dtype=torch.int32) if varlen else None
    args = (q, k, v, s, cu, 4 if varlen else 0, True, 0.25, window)
    _opcheck(attention_fwd_op, args)
    with torch.no_grad(), use_backend("triton"):
        o, lse = attention_fwd_op(*args)
    bwd = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o, lse, cu, args[5], True, 0.25, window)
    _opcheck(attention_bwd_op, bwd)


@pytest.mark.parametrize("reduction, bias", [("mean", True), ("sum", False), ("none", True)])
def test_linear_cross_entropy_ops(reduction, bias):
    g = torch.Generator().manual_seed(5)
    h, w = _rand(6, 16, g=g), _rand(40, 16, g=g)
    b = _rand(40, g=g) if bias else None
    t = torch.tensor([1, 39, -100, 7, 0, 5])
    _opcheck(linear_cross_entropy_fwd_op, (h, w, t, b, -100, 0.1, reduction, True, True, bias))
    grad_loss = torch.rand(6)
    b = None if b is None else b.detach()  # the backward ops have no backward of their own
    _opcheck(
        linear_cross_entropy_bwd_op, (h.detach(), w.detach(), t, b, grad_loss, -100, 0.1, True, True, bias)
    )


# A tiny model that reaches every kernel of the training step: RMSNorm with the fused residual add, q/k
# norm, RoPE, GQA attention with a window and sinks, SwiGLU, the fused linear + cross-entropy head.
TINY = dict(
    arch="qwen3",
    vocab_size=97,
    d_model=32,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    ffn_hidden=32,
    max_seq_len=32,
)


def _model(**overrides):
    from kiln.model import ModelConfig, build_model

    return build_model(ModelConfig(**{**TINY, **overrides}), seed=0)


def _loss(model):
    """The loss as the trainer compiles it (kiln.train.loop wraps a module whose forward is model.loss):
    the forward graph compiled whole, its backward compiled by AOTAutograd and run by loss.backward()."""
    return lambda ids: model.loss(ids, ids)


def _kiln_ops(counter) -> set[str]:
    """The kiln custom ops in the graphs Dynamo captured."""
    return {
        str(n.target).removeprefix("kiln.").split(".")[0]
        for gm in counter.graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("kiln.")
    }


@pytest.mark.slow
def test_compiled_training_step_equals_eager():
    torch._dynamo.reset()
    model = _model()
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    counter = CompileCounterWithBackend("aot_eager")
    with use_backend("triton"):
        want = _loss(model)(ids)
        want.backward()
        want_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        got = torch.compile(_loss(model), backend=counter, fullgraph=True)(ids)
        got.backward()
    # one graph through the kernels' custom ops, not the reference path
    assert counter.frame_count == 1
    assert _kiln_ops(counter) == {
        "rmsnorm_fwd",
        "rope",
        "attention_fwd",
        "swiglu_fwd",
        "linear_cross_entropy_fwd",
    }
    # the same kernels in the same order: equal to the bit
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for (name, p), g in zip(model.named_parameters(), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "arch, ops",
    [
        ("qwen3", {"rmsnorm_fwd", "rope", "attention_fwd", "swiglu_fwd"}),
        ("gpt2", {"layernorm_fwd", "attention_fwd"}),
    ],
)
def test_compiled_inference_forward_equals_eager(arch, ops):
    torch._dynamo.reset()
    model = _model(arch=arch).eval()
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(1))
    counter = CompileCounterWithBackend("aot_eager")
    with use_backend("triton"), torch.no_grad():
        want = model(ids)
        got = torch.compile(model, backend=counter, fullgraph=True)(ids)
    assert counter.frame_count == 1 and _kiln_ops(counter) == ops
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_compiled_training_step_equals_eager_on_gpu():
    """bf16 autocast on CUDA, the default inductor backend, the whole loss forward in one graph: loss and
    every gradient equal eager's within bf16 noise (inductor fuses the elementwise code between the
    kernels, e.g. the autocast casts and the residual promotion, so its roundings may differ)."""
    torch._dynamo.reset()
    model = _model(
        arch="llama", vocab_size=2048, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512,
        max_seq_len=512,
    ).cuda()  # fmt: skip
    ids = torch.randint(0, 2048, (4, 512), generator=torch.Generator().manual_seed(0)).cuda()

    def step(loss_fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(ids)
        loss.backward()
        return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}

    want, want_grads = step(_loss(model))
    counter = CompileCounterWithBackend("inductor")
    got, grads = step(torch.compile(_loss(model), backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    assert _kiln_ops(counter) == {
        "rmsnorm_fwd",
        "rope",
        "attention_fwd",
        "swiglu_fwd",
        "linear_cross_entropy_fwd",
    }
    # the loss (about ln 2048 = 7.6) to 1e-3 relative: a few bf16 roundings (2**-9 each) apart at most
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    for name, g in want_grads.items():
        # each gradient as a whole: relative Frobenius error under 1% (bf16 is 2**-8 = 0.4% per rounding,
        # and a weight gradient sums thousands of rounded products)
        err = (grads[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-2, f"{name}: relative error {err:.2e}"
