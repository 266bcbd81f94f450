"""Sampler: greedy, penalties, top-k/top-p/min-p masks against written-out references, counter-based
seeded sampling (reproducible, independent of the batch), the sampled distribution, logprobs."""

import math

import pytest
import torch

from kiln.infer.sampler import (
    Sampler,
    SamplingTensors,
    apply_filters,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    splitmix64,
    uniform_noise,
)

from ._helpers import make_seq

V = 12


def seq_with(seq_id, prompt=(1, 2, 3), output=(), seed=None, **params):
    seq = make_seq(seq_id, list(prompt), seed=seed, **params)
    for t in output:
        seq.append_token(t)
    return seq


def sample(seqs, logits, vocab=None):
    t = SamplingTensors.build(seqs, vocab or logits.shape[1], "cpu")
    return Sampler()(logits, t)


def test_splitmix64_matches_the_reference_stream():
    # SplitMix64 seeded with 0: its first three outputs (Vigna's reference implementation)
    gamma = torch.tensor([0x9E3779B97F4A7C15 - (1 << 64)])
    out = splitmix64(torch.cat([gamma, gamma * 2, gamma * 3]))
    assert [x & (2**64 - 1) for x in out.tolist()] == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]


def test_uniform_noise_is_in_the_open_interval_and_uniform():
    u = uniform_noise(torch.arange(64), torch.arange(64) * 3, 4096)
    assert u.dtype == torch.float32 and u.min() > 0 and u.max() < 1
    # mean 1/2 and variance 1/12 over 262144 draws: standard errors 0.00056 and 0.00016
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt(1 / 180 / u.numel())


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    seqs = [seq_with(i, temperature=0) for i in range(4)]
    assert torch.equal(sample(seqs, logits).token_ids, logits.argmax(-1))
    # greedy rows in a batch with sampled rows are still argmax
    seqs = [seq_with(i, temperature=0 if i % 2 else 1.0) for i in range(4)]
    out = sample(seqs, logits).token_ids
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


def penalized_reference(logits, prompt, output, rep, freq, pres):
    """HF's repetition penalty, then OpenAI's frequency and presence penalties, written out per token."""
    out = list(logits)
    for v in range(len(out)):
        if v in prompt or v in output:
            out[v] = out[v] / rep if out[v] > 0 else out[v] * rep
        count = output.count(v)
        out[v] -= freq * count + pres * (count > 0)
    return out


