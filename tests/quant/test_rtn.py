"""Round-to-nearest quantization: schemes by name, the round trip's error bound per format, scales exact in
bfloat16, and the hand-worked symmetric/asymmetric int4 cases."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.kernels.fp8_matmul import FP8
from kiln.kernels.quant_matmul import dequantize_weight, unpack_int4
from kiln.quant import QuantScheme
from kiln.quant.rtn import quantize_weight


def test_scheme_names_and_errors():
    assert QuantScheme.parse("int4-g64") == QuantScheme("int4", 64)
    assert QuantScheme.parse("int4").group_size == 128 and QuantScheme.parse("int8").name == "int8"
    s = QuantScheme.parse("int4-g32", asymmetric=True, method="gptq", act_order=True)
    assert QuantScheme.from_dict(s.to_dict()) == s
    for bad, match in [
        ("int4-g48", "group size"),
        ("int3", "unknown quantization scheme"),
        ("fp4", "unknown quantization scheme"),
    ]:
        with pytest.raises(KilnError, match=match):
            QuantScheme.parse(bad)
    with pytest.raises(KilnError, match="GPTQ is for the integer schemes"):
        QuantScheme.parse("fp8", method="gptq")
    with pytest.raises(KilnError, match="act-order is a GPTQ option"):
        QuantScheme.parse("int4", act_order=True)
    with pytest.raises(KilnError, match="no groups or zero points"):
        QuantScheme.parse("int8", asymmetric=True)
    with pytest.raises(KilnError, match="unknown quantization config keys"):
        QuantScheme.from_dict({"kind": "int8", "bits": 8})


def test_int4_by_hand():
    # one group of 32: extremes -1.6 (negative: q - 8 = -8, s = 0.2 -> bf16 0.2002) and 1.0 (7 steps cover it)
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([-1.6, 1.0, 0.4, 0.0])
    res = quantize_weight(w, "int4", 32)
    assert (
        res["scales"].dtype == torch.bfloat16 and res["scales"].item() == torch.tensor(0.2).bfloat16().item()
    )
    assert unpack_int4(res["qweight"])[0, :4].tolist() == [0, 13, 10, 8]
    res = quantize_weight(w, "int4", 32, asymmetric=True)  # s = 2.6 / 15, z = round(1.6 / s) = 9
    assert res["zeros"].item() == 9
    back = dequantize_weight(res["qweight"], res["scales"], res["zeros"], 4, 32)
    assert back[0, 3] == 0.0  # zero is exactly representable with a zero point


@pytest.mark.parametrize(
    "kind,group,asym", [("int8", 0, False), ("int4", 32, False), ("int4", 128, True), ("fp8", 0, False)]
)
def test_round_trip_error_bound(kind, group, asym):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * torch.logspace(-3, 0, 48)[:, None]  # rows of very different sizes
    res = quantize_weight(w, kind, group, asym)
    s = res["scales"]
    assert torch.equal(s, s.float().to(torch.bfloat16).float().to(s.dtype))  # bf16-exact
    if kind == "fp8":
        assert res["qweight"].dtype == FP8
        back = res["qweight"].float() * s.float()
        assert bool(((back - w).abs() <= w.abs() * 2**-4 + 2**-10 * s.float()).all())  # 3 mantissa bits
        return
    back = dequantize_weight(res["qweight"], s, res["zeros"], 4 if kind == "int4" else 8, group)
    per_elem = s.float().repeat_interleave(group or 256, dim=1)
    # half a step, except where the grid stops short of an extreme (int4: 7 steps up, 8 down; a zero point
    # rounded): a whole step at most
    assert bool(((back - w).abs() <= per_elem * (0.5 if kind == "int8" else 1.0) * 1.01).all())
    rel = float((back - w).norm() / w.norm())
    assert rel < (0.01 if kind == "int8" else 0.12)
