"""Attributing one step's time, from a torch.profiler Chrome trace, to layers and ops.

Input: the trace's events (`load_trace`), a step range (a record_function named `STEP`, around one
engine step, on the host), and the module ranges of kiln.profile.naming ("kiln/model.layers.3.mlp...").

GPU (`gpu_rows`): the step is [its host range's start, the later of its end and the last GPU activity's
end]. Its GPU activities are the kernels, memcpys and memsets that lie inside that window (the engine step
ends with a device-to-host copy, a sync, so all of its work lies inside). Each activity is named by the
innermost module range, on the launching thread, that contains its launch call (the runtime or driver
event with the same correlation id). A CUDA-graph replay has one launch for all of its kernels, so its
kernels are named by `align`: the replay's kernels in time order against the kernels, in order, of one
eager run of the same captured function (same batch bucket) under the module ranges. The two lists are
the same kernels in the same order when the capture is the eager step; when they differ, the longest
matching subsequences (difflib) are named and the rest stay unnamed (counted in `unattributed`).
The rows are the activities, then three rows that are not kernels:
    host before first GPU work   step start -> first GPU activity (scheduling, inputs, launch latency)
    idle gaps between GPU work   the sum of gaps between consecutive activities (in an eager step the
                                 GPU waits for the host's launches: this is launch overhead)
    host after last GPU work     last activity's end -> step end (sync, sampling, bookkeeping)
Each activity's time ("us") is the part of it after every earlier activity has ended (its full
duration is "dur_us"): with programmatic dependent launch (kiln's kernels on sm_90) a kernel starts
while its predecessor finishes and waits for it, and that overlap is counted once, for the predecessor.
So the activities and the three rows partition the step exactly.

CPU (`cpu_rows`): each module range's exclusive time (its duration less its child module ranges'), and
the step's time outside every module range; they sum to the step's duration exactly.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kiln.profile.naming import SCOPE_PREFIX

STEP = "kiln.profile.step"
REFERENCE = "kiln.profile.reference"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

# kernel (or aten op) name -> op, first match wins; names from kiln's Triton kernels, cuBLAS and aten
KERNEL_OPS = [
    # the one-token q/k/v projection with RoPE and the K/V write in its epilogue (kiln.kernels.rope.qkv_rope):
    # launched from the attention's range, it is the q/k/v projection's kernel (its weight is what it reads)
    (r"qkv_rope", "qkv_proj"),
    (r"rope", "rope"),
    (r"paged_kv|kv_write|reshape_and_cache", "kv_write"),
    (r"decode_split|decode_reduce|decode_attention|attn|flash|fmha", "attention"),
    (r"swiglu|silu", "swiglu"),
    (r"rmsnorm|rms_norm|layernorm|layer_norm", "norm"),
    (r"argmax|ArgMax", "argmax"),
    (
        r"gemm|gemv|nvjet|cutlass|xmma|matmul|_dot_kernel|_split_sum|cublas|wq_decode|wq_tile|fp8_tile",
        "matmul",
    ),
    (r"sample|exponential|distribution|topk|sort|softmax", "sampling"),
    (r"embedding|index_select|indexSelect|gather", "index"),
    (r"copy|elementwise|fill", "elementwise"),
]
LINEAR_LEAVES = re.compile(r"(_proj|lm_head|c_attn|c_fc|c_proj)$")


def classify(name: str) -> str:
    for pattern, op in KERNEL_OPS:
        if re.search(pattern, name):
            return op
    return "other"


def scope_layer_op(scope: str | None, kernel: str = "", cat: str = "kernel") -> tuple[str, str]:
    """(layer, op) of a kernel from its module range (without the prefix) and its own name.
    layer: "layer.N", "embed", "final" (the last norm), "head" (after the decoder), or "-".
    op: the linear's name for a linear's kernels (qkv_proj, ...), "norm", "embed", else by kernel name."""
    if cat == "gpu_memcpy":
        kind = re.search(r"HtoD|DtoH|DtoD", kernel)
        return "io", f"memcpy {kind.group(0) if kind else ''}".strip()
    if cat == "gpu_memset":
        return "io", "memset"
    if scope is None:
        op = classify(kernel)
        return "head", "lm_head" if op == "matmul" else op
    m = re.search(r"layers\.(\d+)", scope)
    leaf = scope.rsplit(".", 1)[-1]
    if m:
        layer = f"layer.{m.group(1)}"
    elif "embed" in scope:
        layer = "embed"
    elif leaf == "norm":
        layer = "final"
    else:
        layer = "-"
    if LINEAR_LEAVES.search(leaf):
        return layer, leaf
    if leaf.endswith("norm"):
        return layer, "norm"
    if "embed" in leaf:
        return layer, "embed"
    if leaf.isdigit():
        return layer, "block"
    if leaf == "mlp" and re.search(r"_gemv_kernel|_dot_kernel", kernel):
        # a decode matmul launched by the gated MLP itself: gate_up with the SwiGLU in its epilogue
        # (MergedLinear.swiglu_decode; down_proj runs in its own range)
        return layer, "gate_up_proj"
    return layer, classify(kernel) if kernel else leaf


def load_trace(path: str | Path) -> list[dict]:
    with open(path) as f:
        doc = json.load(f)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _is_host_range(e: dict) -> bool:
    # record_function ranges on the host; the trace also projects them onto the GPU timeline
    # ("gpu_user_annotation", at GPU times), which must not be taken for host ranges
    return e.get("ph") == "X" and e.get("cat") == "user_annotation"


def ranges(events: list[dict], name: str) -> list[dict]:
    """The host ranges (record_function) called `name`, in time order."""
    return sorted((e for e in events if _is_host_range(e) and e.get("name") == name), key=lambda e: e["ts"])


@dataclass
class Activity:
    """One GPU kernel / memcpy / memset: times in us; scope the module range (no prefix) or None."""

    name: str
    cat: str
    ts: float
    dur: float
    corr: int | None = None
    scope: str | None = None
    named: bool = False  # whether a module range or an alignment named it
    extra: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + self.dur


def gpu_activities(events: list[dict], t0: float, t1: float) -> list[Activity]:
    """The GPU activities inside [t0, t1], in time order."""
    acts = [
        Activity(
            e["name"],
            e["cat"],
            float(e["ts"]),
            float(e.get("dur", 0)),
            (e.get("args") or {}).get("correlation"),
        )
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in GPU_CATS
        and t0 <= e["ts"]
        and e["ts"] + e.get("dur", 0) <= t1
    ]
    return sorted(acts, key=lambda a: a.ts)


def _scopes(events: list[dict], prefix: str) -> list[tuple[float, float, str]]:
    """Every module range on the host (any thread: the engine launches from one)."""
    return [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
        for e in events
        if _is_host_range(e) and str(e.get("name", "")).startswith(prefix)
    ]


def _innermost(scopes: list[tuple[float, float, str]], t: float) -> str | None:
    best = None
    for a, b, name in scopes:
        if a <= t <= b and (best is None or b - a < best[1] - best[0]):
            best = (a, b, name)
    return best[2] if best else None


def name_by_launch(events: list[dict], acts: list[Activity], prefix: str = SCOPE_PREFIX) -> None:
    """Set each activity's scope from the innermost module range around its launch call."""
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = e
    scopes = _scopes(events, prefix)
    for a in acts:
        launch = launches.get(a.corr)
        if launch is None:
            continue
        scope = _innermost(scopes, float(launch["ts"]))
        a.scope = scope[len(prefix) :] if scope else None
        a.named = True