def test_penalties_against_the_reference_formula():
    logits = torch.tensor([[1.5, -0.5, 2.0, 0.0, -1.0, 0.25], [0.5, 1.0, -2.0, 3.0, 0.1, -0.3]])
    cases = [
        dict(prompt=[0, 1], output=[2, 2, 4], rep=1.3, freq=0.5, pres=0.25),
        dict(prompt=[5], output=[3, 1, 3, 3], rep=0.8, freq=-0.4, pres=1.5),
    ]
    seqs = [
        seq_with(i, prompt=c["prompt"], output=c["output"], repetition_penalty=c["rep"],
                 frequency_penalty=c["freq"], presence_penalty=c["pres"])
        for i, c in enumerate(cases)
    ]  # fmt: skip
    t = SamplingTensors.build(seqs, 6, "cpu")
    got = apply_penalties(logits, t)
    want = torch.tensor([penalized_reference(logits[i].tolist(), **c) for i, c in enumerate(cases)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # greedy takes the argmax of the penalized logits (row 0: token 2's 2.0 falls to 2.0/1.3 - 1.25 < 1.5/1.3)
    greedy = [seq_with(i, prompt=c["prompt"], output=c["output"], temperature=0, repetition_penalty=c["rep"],
                       frequency_penalty=c["freq"], presence_penalty=c["pres"]) for i, c in enumerate(cases)]  # fmt: skip
    assert sample(greedy, logits).token_ids.tolist() == want.argmax(-1).tolist()


def survivors_reference(logits, top_k, top_p, min_p):
    """The tokens top-k, then top-p, then min-p keep, written out on one row (float64)."""
    order = sorted(range(len(logits)), key=lambda v: -logits[v])
    keep = set(range(len(logits)))
    if top_k > 0:
        kth = logits[order[top_k - 1]]
        keep = {v for v in keep if logits[v] >= kth}
    if top_p < 1:
        z = sum(math.exp(logits[v]) for v in keep)
        mass, kept = 0.0, set()
        for v in order:
            if v not in keep:
                continue
            if mass >= top_p:
                break
            kept.add(v)
            mass += math.exp(logits[v]) / z
        keep = kept
    if min_p > 0:
        z = sum(math.exp(logits[v]) for v in keep)
        pmax = max(math.exp(logits[v]) / z for v in keep)
        keep = {v for v in keep if math.exp(logits[v]) / z >= min_p * pmax}
    return keep


FILTERS = [
    dict(top_k=3),
    dict(top_k=1),
    dict(top_p=0.5),
    dict(top_p=0.9),
    dict(top_k=5, top_p=0.6),
    dict(min_p=0.2),
    dict(top_k=6, top_p=0.8, min_p=0.3),
    dict(),
]


@pytest.mark.parametrize("with_top_p", [False, True])
def test_filter_masks_against_the_reference(with_top_p):
    torch.manual_seed(1)
    filters = [f for f in FILTERS if ("top_p" in f) == with_top_p or not f]
    logits = torch.randn(len(filters), V) * 2
    seqs = [seq_with(i, **f) for i, f in enumerate(filters)]
    t = SamplingTensors.build(seqs, V, "cpu")
    masked = logits
    if t.do_top_k or t.do_top_p:
        masked = apply_top_k_top_p(masked, t)
    if t.do_min_p:
        masked = apply_min_p(masked, t)
    for i, f in enumerate(filters):
        want = survivors_reference(
            logits[i].double().tolist(), f.get("top_k", -1), f.get("top_p", 1.0), f.get("min_p", 0.0)
        )
        got = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert got == want, (f, got, want)
        assert torch.equal(masked[i][list(want)], logits[i][list(want)])  # survivors unchanged


def test_processed_logits_match_transformers_processors():
    """HF's RepetitionPenalty -> Temperature -> TopK -> TopP -> MinP chain, one row at a time (HF takes
    scalar parameters), against the sampler's penalties and filters on the whole batch at once."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(6)
    logits = torch.randn(len(FILTERS), V) * 2
    rows = [
        dict(f, temperature=0.5 + 0.25 * i, repetition_penalty=1.0 + 0.1 * (i % 3))
        for i, f in enumerate(FILTERS)
    ]
    seqs = [seq_with(i, prompt=[i % V, 3], output=[5, (2 * i) % V], **r) for i, r in enumerate(rows)]
    t = SamplingTensors.build(seqs, V, "cpu")
    got = apply_filters(apply_penalties(logits, t), t)
    for i, (seq, r) in enumerate(zip(seqs, rows)):
        chain = [
            tf.RepetitionPenaltyLogitsProcessor(r["repetition_penalty"]),
            tf.TemperatureLogitsWarper(r["temperature"]),
        ]
        if r.get("top_k", -1) > 0:
            chain.append(tf.TopKLogitsWarper(r["top_k"]))
        if r.get("top_p", 1.0) < 1.0:
            chain.append(tf.TopPLogitsWarper(r["top_p"]))
        if r.get("min_p", 0.0) > 0.0:
            chain.append(tf.MinPLogitsWarper(r["min_p"]))
        want = tf.LogitsProcessorList(chain)(torch.tensor([seq.token_ids]), logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)


def test_sampled_tokens_stay_inside_the_filters():
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 2
    for f in FILTERS[:-1]:
        want = survivors_reference(
            logits[0].double().tolist(), f.get("top_k", -1), f.get("top_p", 1.0), f.get("min_p", 0.0)
        )
        seqs = [seq_with(0, seed=s, **f) for s in range(200)]
        got = set(sample(seqs, logits.expand(200, V).contiguous()).token_ids.tolist())
        assert got <= want and (len(want) == 1 or len(got) > 1)


def mixed_seqs():
    """Sequences covering every path: sampled, greedy, filtered, penalized; distinct seeds and steps."""
    return [
        seq_with(0, seed=11, output=[4, 5]),
        seq_with(1, seed=12, temperature=0.7, top_k=4),
        seq_with(2, seed=13, temperature=0),
        seq_with(3, seed=14, top_p=0.8, output=[1]),
        seq_with(4, seed=15, min_p=0.1, repetition_penalty=1.2, output=[2, 2]),
        seq_with(5, seed=16, temperature=1.3, frequency_penalty=0.5, presence_penalty=0.5, output=[7, 7, 3]),
    ]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(6, V)
    seqs = mixed_seqs()
    full = sample(seqs, logits).token_ids
    assert torch.equal(sample(mixed_seqs(), logits).token_ids, full)  # same seeds and steps, same tokens
    for i, seq in enumerate(seqs):  # each row alone
        assert sample([seq], logits[i : i + 1]).token_ids.item() == full[i].item()
    perm = [4, 2, 0, 5, 3, 1]
    assert torch.equal(sample([seqs[i] for i in perm], logits[perm]).token_ids, full[perm])
    # in a bigger batch beside unrelated rows
    others = [seq_with(10 + j, seed=100 + j, top_k=3) for j in range(9)]
    big = sample(others[:4] + seqs + others[4:], torch.cat([torch.randn(4, V), logits, torch.randn(5, V)]))
    assert torch.equal(big.token_ids[4:10], full)


def test_seed_and_step_both_move_the_draw():
    logits = torch.zeros(1, 1000)  # uniform over 1000 tokens: a repeat by chance has probability 1e-3
    draw = lambda seq: sample([seq], logits).token_ids.item()
    base = draw(seq_with(0, seed=7))
    assert draw(seq_with(1, seed=7)) == base  # the seed, not the sequence id, decides
    assert draw(seq_with(0, seed=8)) != base
    assert draw(seq_with(0, seed=7, output=[3])) != base  # next step


@pytest.mark.parametrize(
    "params", [dict(), dict(temperature=0.6), dict(temperature=1.5, top_k=5), dict(top_p=0.75)]
)
def test_sampled_frequencies_match_the_distribution(params):
    # 20k draws from one sequence's seed across steps 0..19999 (one row per step)
    N = 20_000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2]])
    seq = seq_with(0, seed=1234, **params)
    t = SamplingTensors.build([seq] * N, 8, "cpu")
    t.steps = torch.arange(N)
    counts = torch.bincount(Sampler()(logits.expand(N, 8).contiguous(), t).token_ids, minlength=8).double()
    # the target: softmax of the filtered, tempered logits (survivors from the reference above)
    z = logits[0].double() / params.get("temperature", 1.0)
    keep = survivors_reference(z.tolist(), params.get("top_k", -1), params.get("top_p", 1.0), 0.0)
    p = torch.zeros(8, dtype=torch.float64)
    p[list(keep)] = torch.softmax(z[list(keep)], 0)
    sigma = (N * p * (1 - p)).sqrt()
    assert torch.all((counts - N * p).abs() <= 5 * sigma + 1e-9), (counts.tolist(), (N * p).tolist())
    assert torch.all(counts[p == 0] == 0)


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(6, V) * 3
    seqs = mixed_seqs()
    for s, k in zip(seqs, [0, 2, 5, None, 1, 3]):
        s.params.logprobs = k
    out = sample(seqs, logits)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.shape == (6, 5)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1), rtol=0, atol=0)
    top = torch.topk(ref, 5, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top.values, rtol=0, atol=0)
    assert torch.equal(out.top_ids, top.indices)
    # host lists in Scheduler.postprocess's argument order
    ids, lps, tops = out.to_host()
    assert ids == out.token_ids.tolist() and lps == out.logprobs.tolist()
    assert tops[2] == list(zip(top.indices[2].tolist(), top.values[2].tolist()))
    # no row asks: nothing computed
    assert sample([seq_with(0)], logits[:1]).logprobs is None
    assert sample([seq_with(0)], logits[:1]).to_host()[1:] == (None, None)


def test_counts_built_from_ragged_histories():
    seqs = [
        seq_with(0, prompt=[1, 1, 2], output=[3, 3, 3, 0], repetition_penalty=1.1),
        seq_with(1, prompt=[4]),
    ]
    t = SamplingTensors.build(seqs, 6, "cpu")
    assert t.output_counts.tolist() == [[1, 0, 0, 3, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert t.seen.tolist() == [
        [True, True, True, True, False, False],
        [False, False, False, False, True, False],
    ]
    assert t.do_penalties and not t.do_top_k and not t.all_greedy
    plain = SamplingTensors.build([seq_with(0)], 6, "cpu")
    assert plain.output_counts is None and not plain.do_penalties and plain.max_logprobs == -1


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    seqs = mixed_seqs()
    for s in seqs:
        s.params.logprobs = 2
    t = SamplingTensors.build(seqs, V, "cuda")
    torch.manual_seed(5)
    logits = torch.randn(6, V, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = Sampler()(logits.cpu(), SamplingTensors.build(mixed_seqs(), V, "cpu"))
    assert torch.equal(out.token_ids.cpu(), cpu.token_ids)
