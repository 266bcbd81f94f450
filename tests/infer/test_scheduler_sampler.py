"""Scheduler and sampler together: seeded sampling makes batching, chunking and preemption invisible.

A fake model turns each sequence's tokens (read back through the fake KV cache of test_scheduler) into
logits; the same requests run once on a roomy configuration and once on a tight one (small budget,
chunked prefill, few blocks: preemptions). Every request must produce the same tokens in both runs.
"""

import torch

from kiln.infer.block_manager import BlockManager
from kiln.infer.sampler import Sampler, SamplingTensors
from kiln.infer.scheduler import Scheduler, SchedulerConfig

from ._helpers import make_seq
from .test_scheduler import check_batch, run_fake_model

V = 64


def make_logits_fn():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(V, V, generator=g) * 2
    return lambda token_ids: table[token_ids[-1]] + 0.1 * len(token_ids)


def generate(specs, num_blocks, budget, max_num_seqs):
    bm = BlockManager(num_blocks, 4)
    cfg = SchedulerConfig(
        max_model_len=128, block_size=4, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs
    )
    sched = Scheduler(cfg, bm)
    logits_of = make_logits_fn()
    sampler = Sampler()
    seqs = [make_seq(i, prompt, seed=1000 + i, **params) for i, (prompt, params) in enumerate(specs)]
    for s in seqs:
        sched.add(s)
    preemptions = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        check_batch(sched, batch)
        preemptions += len(batch.preempted)
        # the fake cache checks every read; its "model" output here is the row of logits to sample from
        rows = run_fake_model(bm, batch, logits_of)
        if rows:
            out = sampler(torch.stack(rows), SamplingTensors.build(batch.sampling_seqs, V, "cpu"))
            sched.postprocess(batch, *out.to_host())
        else:
            sched.postprocess(batch, [])
    assert bm.num_free_blocks == num_blocks
    return [(s.output_token_ids, s.output_logprobs) for s in seqs], preemptions


def test_tokens_do_not_depend_on_batching_chunking_or_preemption():
    g = torch.Generator().manual_seed(1)
    kinds = [
        dict(),
        dict(temperature=0),
        dict(temperature=0.8, top_k=8),
        dict(top_p=0.7, logprobs=2),
        dict(min_p=0.05, repetition_penalty=1.3),
        dict(frequency_penalty=0.7, presence_penalty=0.3, logprobs=0),
    ]
    specs = []
    for i in range(12):
        prompt = torch.randint(0, V, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        specs.append(
            (prompt, dict(kinds[i % len(kinds)], max_tokens=int(torch.randint(4, 16, (1,), generator=g))))
        )
    roomy, n0 = generate(specs, num_blocks=256, budget=512, max_num_seqs=16)
    tight, n1 = generate(specs, num_blocks=14, budget=8, max_num_seqs=8)
    assert n0 == 0 and n1 > 0
    assert tight == roomy
