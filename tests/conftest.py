"""Test set-up shared by every area.

On a machine without CUDA, Triton kernels run through Triton's CPU interpreter; the variable must be
set before triton is first imported, which is why it is set here, at collection time.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """The device a test runs its kernels on: CUDA when present, else the CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
