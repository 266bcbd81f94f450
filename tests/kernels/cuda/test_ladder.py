"""The SGEMM ladder's registry agrees with the C launcher (csrc/sgemm.cu), and steps resolve by name."""

import re

import pytest

from kiln.errors import KilnError
from kiln.kernels.cuda.build import CSRC
from kiln.kernels.cuda.ladder import SGEMM_LADDER, step_index


def test_names_are_unique_and_ordered_like_the_launcher():
    names = [s.name for s in SGEMM_LADDER]
    assert len(set(names)) == len(names) == 7
    src = (CSRC / "sgemm.cu").read_text()
    assert re.search(r"kiln_sgemm_steps\(void\) \{ return (\d+); \}", src).group(1) == str(len(names))
    cases = [int(c) for c in re.findall(r"case (\d+):", src)]
    assert cases == list(range(len(names)))
    # each case launches the kernel of the step of that index (the names match the C templates)
    bodies = re.split(r"case \d+:", src.split("switch (step)")[1])[1:]
    for step, body in zip(SGEMM_LADDER, bodies):
        assert re.search(rf"\b{step.name}\b", body), f"case for {step.name} launches something else"


def test_step_index():
    assert step_index("naive") == 0 and step_index("warptiled") == 6 and step_index(3) == 3
    for bad in ("fast", 7, -1, True, 2.0):
        with pytest.raises(KilnError, match="naive, coalesced"):
            step_index(bad)
