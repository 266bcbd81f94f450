"""The engine side of the server: the one loop that owns an LLMEngine (which is not thread-safe), whatever
carries its commands and outputs. It runs in a thread of the server's process (worker.ThreadWorker: tests,
`Server(engine, config)`) or in a child process of its own (engine_process.ProcessWorker: `kiln serve`).

Commands (tuples, picklable: the process transport sends them through a pipe), from the HTTP side:
    ("add", [(key, prompts, params), ...], sent)   the requests the HTTP side submitted in one tick of
                                    its event loop; add_request for each prompt of each (all or none per
                                    key); key: the handle's int id; sent: time.monotonic() when the command
                                    left the HTTP side (optional; the clock is system-wide on Linux, so the
                                    engine process can time the command's crossing)
    ("abort", key)                  engine.abort of the handle's prompts: their KV blocks are freed at once
    ("abort_all",)                  every request (shutdown's deadline)
    ("stop",)                       abort what is left, step it out, return
Events, to the sink (worker.EngineWorker on the HTTP side, or the child's delta sender):
    intake(results, steps, timing)  once per intake (the adds taken before one step): results [(key,
                            prompt tokens, None) accepted | (key, 0, message) rejected], one per add; steps:
                            the engine steps run before this intake; timing: (command_s, intake_s), the
                            longest time one of its add commands took from leaving the HTTP side to being
                            taken here (None when no command was stamped), and the time from taking the
                            first of them to this reply (admission's stages: worker.py)
    step(items, gauges)     items: [(key, prompt index, RequestOutput)] of one step (cumulative outputs);
                            with live=True, the finished requests' RequestOutputs, then every unfinished
                            request's own engine state (key, prompt index, LLMEngine.requests[id]), which
                            the sink reads before the next step (the engine then builds no per-step copies);
                            gauges: (running, waiting, KV blocks used, steps run, step seconds), after every
                            pass; step seconds: a tuple with the wall time of the step just run (eng.step,
                            host and device), empty when none ran
    crashed(message)        the engine raised: the loop ends
The request id of prompt i of handle `key` is f"{key}-{i}".

Intake (why the engine sees a burst of requests at once, as offline generation adds them): before each step
the loop takes every command already queued, so a step schedules every request that arrived while the last
one ran. When the engine is idle, the first command may be the head of a burst (hundreds of clients sending
at once, parsed by the HTTP side one after another): the loop then keeps taking commands while they arrive
less than BURST_GAP_S apart, for at most BURST_MAX_S, before its first step. A lone request pays one gap
(2 ms, against a prefill step and the HTTP round trip); the first request of a burst pays at most
BURST_MAX_S, and the first step then schedules the whole burst (up to the step's token budget) instead of one
prompt, followed by steps that each admit the few that arrived meanwhile.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

from kiln.errors import KilnError
from kiln.infer.engine import LLMEngine
from kiln.kernels.compile_watch import CompileWatch

BURST_GAP_S = 0.002  # an idle engine's first intake ends when no command came for this long
BURST_MAX_S = 0.02  # ... or after this long in all
SLOW_STEP_S = 0.5  # a step this long is logged with what it ran (a burst waits behind it: docs/serve.md)


def slow_step_line(n: int, took: float, engine: LLMEngine, compiles: str = "") -> str:
    """One log line for an engine step of `took` seconds: what the step scheduled (with async scheduling,
    the batch it launched while it finished the previous one), where its host time went (scheduling,
    launching, waiting for the step before it + postprocessing) and the Triton compiles it ran
    (`compiles`, CompileWatch.describe), so that a server log tells a step that compiled or autotuned
    kernels for a new shape from one that had much work or waited on the GPU."""
    b = engine.last_batch
    if b is None:
        what = "nothing scheduled"
    else:
        prefill = [n for n in b.num_new_tokens if n > 1]
        what = (
            f"{len(b.seqs)} sequences, {b.num_tokens} tokens ({len(b.num_new_tokens) - len(prefill)} decode rows, "
            f"{len(prefill)} prefill chunks of {sum(prefill)} tokens, longest {max(prefill, default=0)}), "
            f"{'decode only' if b.is_decode_only else 'mixed/prefill'}, {len(b.preempted)} preempted"
        )
    if engine.last_step_s is not None:
        what += "; host s: schedule {:.3f}, launch {:.3f}, wait+post {:.3f}".format(*engine.last_step_s)
    if compiles:
        what += f"; {compiles}"
    return f"kiln serve: slow engine step {n}: {took:.2f} s; {what}"


class EngineLoop:
    """run(get): take the commands `get(timeout)` returns (timeout None: block; 0: only what is queued;
    raises queue.Empty when none came) before each step, step while work exists, block when idle; report
    to `sink` (module docstring)."""

    def __init__(
        self,
        engine: LLMEngine,
        sink,
        live: bool = False,
        log: Callable[[str], None] | None = None,
        compiles: CompileWatch | None = None,
    ):
        self.engine, self.sink, self.live, self.log = engine, sink, live, log
        self.compiles = compiles  # installed by the caller: the slow-step lines name the step's compiles
        self._owner: dict[str, tuple[int, int]] = {}  # engine request id -> (handle key, prompt index)
        self._rids: dict[int, list[str]] = {}  # handle key -> its live request ids
        self.steps = 0  # engine steps run

    def run(self, get: Callable[[float | None], tuple]) -> None:
        eng = self.engine
        try:
            while True:
                if self._intake(get, idle=not eng.has_unfinished() and not eng.requests):
                    return
                # a step also hands back requests that an abort finished (and drops them from the engine)
                if eng.has_unfinished() or eng.requests:
                    self._step()
                else:
                    self.sink.step([], self._gauges(()))
        except BaseException as e:  # noqa: BLE001 - a crash: the sink fails every waiting request (500)
            self.sink.crashed(f"{type(e).__name__}: {e}")

    def _intake(self, get: Callable[[float | None], tuple], idle: bool) -> bool:
        """Take the queued commands (idle: block for the first, then the burst rule); True: "stop"."""
        eng = self.engine
        results: list[tuple[int, int, str | None]] = []
        timeout: float | None = None if idle else 0.0
        deadline = None
        first = None  # when the first command of this intake was taken
        crossing = None  # the longest time an add command took to get here from the HTTP side
        while True:
            try:
                cmd = get(timeout)
            except queue.Empty:
                break
            taken = time.monotonic()
            first = taken if first is None else first
            if idle:  # the head of a possible burst: wait for its tail a little (module docstring)
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + BURST_MAX_S
                timeout = max(0.0, min(BURST_GAP_S, deadline - now))
            else:
                timeout = 0.0
            kind = cmd[0]
            if kind == "add":
                if len(cmd) > 2 and cmd[2] is not None:
                    crossing = max(crossing or 0.0, taken - cmd[2])
                for key, prompts, params in cmd[1]:
                    results.append(self._add(key, prompts, params))
            elif kind == "abort":
                for rid in self._rids.get(cmd[1], ()):
                    eng.abort(rid)
            elif kind == "abort_all":
                for rid in list(self._owner):
                    eng.abort(rid)
            elif kind == "stop":
                if results:
                    self.sink.intake(results, self.steps, (crossing, time.monotonic() - first))
                for rid in list(self._owner):
                    eng.abort(rid)
                while eng.has_unfinished() or eng.requests:  # the aborted, one last time
                    self._step()
                self.sink.step([], self._gauges(()))
                return True
            else:
                raise KilnError(f"unknown engine command {kind!r}")
        if results:  # one reply for the whole intake: the HTTP side wakes once, not once per request
            self.sink.intake(results, self.steps, (crossing, time.monotonic() - first))
        return False

    def _add(self, key: int, prompts: list, params) -> tuple[int, int, str | None]:
        eng, rids = self.engine, []
        try:
            for i, p in enumerate(prompts):
                rids.append(eng.add_request(p, params, request_id=f"{key}-{i}"))
        except KilnError as e:  # all or none: take back the prompts already added
            for rid in rids:
                eng.abort(rid)
            return key, 0, str(e)
        for i, rid in enumerate(rids):
            self._owner[rid] = (key, i)
        self._rids[key] = rids
        return key, sum(len(eng.requests[rid].prompt_ids) for rid in rids), None

    def _step(self) -> None:
        items = []
        eng = self.engine
        t = time.monotonic()
        mark = self.compiles.mark() if self.compiles is not None else 0
        outs = eng.step(finished_only=True) if self.live else eng.step()
        took = time.monotonic() - t
        if took > SLOW_STEP_S and self.log is not None:
            compiled = CompileWatch.describe(self.compiles.since(mark)) if self.compiles is not None else ""
            self.log(slow_step_line(self.steps + 1, took, eng, compiled))
        for out in outs:
            owner = self._owner.get(out.request_id)
            if owner is None:  # the abort of a rejected add's prompts: nobody waits for them
                continue
            items.append((owner[0], owner[1], out))
            if out.finished:
                del self._owner[out.request_id]
                rids = self._rids[owner[0]]
                rids.remove(out.request_id)
                if not rids:
                    del self._rids[owner[0]]
        if self.live:  # the requests still running (or waiting): the sink reads what moved
            reqs = eng.requests
            items.extend((key, i, reqs[rid]) for rid, (key, i) in self._owner.items())
        self.steps += 1
        self.sink.step(items, self._gauges((took,)))

    def _gauges(self, took: tuple[float, ...]) -> tuple[int, int, int, int, tuple[float, ...]]:
        eng = self.engine
        bm = eng.block_manager
        sch = eng.scheduler
        return len(sch.running), len(sch.waiting), bm.num_blocks - bm.num_free_blocks, self.steps, took
