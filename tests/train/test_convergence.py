"""Training with the Triton kernels converges like training with the reference ops (Liger-style check).

The main job's model (Llama-style: RMSNorm, RoPE, SwiGLU, GQA, fused linear cross-entropy) is trained
for 100 steps under bf16 autocast three times on the same batches: reference ops in bf16, Triton ops
in bf16, and reference ops in fp32. bf16 noise is measured, not assumed: the Triton curve must stay
as close to the bf16 reference as the bf16 reference stays to fp32 (or within 0.03 nats).
"""

import json
import os

import pytest
import torch

from kiln.data.corpus import load_documents
from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.tokenizer import train_bpe
from kiln.train.optim import OptimConfig, WarmupCosine, build_optimizer

STEPS, BATCH, SEQ = 100, 16, 256


def _batches(device):
    docs = load_documents(None, max_bytes=3_000_000)
    tok = train_bpe(docs[:200], vocab_size=2048, progress=False)
    ids = torch.tensor([t for ids in tok.encode_ordinary_batch(docs) for t in [tok.eot_id, *ids]])
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - SEQ - 1, (STEPS, BATCH), generator=g)
    rows = ids[starts[..., None] + torch.arange(SEQ + 1)]  # (STEPS, BATCH, SEQ + 1)
    return rows.to(device), tok.n_vocab


def _curve(rows, vocab, backend, amp, device):
    cfg = ModelConfig(
        arch="llama",
        vocab_size=vocab,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        ffn_hidden=688,
        max_seq_len=SEQ,
    )
    model = build_model(cfg, device=device, dtype=torch.float32, seed=0)
    opt = build_optimizer(model, OptimConfig(lr=2e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8))
    sched = WarmupCosine(opt, 2e-3, 10, STEPS, 0.1)
    losses = []
    with use_backend(backend):
        for batch in rows:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                loss = model.loss(batch[:, :-1], batch[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.gpu
def test_triton_ops_train_like_the_reference_ops():
    device = torch.device("cuda")
    rows, vocab = _batches(device)
    ref_bf16 = _curve(rows, vocab, "reference", True, device)
    tri_bf16 = _curve(rows, vocab, "triton", True, device)
    ref_fp32 = _curve(rows, vocab, "reference", False, device)
    noise = (ref_bf16 - ref_fp32).abs().mean().item()
    gap = (tri_bf16 - ref_bf16).abs().mean().item()
    result = {
        "steps": STEPS,
        "batch": BATCH,
        "seq": SEQ,
        "bf16_noise_mean_abs": noise,
        "triton_vs_ref_mean_abs": gap,
        "final": {
            "ref_bf16": ref_bf16[-1].item(),
            "triton_bf16": tri_bf16[-1].item(),
            "ref_fp32": ref_fp32[-1].item(),
        },
        "curves": {
            "ref_bf16": ref_bf16.tolist(),
            "triton_bf16": tri_bf16.tolist(),
            "ref_fp32": ref_fp32.tolist(),
        },
    }
    if os.environ.get("KILN_CONVERGENCE_OUT"):
        with open(os.environ["KILN_CONVERGENCE_OUT"], "w") as f:
            json.dump(result, f, indent=1)
    assert ref_bf16[-1] < ref_bf16[0] - 2.0  # the run learns
    assert gap <= max(0.03, 2 * noise), result["final"]
    assert abs(tri_bf16[-10:].mean() - ref_bf16[-10:].mean()) <= max(0.03, 2 * noise)
