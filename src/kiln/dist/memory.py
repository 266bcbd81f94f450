"""Per-rank memory of a training step, in theory: parameters, gradients, optimizer state, activations.

What each scheme keeps on one rank (P = parameters after tensor-parallel splitting, which divides the
block matmuls, embedding and head by tp and leaves the norms whole; d = data-parallel size):

    scheme              parameters                    gradients      AdamW state (2 x fp32)
    DDP                 P                             P              2P
    ZeRO-1              P                             P              2P / d
    ZeRO-2 (FSDP2, no   P / d at rest, all of P       P / d          2P / d
      reshard)          gathered from forward to backward
    FSDP2 (ZeRO-3)      P / d + two blocks gathered   P / d          2P / d
                        (the one computing, the one prefetched)

Parameters and gradients are fp32 (4 bytes; FSDP2 reduces gradients in fp32); under bf16 mixed
precision the gathered copies FSDP2 computes with are 2 bytes.

Activations saved for backward, per token per block, in the compute dtype (the layout of kiln's
Llama block, flash attention so no (T, T) matrix is kept): the two norm inputs and the two projection
inputs (4d, whole on every tp rank unless sequence parallel splits them by tokens), q, k, v and the
attention output (2q + 2kv), the gate/up output and the SwiGLU output (3F) (all split by tp). Full
activation checkpointing keeps only each block's input and residual (2d); selective keeps that on
every other block. A MoE block (k experts a token) keeps k times the gate/up and SwiGLU outputs (3kF)
and the token's k rows in expert order and their outputs (2kd), divided by tp (under tensor parallel a
rank runs its n_experts / tp experts). Under expert parallel a rank gathers only its n_experts / ep of a
block's experts (FSDP2 over efsdp), not all of them. The vocab-parallel loss keeps the (N, V / tp) fp32 logits and their softmax;
kiln's fused one-process loss keeps none. Estimates, not measurements: allocator slack, temporary
buffers and communication buffers come on top.
"""

from __future__ import annotations

from kiln.dist.parallel_dims import ParallelDims

GIB = 1024**3


def estimate(model, dims: ParallelDims, batch_size: int, seq_len: int, checkpointing: str = "none",
             compute_bytes: int = 4) -> dict[str, float]:  # fmt: skip
    """Bytes per rank by kind for one step of `batch_size` x `seq_len` tokens per data-parallel rank.
    model: a ModelConfig; compute_bytes: 4 in fp32, 2 under bf16 mixed precision."""
    c = model.param_counts()
    tp, dp, L = dims.tp, dims.dp, model.n_layers
    split = (c["embedding"] + c["attention"] + c["mlp"] + c["head"]) / tp
    P = (split + c["norms"]) / dims.pp
    # expert parallel: the other ranks' experts are never gathered here (all layers' worth)
    experts = model.n_experts * 3 * model.d_model * model.ffn_hidden * L
    elsewhere = experts * (1 - 1 / dims.ep) / tp
    per_block = ((c["attention"] + c["mlp"]) / tp - elsewhere) / L
    if dims.zero >= 2:
        shard = dims.dp_shard
        resident = P / shard
        # ZeRO-2 holds every block's gathered copy
        gathered = P - elsewhere / dims.pp if dims.zero == 2 else 2 * per_block
        params = 4 * resident + compute_bytes * gathered
        grads = 4 * P / shard
        optim = 8 * P / shard
    else:
        params, grads = 4 * P, 4 * P
        optim = 8 * P / (dp if dims.zero == 1 else 1)
    tokens = batch_size * seq_len
    q, kv, d, F = (
        model.n_heads * model.head_dim,
        model.n_kv_heads * model.head_dim,
        model.d_model,
        model.ffn_hidden,
    )
    replicated = 4 * d / (tp if dims.sequence_parallel else 1)
    k = model.n_experts_per_tok if model.n_experts else 1  # (a MoE block: + the k rows in and out, 2kd)
    sharded = (2 * q + 2 * kv + 3 * F * k + (2 * d * k if model.n_experts else 0)) / tp
    full_block = tokens * (replicated + sharded) * compute_bytes
    kept = tokens * 2 * d / (tp if dims.sequence_parallel else 1) * compute_bytes
    layers = L / dims.pp
    if checkpointing == "full":
        acts = layers * kept + full_block  # one block recomputed at a time
    elif checkpointing == "selective":
        acts = layers / 2 * (kept + full_block) + full_block
    else:
        acts = layers * full_block
    if tp > 1:
        acts += 2 * tokens * model.vocab_size / tp * 4  # fp32 logits and their softmax
    return {"parameters": params, "gradients": grads, "optimizer": optim, "activations": acts,
            "total": params + grads + optim + acts}  # fmt: skip


def format_estimate(est: dict[str, float]) -> str:
    return ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in est.items())
