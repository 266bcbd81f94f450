"""Names for the profiler: a torch.profiler range around every module's forward, installed only while
profiling, so the model's code carries no profiling calls.

    with module_scopes(model):        # "kiln/model.layers.3.self_attn.qkv_proj", ...
        engine.step()

A forward pre-hook enters `torch.profiler.record_function("kiln/<qualified name>")` and a forward hook
(always_call: it runs even when the forward raises) leaves it; the hooks are removed on exit. The ranges
are host-side events only: nothing is launched on the GPU, and a CUDA-graph replay runs none of them
(graphs are attributed by alignment with a named eager step, kiln.profile.attribution). Outside the
`with` block the model has no hooks at all: nothing to cost, nothing for CUDA-graph capture or
torch.compile to trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SCOPE_PREFIX = "kiln/"


@contextlib.contextmanager
def module_scopes(model: torch.nn.Module, prefix: str = SCOPE_PREFIX) -> Iterator[None]:
    """Every submodule's forward (the root's excluded) inside a profiler range named prefix + its name."""
    open_ranges: list[torch.profiler.record_function] = []  # this context's own stack of open ranges
    handles = []

    def enter(label: str):
        def hook(module, args):
            r = torch.profiler.record_function(label)
            r.__enter__()
            open_ranges.append(r)

        hook.kiln_observer = True  # only watches: the model's fused paths stay on (kiln.model.linear.hooked)
        return hook

    def leave(module, args, output):
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    leave.kiln_observer = True

    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(enter(prefix + name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ranges:
            open_ranges.pop().__exit__(None, None, None)
