"""MoE router (kernels/moe_router.py) against its float64 reference: weights, experts, counts, the aux and
z losses and the logits' gradient through all three; the losses against transformers' own functions; the
custom op under opcheck; bf16 logits on the GPU."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_router import route, router_bwd_op, router_op, router_ref

from ._tolerance import assert_close


def _compare(logits, k, scoring, renorm, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = logits.shape[0]
    dw = torch.randn(N, k, generator=g).to(logits.device)
    c_aux, c_z = 0.7, 1.3  # the losses' weights in the loss whose gradient is compared
    x = logits.detach().requires_grad_()
    with use_backend("triton"):
        got = route(x, k, scoring, renorm)
    xd = logits.detach().double().requires_grad_()
    want = router_ref(xd, k, scoring, renorm)
    assert torch.equal(got.expert_idx, want.expert_idx), "expert choice differs"
    assert torch.equal(got.counts, want.counts) and got.counts.dtype == torch.int32
    assert got.weights.dtype == torch.float32
    assert_close(got.weights, want.weights, name="weights")
    assert_close(got.aux_loss, want.aux_loss, name="aux")
    assert_close(got.z_loss, want.z_loss, name="z")
    ((got.weights * dw).sum() + c_aux * got.aux_loss + c_z * got.z_loss).backward()
    ((want.weights * dw.double()).sum() + c_aux * want.aux_loss + c_z * want.z_loss).backward()
    assert_close(x.grad, xd.grad, name="dlogits")  # in the logits' dtype


@pytest.mark.parametrize("N, E, k", [(1, 1, 1), (7, 8, 2), (17, 8, 8), (5, 64, 6), (9, 60, 1)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renorm", [True, False])
def test_router_matches_float64(N, E, k, scoring, renorm):
    g = torch.Generator().manual_seed(N * E + k)
    _compare(2 * torch.randn(N, E, generator=g), k, scoring, renorm)


def test_router_bf16_logits_and_strided():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(11, 40, generator=g)[:, ::2]  # (11, 20), row stride 40
    _compare(logits, 4, "softmax", True)
    _compare(logits.bfloat16(), 2, "sigmoid", True)  # the kernel reads bf16, computes in float32


def test_router_losses_match_transformers():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(17, 8, generator=g)
    with use_backend("triton"):
        r = route(logits, 2, "softmax", True)
    hf_aux = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    hf_z = router_z_loss_func(logits[None])  # (groups, tokens, E)
    torch.testing.assert_close(r.aux_loss, hf_aux.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r.z_loss, hf_z.float(), rtol=1e-5, atol=1e-6)
    # Mixtral's weights: softmax, top-2, renormalized
    p = torch.softmax(logits, -1)
    w, i = p.topk(2, -1)
    assert torch.equal(r.expert_idx, i.int())
    torch.testing.assert_close(r.weights, w / w.sum(-1, keepdim=True))


def test_router_no_tokens_and_errors():
    with use_backend("triton"):
        r = route(torch.zeros(0, 8, requires_grad=True), 2)
    assert r.weights.shape == (0, 2) and r.counts.tolist() == [0] * 8 and float(r.aux_loss.detach()) == 0.0
    with pytest.raises(ValueError, match="top_k must be in"):
        route(torch.randn(3, 4), 5)
    with pytest.raises(ValueError, match="scoring"):
        route(torch.randn(3, 4), 2, "relu")
    with pytest.raises(ValueError, match="logits must be"):
        route(torch.randn(3), 1)


def test_router_opcheck():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, generator=g, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    with use_backend("triton"):
        torch.library.opcheck(router_op, (logits, 2, "softmax", True), test_utils=checks)
        torch.library.opcheck(router_op, (logits, 3, "sigmoid", False), test_utils=checks)
        w, idx, counts, _, _ = router_op(logits.detach(), 2, "softmax", True)
        args = (logits.detach(), idx, w, counts, torch.randn(6, 2, generator=g), torch.tensor(0.5),
                torch.tensor(2.0), "softmax", True)  # fmt: skip
        torch.library.opcheck(router_bwd_op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("N, E, k, scoring", [(4097, 8, 2, "softmax"), (2048, 128, 8, "softmax"),
                                              (1000, 64, 6, "sigmoid"), (3, 256, 8, "sigmoid")])  # fmt: skip
def test_router_gpu(N, E, k, scoring):
    g = torch.Generator(device="cuda").manual_seed(0)
    _compare(torch.randn(N, E, generator=g, device="cuda"), k, scoring, True)
    # bf16 logits: random bf16 values tie often (8-bit mantissa), and torch.topk's order among ties is
    # not specified; a permutation of distinct multiples of 1/8 (exact in bf16 for E <= 256) has none
    perm = torch.argsort(torch.rand(N, E, generator=g, device="cuda"), dim=1)
    _compare(((perm.float() - E / 2) / 8).bfloat16(), k, scoring, True)
