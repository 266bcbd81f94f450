import pytest
import torch

from kiln.kernels import dispatch
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_ref


def test_default_is_auto_and_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("KILN_KERNELS", raising=False)
    assert dispatch.backend() == "auto"
    assert dispatch.use_triton(torch.zeros(1)) is False


def test_env_and_context_override(monkeypatch):
    monkeypatch.setenv("KILN_KERNELS", "reference")
    assert dispatch.backend() == "reference"
    with dispatch.use_backend("triton"):
        assert dispatch.backend() == "triton"
        with dispatch.use_backend("auto"):
            assert dispatch.backend() == "auto"
        assert dispatch.backend() == "triton"
    assert dispatch.backend() == "reference"


def test_unknown_backend_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with dispatch.use_backend("cuda"):
            pass
    monkeypatch.setenv("KILN_KERNELS", "fast")
    with pytest.raises(ValueError, match="unknown kernel backend 'fast'"):
        dispatch.backend()


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with dispatch.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.use_triton(torch.zeros(1))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tests_can_force_either_path(backend):
    # conftest sets TRITON_INTERPRET=1 on CPU machines, so "triton" runs the kernel through the interpreter
    x, w = torch.randn(3, 40), torch.randn(40)
    with dispatch.use_backend(backend):
        y = rmsnorm(x, w, 1e-6)
    torch.testing.assert_close(y, rmsnorm_ref(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_the_switch_does_not_break_torch_compile_graphs():
    x, w = torch.randn(4, 8), torch.randn(8)
    explained = torch._dynamo.explain(lambda a, b: rmsnorm(a, b, 1e-6) * 2)(x, w)
    assert explained.graph_break_count == 0
