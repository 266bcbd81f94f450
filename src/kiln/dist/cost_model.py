"""The alpha-beta cost model of collectives, nccl-tests' bus bandwidth, and the model's fit to measurements.

A collective of n bytes on p ranks costs T = a(p) * alpha + b(p) * n / beta: alpha the latency of one
message (seconds), beta the link bandwidth (bytes/s), a and b how many messages and what fraction of n
each rank sends on its critical path:

    ring all-reduce          a = 2 (p - 1)             b = 2 (p - 1) / p
    ring reduce-scatter      a = p - 1                 b = (p - 1) / p       (n: the whole input)
    ring all-gather          a = p - 1                 b = (p - 1) / p       (n: the whole output)
    pairwise all-to-all      a = p - 1                 b = (p - 1) / p       (n: what one rank sends)
    recursive doubling       a = log2 q + 2 [q < p]    b = the same          (q: largest power of two <= p)

Bus bandwidth (nccl-tests, doc/PERFORMANCE.md): algbw = n / T, busbw = algbw * b(p) for the ring
algorithms, the figure that compares with the link speed whatever p is (all-reduce 2 (p - 1) / p,
reduce-scatter, all-gather and all-to-all (p - 1) / p: of the n bytes a rank sends in an all-to-all,
n / p stay with it).

The fit: least squares of the relative error, sum_i ((a alpha + b n_i / beta - T_i) / T_i)^2, over
alpha and 1 / beta, both kept >= 0. Relative, not absolute, because the sizes span 1 KB .. 1 GB: absolute
residuals would let the largest message decide everything and leave alpha to its noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kiln.errors import KilnError

OPS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "ring_all_reduce",
    "recursive_doubling_all_reduce",
)


def terms(op: str, p: int) -> tuple[float, float]:
    """(a, b) of T = a alpha + b n / beta for `op` on p ranks. The library's all_reduce is modelled as a
    ring (NCCL's algorithm for large messages, and gloo's default ring on CPU)."""
    if p < 1:
        raise KilnError(f"a collective needs at least one rank, got p={p}")
    if op in ("all_reduce", "ring_all_reduce"):
        return 2.0 * (p - 1), 2.0 * (p - 1) / p
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return float(p - 1), (p - 1) / p
    if op == "recursive_doubling_all_reduce":
        q = 1 << (p.bit_length() - 1)
        rounds = math.log2(q) + (2 if q < p else 0)  # the fold in and the result back out
        return rounds, rounds
    raise KilnError(f"unknown collective {op!r}: choose one of {', '.join(OPS)}")


def busbw(op: str, p: int, nbytes: float, seconds: float) -> float:
    """nccl-tests' bus bandwidth in bytes/s: algbw = nbytes / seconds times the ring's factor
    (2 (p-1)/p for all-reduce, (p-1)/p for reduce-scatter, all-gather and all-to-all; kiln's recursive doubling is
    reported with the all-reduce factor, so that its figure compares with the others')."""
    if seconds <= 0:
        raise KilnError(f"busbw needs a positive time, got {seconds}")
    factor = terms("all_reduce" if op.endswith("all_reduce") else op, p)[1]
    return nbytes / seconds * factor


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted model: alpha in seconds per message, beta in bytes/s (inf when the fit found no
    bandwidth term, i.e. every time is latency)."""

    op: str
    p: int
    alpha: float
    beta: float

    def predict(self, nbytes: float) -> float:
        a, b = terms(self.op, self.p)
        return a * self.alpha + (b * nbytes / self.beta if math.isfinite(self.beta) else 0.0)


def _solve(rows: Sequence[tuple[float, float]], free: tuple[bool, bool]) -> tuple[float, float]:
    """Least squares of rows (x1, x2) . (u, v) = 1 with the unknowns not `free` fixed at 0."""
    s11 = sum(x1 * x1 for x1, _ in rows)
    s22 = sum(x2 * x2 for _, x2 in rows)
    s12 = sum(x1 * x2 for x1, x2 in rows)
    t1, t2 = sum(x1 for x1, _ in rows), sum(x2 for _, x2 in rows)
    if free == (True, True):
        det = s11 * s22 - s12 * s12
        if det <= 1e-12 * s11 * s22:
            return math.nan, math.nan
        return (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
    if free == (True, False):
        return t1 / s11, 0.0
    return 0.0, t2 / s22


def fit_alpha_beta(op: str, p: int, nbytes: Sequence[float], seconds: Sequence[float]) -> AlphaBeta:
    """Fit alpha and beta of `op` on p ranks to measured times (seconds) of messages of nbytes."""
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise KilnError(f"the alpha-beta fit needs two or more (size, time) pairs, got {len(nbytes)}")
    if len(set(nbytes)) < 2:
        raise KilnError("the alpha-beta fit needs at least two different message sizes")
    if min(seconds) <= 0:
        raise KilnError("the alpha-beta fit needs positive times")
    a, b = terms(op, p)
    if a == 0:  # one rank: nothing moves, nothing to fit
        return AlphaBeta(op, p, 0.0, math.inf)
    # unknowns u = alpha, v = 1 / beta; each row divided by its own time (relative residuals)
    rows = [(a / t, b * n / t) for n, t in zip(nbytes, seconds)]

    def loss(u: float, v: float) -> float:
        return sum((x1 * u + x2 * v - 1.0) ** 2 for x1, x2 in rows)

    u, v = _solve(rows, (True, True))
    if not (u >= 0 and v >= 0):  # a negative term (noise on a flat curve): the better one-term fit
        candidates = [_solve(rows, (True, False)), _solve(rows, (False, True))]
        u, v = min(candidates, key=lambda c: loss(*c))
    return AlphaBeta(op, p, u, 1.0 / v if v > 0 else math.inf)
