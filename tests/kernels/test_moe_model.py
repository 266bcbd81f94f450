"""The model's MoE block through the kernels (KernelConfig.moe = "kiln") against the eager per-expert loop:
the layer's output, aux loss and every gradient through the Triton kernels (the interpreter on CPU), a
Mixtral model's logits, training loss and gradients, a transformers Mixtral's logits, and on the GPU a
bf16 training step and a decode step captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig
from kiln.model.moe import SparseMoE

TINY = dict(arch="mixtral", vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=24,
            max_seq_len=32, n_experts=8, n_experts_per_tok=2, router_aux_loss_coef=0.1)  # fmt: skip


def _layer_grads(moe, x):
    x = x.detach().requires_grad_()
    moe.zero_grad()
    out, aux = moe(x)
    g = torch.Generator().manual_seed(7)
    (out * torch.randn(out.shape, generator=g)).sum().add(aux * 3.0).backward()
    return out.detach(), aux.detach(), [x.grad, *(p.grad.clone() for p in moe.parameters())]


@pytest.mark.parametrize("E, k, n", [(1, 1, 5), (8, 2, 11), (8, 8, 4), (16, 1, 3)])
def test_sparse_moe_kernels_match_eager_loop(E, k, n):
    torch.manual_seed(E * k + n)
    moe = SparseMoE(d_model=24, hidden=20, n_experts=E, top_k=k, backend="eager")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(n, 24)
    want = _layer_grads(moe, x)
    moe.backend = "kiln"
    with use_backend("triton"):
        got = _layer_grads(moe, x)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for name, a, b in zip(["x", *(n for n, _ in moe.named_parameters())], got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)  # float32, two orders of summation


@pytest.mark.parametrize("E, k, n", [(8, 2, 2), (16, 4, 4), (4, 2, 9), (4, 2, 33), (4, 2, 65)])
def test_sparse_moe_inference_matches_eager_loop(E, k, n):
    # no gradient: up to 64 tokens take the decode kernels (kernels/moe_decode.py's experts form: one row a
    # pass at 2, tl.dot passes at 4, and at 9 and 33 over experts, where 18 / 66 pairs share 4 experts), 65
    # the grouped path
    torch.manual_seed(E + k + n)
    moe = SparseMoE(d_model=24, hidden=20, n_experts=E, top_k=k, backend="eager")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(n, 24)
        want, aux_want = moe(x)
        moe.backend = "kiln"
        with use_backend("triton"):
            got, aux = moe(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, aux_want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_sparse_moe_kernels_compile_without_graph_breaks():
    # every MoE kernel is a custom op and the routing plan plain torch ops: one graph, fullgraph=True
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    moe = SparseMoE(d_model=16, hidden=16, n_experts=4, top_k=2, backend="kiln")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(6, 16)
    with use_backend("triton"):
        want = _layer_grads(moe, x)
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(moe, backend=counter, fullgraph=True)
        got = _layer_grads(compiled, x)
    assert counter.frame_count == 1
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b)


def test_config_rejects_unknown_moe_backend():
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="kernels.moe"):
        KernelConfig(moe="loop")


def _model_run(model, ids):
    model.zero_grad()
    model.eval()
    with torch.no_grad():
        logits = model(ids)
    model.train()
    loss = model.loss(ids, ids)  # cross-entropy + 0.1 * aux
    loss.backward()
    return logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_mixtral_model_kernels_match_eager():
    # the whole model on the reference kernels except the MoE switch: set_kernels reaches every block
    model = build_model(ModelConfig(**TINY), seed=0)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    model.set_kernels(KernelConfig(moe="eager"))
    want = _model_run(model, ids)
    model.set_kernels(KernelConfig(moe="kiln"))
    assert all(m.backend == "kiln" for m in model.modules() if isinstance(m, SparseMoE))
    with use_backend("reference"):
        ref_kernels = _model_run(model, ids)
    for got in (ref_kernels,):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        for n, g in want[2].items():
            torch.testing.assert_close(got[2][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.slow
def test_mixtral_model_triton_kernels_match_eager():
    # every op of the model through Triton (the interpreter): the MoE kernels inside a real training step
    model = build_model(ModelConfig(**{**TINY, "n_layers": 1}), seed=1)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    model.set_kernels(KernelConfig(moe="eager"))
    with use_backend("triton"):
        want = _model_run(model, ids)
        model.set_kernels(KernelConfig(moe="kiln"))
        got = _model_run(model, ids)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_mixtral_kernels_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kiln.model import from_pretrained

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=None)  # fmt: skip
    hf = transformers.MixtralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path).eval()
    model.set_kernels(KernelConfig(moe="kiln"))
    ids = torch.randint(0, 101, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), use_backend("reference"):
        got = model(ids)
    want = hf(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


# ---- CUDA ------------------------------------------------------------------------------------------------
GPU_CFG = dict(arch="mixtral", vocab_size=4096, d_model=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_hidden=704,
               max_seq_len=512, n_experts=8, n_experts_per_tok=2)  # fmt: skip


def _cuda_step(model, ids, backend, amp):
    model.set_kernels(KernelConfig(moe=backend))
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        loss = model.loss(ids, ids)
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
def test_cuda_training_step_kernels_match_eager():
    model = build_model(ModelConfig(**GPU_CFG), device="cuda", seed=0)
    ids = torch.randint(0, 4096, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    # float32: the same routing on both sides (no bf16 ties), IEEE products in the kernel and in cuBLAS
    (l_e, g_e), (l_k, g_k) = (_cuda_step(model, ids, b, amp=False) for b in ("eager", "kiln"))
    assert abs(l_k - l_e) <= 1e-5 * abs(l_e), (l_k, l_e)
    for n, g in g_e.items():
        torch.testing.assert_close(g_k[n], g, rtol=1e-3, atol=1e-3 * g.abs().max().item(), msg=n)
    # bf16 autocast (the training dtype): bf16 router logits tie now and then, and the two sides may
    # break a tie differently (the kernel: the lower expert; torch.topk: unspecified), moving that
    # token's expert gradients; so the loss to 1e-2 and each gradient's direction (cosine > 0.98)
    (l_e, g_e), (l_k, g_k) = (_cuda_step(model, ids, b, amp=True) for b in ("eager", "kiln"))
    assert abs(l_k - l_e) <= 1e-2 * abs(l_e), (l_k, l_e)
    for n, g in g_e.items():
        cos = torch.nn.functional.cosine_similarity(g_k[n].flatten(), g.flatten(), dim=0).item()
        assert cos > 0.98, (n, cos)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 64, 80])  # <= 64 tokens: the decode kernels (experts form); 80: grouped
def test_cuda_graph_decode_step_has_no_host_sync(n):
    moe = SparseMoE(512, 704, 64, 6, backend="kiln").cuda().bfloat16()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = moe(x)  # compiles the kernels outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            moe(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host sync (.tolist(), .item()) inside would raise here
            out, _ = moe(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        fresh, _ = moe(x)
    torch.testing.assert_close(out, fresh)
    assert not torch.equal(out, want)