def align(step: list[Activity], reference: list[Activity]) -> dict:
    """Copy scopes from the named reference kernels to the step's kernels (see the module doc).
    Returns {"identical": whether the kernel name lists were equal, "matched": kernels named}."""
    sk = [a for a in step if a.cat == "kernel"]
    rk = [a for a in reference if a.cat == "kernel"]
    sn, rn = [a.name for a in sk], [a.name for a in rk]
    if sn == rn:
        pairs = list(zip(sk, rk))
    else:
        sm = difflib.SequenceMatcher(a=sn, b=rn, autojunk=False)
        pairs = [(sk[blk.a + i], rk[blk.b + i]) for blk in sm.get_matching_blocks() for i in range(blk.size)]
    for s, r in pairs:
        s.scope, s.named = r.scope, r.named
    return {
        "identical": sn == rn,
        "matched": len(pairs),
        "step_kernels": len(sk),
        "reference_kernels": len(rk),
    }


def gpu_rows(acts: list[Activity], t0: float, t1: float) -> tuple[list[dict], list[dict]]:
    """(activity rows, the three host/idle rows) of one step window [t0, t1] (us)."""
    rows = []
    busy_until = t0
    gaps = 0.0
    for i, a in enumerate(acts):
        layer, op = scope_layer_op(a.scope, a.name, a.cat)
        if a.cat == "kernel" and not a.named:
            layer, op = "?", f"unattributed ({classify(a.name)})"
        # a kernel launched early (programmatic dependent launch) overlaps its predecessor, waiting for
        # it: the step's time is counted once, each kernel taking the time after the previous ones end
        excl = max(0.0, a.end - max(a.ts, busy_until))
        if i:
            gaps += max(0.0, a.ts - busy_until)
        busy_until = max(busy_until, a.end)
        rows.append({"idx": i, "kernel": a.name, "cat": a.cat, "scope": a.scope, "layer": layer, "op": op,
                     "start_us": round(a.ts - t0, 3), "us": excl, "dur_us": round(a.dur, 3)})  # fmt: skip
    first = acts[0].ts if acts else t1
    last = max((a.end for a in acts), default=t0)
    other = [
        {"layer": "host", "op": "host before first GPU work", "us": first - t0},
        {"layer": "gpu", "op": "idle gaps between GPU work", "us": gaps},
        {"layer": "host", "op": "host after last GPU work", "us": max(0.0, t1 - last)},
    ]
    return rows, other


def cpu_rows(events: list[dict], step: dict, prefix: str = SCOPE_PREFIX) -> tuple[list[dict], list[dict]]:
    """(one row per module range: its exclusive time, [the step's time outside every range])."""
    t0, t1, tid = float(step["ts"]), float(step["ts"]) + float(step["dur"]), step.get("tid")
    scopes = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"][len(prefix) :])
        for e in events
        if _is_host_range(e) and str(e.get("name", "")).startswith(prefix) and e.get("tid") == tid
        and t0 <= e["ts"] and e["ts"] + e["dur"] <= t1
    )  # fmt: skip
    rows, stack, top = [], [], 0.0  # stack: indices of open ranges (nested intervals)
    for a, b, name in scopes:
        while stack and rows[stack[-1]]["_end"] <= a:
            stack.pop()
        layer, op = scope_layer_op(name)
        rows.append({"idx": len(rows), "kernel": name, "cat": "cpu", "scope": name, "layer": layer, "op": op,
                     "start_us": round(a - t0, 3), "us": b - a, "_end": b})  # fmt: skip
        if stack:
            rows[stack[-1]]["us"] -= b - a  # exclusive time: the parent loses its child's
        else:
            top += b - a
        stack.append(len(rows) - 1)
    for r in rows:
        del r["_end"]
    return rows, [{"layer": "host", "op": "host outside module ranges", "us": t1 - t0 - top}]
