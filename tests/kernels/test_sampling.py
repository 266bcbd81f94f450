"""Triton sampling against kiln.kernels.sampling.sample_ref: greedy exactly (ties to the first index),
and with the same exponential noise the same token for temperature, top-k, top-p and both."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.sampling import KC_MAX, sample, sample_ref, sample_with_noise

SETTINGS = [
    # (temperature, top_k, top_p)
    (1.0, None, None),
    (0.7, 50, None),
    (1.3, None, 0.9),
    (0.8, 20, 0.5),
    (1.0, 1, None),  # top-k 1 is greedy whatever the noise
    (1.0, None, 1e-6),  # a tiny nucleus keeps only the top token
    (0.9, 0, 1.0),  # both disabled by their conventions
]


def _dtypes(top_p):
    # bf16 logits tie often (8-bit mantissa); under top-p the reference's sort splits a run of equal logits
    # at the cut by position, the kernel keeps or drops the run whole: compare top-p cases on float32.
    return [torch.float32] if top_p is not None and top_p < 1 else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(
    "temperature,top_k,top_p,dtype", [(*st, dt) for st in SETTINGS for dt in _dtypes(st[2])]
)
def test_sample_same_token_as_reference(temperature, top_k, top_p, dtype, device):
    B, V = 3, 301  # odd vocabulary: a ragged last block
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(V)) * 3).to(device, dtype)
    want = sample_ref(logits, temperature, top_k, top_p, torch.Generator(device).manual_seed(5))
    with use_backend("triton"):
        got = sample(logits, temperature, top_k, top_p, torch.Generator(device).manual_seed(5))
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)


@pytest.mark.slow
def test_sample_many_draws_match_reference_with_given_noise(device):
    """Over many rows of noise, the kernel's draw equals the reference rule applied to the same noise."""
    gen = torch.Generator().manual_seed(1)
    B, V = 10, 200
    logits = (torch.randn(B, V, generator=gen) * 2).to(device)
    noise = torch.empty(B, V).exponential_(1.0, generator=gen).to(device)
    for temperature, top_k, top_p in [(1.0, 30, 0.8), (0.5, None, 0.95)]:
        z = logits / temperature
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:] if top_k else None
        z = z if kth is None else z.masked_fill(z < kth, float("-inf"))
        sz, order = torch.sort(z, dim=-1, descending=True)
        p = torch.softmax(sz, -1)
        sz = sz.masked_fill((p.cumsum(-1) - p) >= top_p, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sz)
        want = (torch.softmax(z, -1) / noise).argmax(-1)
        with use_backend("triton"):
            got = sample_with_noise(logits, noise, temperature, top_k, top_p)
        assert torch.equal(got, want)


def _largest_kth_of_chunks(z: torch.Tensor, chunk: int, kc: int) -> float:
    """t_c of the kernel: the largest kc-th value over the chunks (every value above it is a candidate)."""
    parts = [z[j : j + chunk] for j in range(0, z.numel(), chunk)]
    return max(float(p.topk(kc).values[-1]) if p.numel() >= kc else float("-inf") for p in parts)


# (name, logits of one row of V = 301, temperature, top_k, top_p, whether the candidates hold every survivor)
def _path_cases():
    g = torch.Generator().manual_seed(7)
    peaked = torch.randn(301, generator=g) * 4
    ties = torch.randint(-3, 4, (301,), generator=g).float()  # ~43 tokens tie at the top value
    flat = torch.randn(301, generator=g) * 0.01  # the 0.9 nucleus holds ~270 tokens
    return [
        ("top-k from candidates", peaked, 1.0, 5, None, True),
        ("top-k + top-p from candidates", peaked, 0.8, 6, 0.7, True),
        ("top-p from candidates", peaked, 1.0, None, 0.5, True),
        ("top-k ties past a chunk's candidates", ties, 1.0, 5, None, False),
        ("top-p nucleus past the candidates", flat, 1.0, None, 0.9, False),
    ]


