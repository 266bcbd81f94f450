"""The alpha-beta fit recovers known alpha and beta from synthetic times; busbw follows nccl-tests."""

import math
import random

import pytest

from kiln.dist.collectives_bench import sizes_between, summarize
from kiln.dist.cost_model import OPS, AlphaBeta, busbw, fit_alpha_beta, terms
from kiln.errors import KilnError

SIZES = [1 << k for k in range(10, 31, 2)]  # 1 KB .. 1 GB


def test_terms_by_hand():
    assert terms("ring_all_reduce", 4) == (6.0, 1.5)  # 2(p-1) messages, 2(p-1)/p of n each rank sends
    assert terms("all_reduce", 8) == (14.0, 1.75)
    assert terms("reduce_scatter", 4) == (3.0, 0.75) and terms("all_gather", 2) == (1.0, 0.5)
    assert terms("all_to_all", 8) == (7.0, 0.875)  # p - 1 exchanges of n / p
    assert terms("recursive_doubling_all_reduce", 8) == (3.0, 3.0)  # log2 8 rounds of the whole tensor
    assert terms("recursive_doubling_all_reduce", 6) == (4.0, 4.0)  # 2 rounds on 4 ranks + fold in and out
    with pytest.raises(KilnError, match="unknown collective"):
        terms("broadcast", 4)


def test_busbw_is_nccl_tests_formula():
    # 1 GB all-reduce in 10 ms on 8 ranks: algbw 100 GB/s, busbw 100 * 2 * 7 / 8 = 175 GB/s
    assert busbw("all_reduce", 8, 1e9, 0.01) == pytest.approx(175e9)
    assert busbw("ring_all_reduce", 8, 1e9, 0.01) == pytest.approx(175e9)
    assert busbw("recursive_doubling_all_reduce", 8, 1e9, 0.01) == pytest.approx(175e9)
    assert busbw("all_gather", 4, 1e9, 0.01) == pytest.approx(75e9)  # (p-1)/p
    assert busbw("reduce_scatter", 2, 1e9, 0.01) == pytest.approx(50e9)
    assert busbw("all_to_all", 8, 1e9, 0.01) == pytest.approx(87.5e9)  # nccl-tests' alltoall: (p-1)/p


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("p", [2, 3, 8])
def test_fit_recovers_exact_alpha_beta(op, p):
    truth = AlphaBeta(op, p, alpha=25e-6, beta=40e9)  # 25 us per message, 40 GB/s
    times = [truth.predict(n) for n in SIZES]
    fit = fit_alpha_beta(op, p, SIZES, times)
    assert fit.alpha == pytest.approx(25e-6, rel=1e-9) and fit.beta == pytest.approx(40e9, rel=1e-9)
    a, b = terms(op, p)
    assert fit.predict(1 << 20) == pytest.approx(a * 25e-6 + b * (1 << 20) / 40e9, rel=1e-9)


def test_fit_with_noise_stays_close():
    # 5% multiplicative noise on every time (seeded): the relative-error fit keeps both within 10%
    rng = random.Random(0)
    truth = AlphaBeta("ring_all_reduce", 4, alpha=50e-6, beta=10e9)
    times = [truth.predict(n) * (1 + rng.uniform(-0.05, 0.05)) for n in SIZES]
    fit = fit_alpha_beta("ring_all_reduce", 4, SIZES, times)
    assert fit.alpha == pytest.approx(50e-6, rel=0.1) and fit.beta == pytest.approx(10e9, rel=0.1)


def test_fit_keeps_terms_non_negative():
    # a flat curve (pure latency, with time falling slightly as size grows) would give a negative
    # 1/beta in free least squares: the fit drops the bandwidth term instead
    times = [1e-3 * (1 - 0.001 * i) for i in range(len(SIZES[:4]))]
    fit = fit_alpha_beta("all_reduce", 2, SIZES[:4], times)
    assert fit.alpha > 0 and math.isinf(fit.beta)
    assert fit.predict(SIZES[0]) == pytest.approx(1e-3, rel=0.01)


def test_fit_rejects_bad_input():
    with pytest.raises(KilnError, match="two or more"):
        fit_alpha_beta("all_reduce", 2, [1024], [1e-3])
    with pytest.raises(KilnError, match="two different"):
        fit_alpha_beta("all_reduce", 2, [1024, 1024], [1e-3, 2e-3])
    with pytest.raises(KilnError, match="positive"):
        fit_alpha_beta("all_reduce", 2, [1024, 4096], [1e-3, 0.0])


def test_summarize_adds_busbw_and_model():
    truth = AlphaBeta("ring_all_reduce", 2, alpha=1e-4, beta=1e9)
    rows = [{"op": "ring_all_reduce", "p": 2, "bytes": n, "iters": 2, "seconds": truth.predict(n)}
            for n in sizes_between(1024, 1 << 20)]  # fmt: skip
    rows, fits = summarize(rows)
    assert fits == [
        {"op": "ring_all_reduce", "p": 2, "alpha_us": pytest.approx(100), "beta_GBps": pytest.approx(1)}
    ]
    for r in rows:
        assert r["model_err"] == pytest.approx(0, abs=1e-9)
        assert r["busbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)  # 2(p-1)/p = 1 at p = 2
    with pytest.raises(KilnError, match="message sizes"):
        sizes_between(0, 10)
