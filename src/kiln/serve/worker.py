"""The engine's own thread: the one place that touches the (not thread-safe) LLMEngine.

    HTTP handlers (event loop)                      engine thread
    submit(prompts, params) --("add", handle)-->    add_request for each prompt (all or none)
                            <--accepted / error--   (through loop.call_soon_threadsafe)
    handle.abort()          --("abort", handle)-->  engine.abort: the sequences' KV blocks are freed at once
                            <--(i, RequestOutput)-- step() while work exists; blocks on the queue when idle

Admission is bounded in the event loop, where it is counted: the server holds at most `max_num_seqs`
running + `max_waiting` waiting sequences (n counts n times); past that a request is refused with 503
(Retry-After) instead of queueing without limit.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time

from kiln.errors import KilnError
from kiln.infer.engine import LLMEngine, RequestOutput
from kiln.infer.sampling_params import SamplingParams
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import APIError


class RequestHandle:
    """One HTTP request's prompts in the engine: the outputs arrive on `outputs` as (prompt index,
    RequestOutput); `done` once every prompt has finished."""

    def __init__(self, worker: EngineWorker, prompts: list, params: SamplingParams, loop, stream: bool):
        self.worker, self.prompts, self.params, self.loop = worker, prompts, params, loop
        self.stream = stream  # False: only the final outputs are sent (a whole response needs no steps)
        self.id = next(worker._handle_ids)
        self.request_ids: list[str] = []
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.arrival = time.monotonic()
        self.finished: set[int] = set()
        self.closed = False
        self.n_seqs = len(prompts) * params.n
        # engine-thread state for the latency metrics: per (prompt, choice) tokens seen and last token time
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.prompts)

    def abort(self) -> None:
        """Stop the request's unfinished prompts (the client went away); safe to call more than once."""
        if not self.closed:
            self.closed = True
            if not self.done:
                self.worker._commands.put(("abort", self))
            self.worker._release(self)

    def _take(self, item) -> tuple[int, RequestOutput]:
        """One queued item: an error from the engine thread is raised; an output's finish is recorded."""
        if isinstance(item, BaseException):
            raise item
        i, out = item
        if out.finished:
            self.finished.add(i)
        return i, out

    async def next(self) -> tuple[int, RequestOutput]:
        return self._take(await self.outputs.get())

    async def next_batch(self) -> list[tuple[int, RequestOutput]]:
        """Wait for an output, then take every other one already queued, keeping the newest per prompt
        (outputs are cumulative: the newest holds all the text and tokens of the older ones). A client
        that falls behind the engine then gets several tokens per chunk instead of one chunk per token,
        so the event loop's work per step stops growing with its backlog."""
        newest = dict([await self.next()])
        while not self.outputs.empty():
            i, out = self._take(self.outputs.get_nowait())
            newest[i] = out
        return list(newest.items())


