"""kiln's kernels under torch.compile: each op registered as a custom op passes torch.library.opcheck
(schema, fake tensors, autograd registration), and a tiny Transformer compiles with fullgraph=True (no
graph breaks) for a training step and for the inference forward, equal to eager."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kiln.kernels.attention import attention_bwd_op, attention_fwd_op
from kiln.kernels.cross_entropy import cross_entropy_bwd_op, cross_entropy_fwd_op
from kiln.kernels.decode_attention import decode_attention_op
from kiln.kernels.dispatch import use_backend
from kiln.kernels.layernorm import layernorm_bwd_op, layernorm_fwd_op
from kiln.kernels.linear_cross_entropy import linear_cross_entropy_bwd_op, linear_cross_entropy_fwd_op
from kiln.kernels.matmul import matmul_op
from kiln.kernels.paged_kv import paged_kv_write_op
from kiln.kernels.rmsnorm import rmsnorm_bwd_op, rmsnorm_fwd_op
from kiln.kernels.rope import rope_kv_write_op, rope_op
from kiln.kernels.sampling import sample_op
from kiln.kernels.softmax import softmax_bwd_op, softmax_fwd_op
from kiln.kernels.swiglu import swiglu_bwd_op, swiglu_fwd_op, swiglu_linear_op
from kiln.kernels.vector_add import vector_add_op

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


@pytest.mark.parametrize("dim", [-1, 0])
def test_softmax_ops(dim):
    g = torch.Generator().manual_seed(6)
    x = _rand(3, 4, 33, g=g)
    xl = x if dim == -1 else x.movedim(dim, -1)  # the public op moves `dim` last before the op
    _opcheck(softmax_fwd_op, (xl,))
    with torch.no_grad(), use_backend("triton"):
        y = softmax_fwd_op(xl)
    _opcheck(softmax_bwd_op, (torch.randn_like(y), y))


def test_cross_entropy_ops():
    g = torch.Generator().manual_seed(7)
    logits = _rand(5, 40, g=g)
    t = torch.tensor([3, -100, 39, 0, 7])
    _opcheck(cross_entropy_fwd_op, (logits, t, -100, 0.1))
    with torch.no_grad(), use_backend("triton"):
        _, lse = cross_entropy_fwd_op(logits, t, -100, 0.1)
    _opcheck(cross_entropy_bwd_op, (logits.detach(), t, lse, torch.rand(5), -100, 0.1))


@pytest.mark.parametrize("activation, bias, M", [("none", False, 20), ("silu", True, 20), ("gelu", True, 3)])
def test_matmul_op(activation, bias, M):
    g = torch.Generator().manual_seed(8)
    # M = 3 takes the decode kernels' path (M <= 16) when no pre-activation is stored
    a, b = _rand(M, 24, g=g), _rand(24, 40, g=g)
    c = _rand(40, g=g) if bias else None
    _opcheck(matmul_op, (a, b, c, activation, activation != "none"))
    _opcheck(matmul_op, (a.detach(), b.detach(), None if c is None else c.detach(), activation, False))


def test_vector_add_op():
    g = torch.Generator().manual_seed(11)
    _opcheck(vector_add_op, (_rand(3, 7, g=g), _rand(3, 7, g=g)))


def test_inference_ops():
    """The decode step's ops: paged KV write (declared to mutate the caches), decode attention, sampling."""
    g = torch.Generator().manual_seed(9)
    k_cache, v_cache = torch.zeros(4, 8, 1, 16), torch.zeros(4, 8, 1, 16)
    k, v = torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    _opcheck(paged_kv_write_op, (k_cache, v_cache, k, v, torch.tensor([0, 9, 17])))
    k_cache.normal_(generator=g), v_cache.normal_(generator=g)
    q, table = torch.randn(2, 2, 16, generator=g), torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([11, 3], dtype=torch.int32)
    _opcheck(decode_attention_op, (q, k_cache, v_cache, table, seq_lens, 0.25, None, torch.randn(2), 2))
    logits = torch.randn(2, 50, generator=g)
    noise = torch.empty(2, 50).exponential_(generator=g)
    _opcheck(sample_op, (logits, None, 0.0, None, None))
    _opcheck(sample_op, (logits, noise, 0.8, 5, 0.9))
    # the fused decode ops: RoPE + paged K/V write (mutates the caches), SwiGLU in the down projection
    qkv = torch.randn(3, 4 * 16, generator=g)
    cos, sin = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    rope_args = (
        qkv[:, :32].view(3, 2, 16),
        qkv[:, 32:48].view(3, 1, 16),
        qkv[:, 48:].view(3, 1, 16),
        cos,
        sin,
    )
    _opcheck(
        rope_kv_write_op,
        (*rope_args, torch.tensor([4, 0, 2]), k_cache, v_cache, torch.tensor([5, -1, 30]), False),
    )
    gate_up, w_down = torch.randn(3, 24, generator=g), torch.randn(10, 12, generator=g)
    _opcheck(swiglu_linear_op, (gate_up, w_down, torch.randn(10, generator=g)))


def test_compiled_standalone_ops_equal_eager():
    """The ops the model does not call, compiled whole (fullgraph) with their backward: linear with an
    activation, softmax over a middle dim, cross-entropy; and a decode step: KV write, decode attention,
    greedy sampling."""
    from kiln.kernels.cross_entropy import cross_entropy
    from kiln.kernels.decode_attention import decode_attention
    from kiln.kernels.matmul import linear
    from kiln.kernels.paged_kv import paged_kv_write
    from kiln.kernels.sampling import sample
    from kiln.kernels.softmax import softmax

    g = torch.Generator().manual_seed(10)
    x, w = _rand(6, 24, g=g), _rand(40, 24, g=g)
    t = torch.tensor([3, -100, 39, 0, 7, 1])

    def loss_fn(x, w):
        h = linear(x, w, activation="silu")  # (6, 40)
        p = softmax(h.view(6, 5, 8), dim=1).reshape(6, 40)
        return cross_entropy(p * 4.0, t, label_smoothing=0.1)

    def step(fn):
        x.grad = w.grad = None
        loss = fn(x, w)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    def decode(q, k, v, k_cache, v_cache, slots, table, seq_lens):
        paged_kv_write(k_cache, v_cache, k, v, slots)
        o = decode_attention(q, k_cache, v_cache, table, seq_lens)  # (B, Hq, D)
        return sample(o.reshape(2, -1), temperature=0.0)

    caches = [torch.randn(4, 8, 1, 16, generator=g) for _ in range(2)]
    q, k, v = (torch.randn(2, h, 16, generator=g) for h in (2, 1, 1))
    table, seq_lens = (
        torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        torch.tensor([11, 3], dtype=torch.int32),
    )
    # slots of each sequence's last token: position 10 of sequence 0 (page 0, row 2), 2 of sequence 1 (page 1)
    rest = (torch.tensor([2, 10]), table, seq_lens)
    with use_backend("triton"):
        want = step(loss_fn)
        got = step(torch.compile(loss_fn, backend="aot_eager", fullgraph=True))
        want_caches = [c.clone() for c in caches]
        want_tokens = decode(q, k, v, *want_caches, *rest)
        got_tokens = torch.compile(decode, backend="aot_eager", fullgraph=True)(q, k, v, *caches, *rest)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert got_tokens.tolist() == want_tokens.tolist()
    for a, b in zip(caches, want_caches):  # the compiled write landed in the caller's caches
        torch.testing.assert_close(a, b, rtol=0, atol=0)


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
