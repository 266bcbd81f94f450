"""The engine side of the server: the one loop that owns an LLMEngine (which is not thread-safe), whatever
carries its commands and outputs. It runs in a thread of the server's process (worker.ThreadWorker: tests,
`Server(engine, config)`) or in a child process of its own (engine_process.ProcessWorker: `kiln serve`).

Commands (tuples, picklable: the process transport sends them through a pipe), from the HTTP side:
    ("add", key, prompts, params)   add_request for each prompt (all or none); key: the handle's int id
    ("abort", key)                  engine.abort of the handle's prompts: their KV blocks are freed at once
    ("abort_all",)                  every request (shutdown's deadline)
    ("stop",)                       abort what is left, step it out, return
Events, to the sink (worker.EngineWorker on the HTTP side, or the child's delta sender):
    accepted(key, prompt_tokens) | rejected(key, message)     one per "add"
    step(items, gauges)     items: [(key, prompt index, RequestOutput)] of one step (cumulative outputs);
                            with live=True, the finished requests' RequestOutputs, then every unfinished
                            request's own engine state (key, prompt index, LLMEngine.requests[id]), which
                            the sink reads before the next step (the engine then builds no per-step copies);
                            gauges: (running, waiting, KV blocks used), after every pass of the loop
    crashed(message)        the engine raised: the loop ends
The request id of prompt i of handle `key` is f"{key}-{i}".
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from kiln.errors import KilnError
from kiln.infer.engine import LLMEngine


class EngineLoop:
    """run(get): drain the commands `get(block)` returns (queue.Empty when none) before each step, step
    while work exists, block on `get` when idle; report to `sink` (module docstring)."""

    def __init__(self, engine: LLMEngine, sink, live: bool = False):
        self.engine, self.sink, self.live = engine, sink, live
        self._owner: dict[str, tuple[int, int]] = {}  # engine request id -> (handle key, prompt index)
        self._rids: dict[int, list[str]] = {}  # handle key -> its live request ids

    def run(self, get: Callable[[bool], tuple]) -> None:
        eng = self.engine
        try:
            while True:
                # idle: block until a command arrives; busy: take what is queued and step
                block = not eng.has_unfinished()
                while True:
                    try:
                        cmd = get(block)
                    except queue.Empty:
                        break
                    block = False
                    kind = cmd[0]
                    if kind == "stop":
                        for rid in list(self._owner):
                            eng.abort(rid)
                        while eng.has_unfinished() or eng.requests:  # the aborted, one last time
                            self._step()
                        self.sink.step([], self._gauges())
                        return
                    if kind == "add":
                        self._add(*cmd[1:])
                    elif kind == "abort":
                        for rid in self._rids.get(cmd[1], ()):
                            eng.abort(rid)
                    elif kind == "abort_all":
                        for rid in list(self._owner):
                            eng.abort(rid)
                    else:
                        raise KilnError(f"unknown engine command {kind!r}")
                # a step also hands back requests that an abort finished (and drops them from the engine)
                if eng.has_unfinished() or eng.requests:
                    self._step()
                else:
                    self.sink.step([], self._gauges())
        except BaseException as e:  # noqa: BLE001 - a crash: the sink fails every waiting request (500)
            self.sink.crashed(f"{type(e).__name__}: {e}")

    def _add(self, key: int, prompts: list, params) -> None:
        eng, rids = self.engine, []
        try:
            for i, p in enumerate(prompts):
                rids.append(eng.add_request(p, params, request_id=f"{key}-{i}"))
        except KilnError as e:  # all or none: take back the prompts already added
            for rid in rids:
                eng.abort(rid)
            self.sink.rejected(key, str(e))
            return
        for i, rid in enumerate(rids):
            self._owner[rid] = (key, i)
        self._rids[key] = rids
        self.sink.accepted(key, sum(len(eng.requests[rid].prompt_ids) for rid in rids))

    def _step(self) -> None:
        items = []
        eng = self.engine
        for out in eng.step(finished_only=True) if self.live else eng.step():
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
        self.sink.step(items, self._gauges())

    def _gauges(self) -> tuple[int, int, int]:
        eng = self.engine
        bm = eng.block_manager
        return len(eng.scheduler.running), len(eng.scheduler.waiting), bm.num_blocks - bm.num_free_blocks
