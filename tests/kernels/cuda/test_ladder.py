"""The SGEMM ladder's registry agrees with the C launcher (csrc/sgemm.cu), and steps resolve by name."""

import re

import pytest

from kiln.errors import KilnError
from kiln.kernels.cuda.build import CSRC
from kiln.kernels.cuda.ladder import SGEMM_LADDER, WARPTILE_CONFIGS, step_index


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


def test_warptile_configs_match_the_launcher_and_the_first_is_step_6():
    src = (CSRC / "sgemm.cu").read_text()
    rows = re.findall(r"X\((\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", src)
    assert [int(r[0]) for r in rows] == list(range(len(WARPTILE_CONFIGS)))
    for r, cfg in zip(rows, WARPTILE_CONFIGS):
        assert tuple(int(v) for v in r[1:]) == (
            cfg.bm,
            cfg.bn,
            cfg.bk,
            cfg.wm,
            cfg.wn,
            cfg.wniter,
            cfg.tm,
            cfg.tn,
            cfg.threads,
        )
    assert re.search(r"kiln_sgemm_warptile_configs\(void\) \{ return (\d+); \}", src).group(1) == str(
        len(rows)
    )
    step6 = src.split("case 6:")[1].split("break;")[0]
    c0 = WARPTILE_CONFIGS[0]
    assert (
        f"warptiled<{c0.bm}, {c0.bn}, {c0.bk}, {c0.wm}, {c0.wn}, {c0.wniter}, {c0.tm}, {c0.tn}, {c0.threads}>"
        in step6
    )
    # the same constraints the kernel's static_asserts enforce, so a new row fails here before nvcc
    for cfg in WARPTILE_CONFIGS:
        warps = cfg.threads // 32
        assert (cfg.bn // cfg.wn) * (cfg.bm // cfg.wm) == warps
        wmiter = (cfg.wm * cfg.wn) // (32 * cfg.tm * cfg.tn * cfg.wniter)
        assert wmiter >= 1 and wmiter * 32 * cfg.tm * cfg.tn * cfg.wniter == cfg.wm * cfg.wn
        assert cfg.name