class EngineWorker:
    """Owns `engine` in a daemon thread. `start()` inside the server's event loop, `stop()` on shutdown."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int, log=print):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise KilnError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.engine, self.metrics, self.log = engine, metrics, log
        self.capacity = engine.scheduler.config.max_num_seqs + max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._handle_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0  # sequences admitted and not yet released (event-loop side only)
        self.accepting = False
        self.error: BaseException | None = None  # the engine thread's crash, if any

    # ---- event-loop side ------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()
        self.accepting = True

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    async def submit(self, prompts: list, params: SamplingParams, stream: bool = True) -> RequestHandle:
        """Queue the prompts as engine requests; raises APIError 400 (bad input), 503 (full, stopping)."""
        if not self.accepting or not self.healthy:
            raise APIError(503, "the server is shutting down or its engine has stopped", code="unavailable")
        handle = RequestHandle(self, prompts, params, self._loop, stream)
        if handle.n_seqs > self.capacity:  # could never be admitted: the client's error, not a busy server
            raise APIError(
                400,
                f"{len(prompts)} prompt(s) x n={params.n} = {handle.n_seqs} sequences exceed what this server "
                f"holds at once ({self.capacity}): send fewer prompts or a smaller n",
                param="n",
            )
        if self.in_flight + handle.n_seqs > self.capacity:
            self.metrics.rejected.inc()
            raise APIError(
                503,
                f"the server is at capacity ({self.capacity} sequences running or waiting): retry later",
                code="overloaded",
            )
        self.in_flight += handle.n_seqs
        self._commands.put(("add", handle))
        try:
            await handle.accepted
        except KilnError as e:
            self._release(handle)
            handle.closed = True
            raise APIError(400, str(e)) from None
        except BaseException:  # cancelled while waiting: the engine may have added it
            handle.abort()
            raise
        return handle

    def _release(self, handle: RequestHandle) -> None:
        if handle.n_seqs:
            self.in_flight -= handle.n_seqs
            handle.n_seqs = 0

    def abort_all(self) -> None:
        """Abort every request in the engine (shutdown's deadline): their handlers end them with "abort"."""
        self._commands.put(("abort_all", None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread. In-flight HTTP handlers see their requests finish (abort)."""
        self.accepting = False
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    # ---- engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        handles: dict[str, tuple[RequestHandle, int]] = {}  # engine request id -> (handle, prompt index)
        eng = self.engine
        try:
            while True:
                # idle: block until a command arrives; busy: take what is queued and step
                block = not eng.has_unfinished()
                while True:
                    try:
                        kind, handle = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    block = False
                    if kind == "stop":
                        for h, _ in list(handles.values()):
                            for rid in h.request_ids:
                                eng.abort(rid)
                        while eng.has_unfinished() or eng.requests:  # the aborted, one last time
                            self._dispatch(eng.step(), handles)
                        self._update_gauges()
                        return
                    if kind == "add":
                        self._add(handle, handles)
                    elif kind == "abort_all":
                        for rid in list(handles):
                            eng.abort(rid)
                    elif kind == "abort":
                        for rid in handle.request_ids:
                            eng.abort(rid)
                # a step also hands back requests that an abort finished (and drops them from the engine)
                if eng.has_unfinished() or eng.requests:
                    self._dispatch(eng.step(), handles)
                self._update_gauges()
        except BaseException as e:  # a crash: every waiting handler gets a 500, /health turns 503
            self.error = e
            self.log(f"kiln serve: the engine thread stopped: {type(e).__name__}: {e}")
            failure = APIError(500, f"the engine failed: {type(e).__name__}: {e}")
            for h, _ in handles.values():
                self._send(h, failure)
            while True:  # answer anything still queued
                try:
                    kind, h = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._settle(h, failure)

    def _add(self, handle: RequestHandle, handles: dict) -> None:
        eng = self.engine
        try:
            for i, p in enumerate(handle.prompts):
                handle.request_ids.append(eng.add_request(p, handle.params, request_id=f"{handle.id}-{i}"))
        except KilnError as e:  # all or none: take back the prompts already added
            for rid in handle.request_ids:
                eng.abort(rid)
            handle.request_ids = []
            self._settle(handle, e)
            return
        for i, rid in enumerate(handle.request_ids):
            handles[rid] = (handle, i)
            self.metrics.prompt_tokens.inc(len(eng.requests[rid].prompt_ids))
        self._settle(handle, None)

    def _settle(self, handle: RequestHandle, error: BaseException | None) -> None:
        def settle():
            if not handle.accepted.done():
                if error is None:
                    handle.accepted.set_result(None)
                else:
                    handle.accepted.set_exception(error)

        self._loop.call_soon_threadsafe(settle)

    def _send(self, handle: RequestHandle, item) -> None:
        self._loop.call_soon_threadsafe(handle.outputs.put_nowait, item)

    def _dispatch(self, outs: list[RequestOutput], handles: dict) -> None:
        now = time.monotonic()
        batch = []
        for out in outs:
            entry = handles.get(out.request_id)
            if entry is None:  # aborted while its add was in flight
                continue
            handle, i = entry
            self._observe(handle, i, out, now)
            if out.finished:
                del handles[out.request_id]
            if not handle.closed and (handle.stream or out.finished):
                batch.append((handle.outputs, (i, out)))
        if batch:  # one wake-up of the event loop per step, not one per request
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _observe(self, handle: RequestHandle, i: int, out: RequestOutput, now: float) -> None:
        m = self.metrics
        for c in out.outputs:
            key = (i, c.index)
            seen, last = handle._seen.get(key, (0, handle.arrival))
            new = len(c.token_ids) - seen
            if new > 0:
                m.generation_tokens.inc(new)
                if seen == 0:
                    m.ttft.observe(now - handle.arrival)
                else:  # one step may add several tokens (never today; spread the gap if it does)
                    for _ in range(new):
                        m.itl.observe((now - last) / new)
                handle._seen[key] = (len(c.token_ids), now)
        if out.finished:
            m.e2e.observe(now - handle.arrival)
            for c in out.outputs:
                m.finished.labels(finish_reason=c.finish_reason or "unknown").inc()

    def _update_gauges(self) -> None:
        eng, m = self.engine, self.metrics
        m.running.set(len(eng.scheduler.running))
        m.waiting.set(len(eng.scheduler.waiting))
        bm = eng.block_manager
        m.kv_blocks_used.set(bm.num_blocks - bm.num_free_blocks)


def _deliver(batch: list) -> None:
    for q, item in batch:
        q.put_nowait(item)