@pytest.mark.parametrize(
    "case,dtype",
    [(c, torch.float32) for c in _path_cases()]
    + [(c, dt) for c in _path_cases() if c[4] is None for dt in (torch.bfloat16, torch.float16)],
    ids=lambda x: x[0] if isinstance(x, tuple) else str(x),
)
def test_sample_candidates_and_whole_row_fallback(case, dtype, device):
    """Stage 2 samples from the chunks' candidates when they provably hold every survivor, else searches the
    whole row: both give the reference's token. Small chunks (128) and candidate sets (kc 8) force both.
    16-bit logits pick candidates from packed 32-bit words (top-k cases: with top-p the reference's sort
    splits runs of tied 16-bit logits by position, see _dtypes)."""
    _, row, temperature, top_k, top_p, from_candidates = case
    row = row.to(dtype).float()  # the values the kernel sees
    chunk, kc = 128, 8
    z = row / temperature
    # the deciding cut: top-k's k-th value, else the smallest value top-p keeps; the case takes its path
    kept = _filtered(z[None].double(), None, top_p)
    cut = z.topk(top_k).values[-1] if top_k else kept[kept.isfinite()].min()
    assert (float(cut) > _largest_kth_of_chunks(z, chunk, kc)) == from_candidates
    gen = torch.Generator().manual_seed(3)
    logits = torch.stack([row, row.flip(0), row.roll(50)]).to(device, dtype)
    noise = torch.empty(logits.shape).exponential_(1.0, generator=gen).to(device)
    want = sample_ref_with_noise(logits, noise, temperature, top_k, top_p)
    with use_backend("triton"):
        got = sample_with_noise(logits, noise, temperature, top_k, top_p, chunk=chunk, kc=kc)
    assert torch.equal(got, want), (got, want)


def _filtered(z, top_k, top_p):
    """sample_ref's filters on z (B, V): top-k, then top-p; dropped tokens become -inf."""
    if top_k:
        z = z.masked_fill(z < torch.topk(z, top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p is not None and top_p < 1:
        sz, order = torch.sort(z, dim=-1, descending=True)
        p = torch.softmax(sz, -1)
        sz = sz.masked_fill((p.cumsum(-1) - p) >= top_p, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sz)
    return z


def sample_ref_with_noise(logits, noise, temperature, top_k, top_p):
    """sample_ref's rule with given noise (float64: no rounding ties)."""
    z = _filtered(logits.double() / temperature, top_k, top_p)
    return (torch.softmax(z, -1) / noise.double()).argmax(-1).to(logits.device)


def test_sample_large_top_k_searches_whole_row(device):
    """top_k past KC_MAX: no candidates, the combine searches the whole row."""
    V = KC_MAX * 2 + 37
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, V, generator=gen) * 3).to(device)
    noise = torch.empty(2, V).exponential_(1.0, generator=gen).to(device)
    want = sample_ref_with_noise(logits, noise, 1.0, KC_MAX + 5, None)
    with use_backend("triton"):
        got = sample_with_noise(logits, noise, 1.0, KC_MAX + 5, None)
    assert torch.equal(got, want)


def test_greedy_exact_with_ties_and_strided_rows(device):
    base = torch.randint(-3, 4, (6, 2 * 513), generator=torch.Generator().manual_seed(2)).float()
    logits = base.to(device, torch.float16)[:, :513]  # row stride 1026, ties everywhere
    with use_backend("triton"):
        got = sample(logits, temperature=0.0)
    assert torch.equal(got, logits.argmax(-1))


def test_sample_bad_input_errors(device):
    with use_backend("triton"):
        with pytest.raises(ValueError, match="batch, vocab"):
            sample(torch.randn(2, 3, 4, device=device))
        with pytest.raises(ValueError, match="temperature"):
            sample(torch.randn(2, 4, device=device), temperature=-1.0)
        with pytest.raises(ValueError, match="top_p"):
            sample(torch.randn(2, 4, device=device), top_p=0.0)
        with pytest.raises(ValueError, match="unit stride"):
            sample(torch.randn(4, 2, device=device).t(), temperature=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "temperature,top_k,top_p,dtype",
    [(0.0, None, None, torch.bfloat16), (0.8, 50, None, torch.bfloat16), (1.0, None, None, torch.bfloat16),
     (1.0, 50, 0.9, torch.float32), (0.7, None, 0.95, torch.float32)],
)  # fmt: skip
def test_sample_qwen_vocab(temperature, top_k, top_p, dtype):
    """Top-p on float32 logits: with bf16 ones the reference's sort splits runs of equal logits at the cut
    (seen on the H200: 4 tokens tied at the cut, the reference kept 2 by position, the kernel all 4)."""
    logits = (torch.randn(8, 151936, generator=torch.Generator().manual_seed(0)) * 4).to("cuda", dtype)
    want = sample_ref(logits, temperature, top_k, top_p, torch.Generator("cuda").manual_seed(3))
    got = sample(logits, temperature, top_k, top_p, torch.Generator("cuda").manual_seed(3))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_sample_whole_row_fallback_qwen_vocab():
    """A flat distribution: the 0.9 nucleus spills past the candidates, stage 2 searches whole rows."""
    logits = (torch.randn(4, 151936, generator=torch.Generator().manual_seed(1)) * 0.05).cuda()
    noise = torch.empty(logits.shape, device="cuda").exponential_(
        1.0, generator=torch.Generator("cuda").manual_seed(2)
    )
    want = sample_ref_with_noise(logits, noise, 1.0, None, 0.9)
    got = sample_with_noise(logits, noise, 1.0, None, 0.9)
    assert torch.equal(got, want)
