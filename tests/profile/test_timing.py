"""kiln.profile.timing's graph helpers off CUDA: the calls run once (what a smoke run checks) and no figure
is made up; on CUDA they are exercised by the decode sweeps (bench/experiments)."""

from __future__ import annotations

from kiln.profile.timing import capture_graph, flushed_graph_ms


def test_graph_helpers_off_cuda():
    ran = []
    assert capture_graph([lambda: ran.append(1), lambda: ran.append(2)], cuda=False) is None
    assert ran == [1, 2]
    assert flushed_graph_ms({"a": None, "b": None}, rounds=3, reps=2, cuda=False) == {"a": None, "b": None}
