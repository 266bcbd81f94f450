"""The HTTP side of the engine: admission, one RequestHandle per HTTP request, and the delivery of the
engine's outputs to the handlers. The engine itself runs in engine_loop.EngineLoop, carried by one of two
transports that share everything here:

    ThreadWorker                      the loop in a thread of this process (tests, `Server(engine, config)`)
    engine_process.ProcessWorker      the loop in a child process of its own (`kiln serve`): the engine
                                      does not share a GIL with the event loop's JSON and SSE work

    HTTP handlers (event loop)                     the transport (a thread, or the engine process's pipes)
    submit(prompts, params) --("add", [adds])-->   EngineLoop: add_request for each prompt (all or none)
                            <--intake: accepted / rejected (-> 400), one call_soon_threadsafe per intake--
    handle.abort()          --("abort", key)-->    engine.abort: the sequences' KV blocks are freed at once
                            <--step(items, gauges): one wake-up of the event loop per delivery--

The adds submitted in one tick of the event loop leave as one command (a burst of clients parsed in one
tick is one message, one pickling and one write for the process transport), and the engine answers each
intake with one reply (engine_loop.py: the intake rule). A tick that parses hundreds of requests lasts
long, so a batch also leaves as soon as an add finds it ADD_BATCH_S old: the engine gets the burst's head
while the event loop is still parsing its tail.

Admission is bounded in the event loop, where it is counted: the server holds at most `max_num_seqs`
running + `max_waiting` waiting sequences (n counts n times); past that a request is refused with 503
(Retry-After) instead of queueing without limit. Latency metrics (TTFT, ITL, e2e) are observed here, when
the outputs reach this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time

from kiln.errors import KilnError
from kiln.infer.engine import LLMEngine, RequestOutput
from kiln.infer.sampling_params import SamplingParams
from kiln.serve.engine_loop import EngineLoop
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import APIError

ADD_BATCH_S = 0.002  # adds wait at most this long (or the end of the tick) to leave together


class RequestHandle:
    """One HTTP request's prompts in the engine: the outputs arrive on `outputs` as (prompt index,
    RequestOutput); `done` once every prompt has finished."""

    def __init__(self, worker: EngineWorker, prompts: list, params: SamplingParams, loop, stream: bool):
        self.worker, self.prompts, self.params, self.loop = worker, prompts, params, loop
        self.stream = stream  # False: only the final outputs are sent (a whole response needs no steps)
        self.id = next(worker._handle_ids)
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()
        self.arrival = time.monotonic()
        self.finished: set[int] = set()
        self.closed = False
        self.n_seqs = len(prompts) * params.n
        # delivery-side state: per (prompt, choice) tokens seen and last token time (latency metrics); the
        # prompts the engine has finished (the handle leaves the worker's registry after the last)
        self._seen: dict[tuple[int, int], tuple[int, float]] = {}
        self._engine_finished = 0
        self._paced_at: float | None = None  # event-loop time of the last batch next_batch returned

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.prompts)

    def abort(self) -> None:
        """Stop the request's unfinished prompts (the client went away); safe to call more than once."""
        if not self.closed:
            self.closed = True
            if not self.done:
                self.worker.command(("abort", self.id))
            self.worker._release(self)

    def _take(self, item) -> tuple[int, RequestOutput]:
        """One queued item: an error from the engine side is raised; an output's finish is recorded."""
        if isinstance(item, BaseException):
            raise item
        i, out = item
        if out.finished:
            self.finished.add(i)
        return i, out

    async def next(self) -> tuple[int, RequestOutput]:
        return self._take(await self.outputs.get())

    async def next_batch(self, interval: float = 0.0) -> list[tuple[int, RequestOutput]]:
        """Wait for an output, then take every other one already queued, keeping the newest per prompt
        (outputs are cumulative: the newest holds all the text and tokens of the older ones). A client
        that falls behind the engine then gets several tokens per chunk instead of one chunk per token,
        so the event loop's work per step stops growing with its backlog.

        interval > 0: return at most once per `interval` seconds (the stream's pace, ServeConfig's
        stream_interval): after a batch the handler sleeps out the rest of the interval before it looks
        at its queue again, so the engine's outputs meanwhile only queue up (a put wakes no one) and the
        stream costs the event loop one wake-up and one chunk per interval instead of one per engine step.
        The first batch (the first token) is never held back; nothing is dropped."""
        if interval > 0 and self._paced_at is not None:
            wait = self._paced_at + interval - self.loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
        newest = dict([await self.next()])
        while not self.outputs.empty():
            i, out = self._take(self.outputs.get_nowait())
            newest[i] = out
        self._paced_at = self.loop.time()
        return list(newest.items())


class EngineWorker:
    """The HTTP side shared by both transports. A transport gives the engine facts (`_engine_facts`, before
    serving), implements `send(command)`, `healthy`, `_start()` and `stop()`, and calls the sink methods
    (`intake`, `step`, `crashed`) from its delivery thread."""

    def __init__(self, max_waiting: int, log=print):
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 0:
            raise KilnError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.max_waiting, self.log = max_waiting, log
        self._handle_ids = itertools.count()
        # handle key -> handle, for the delivery thread (reads only); added and dropped in the event loop
        self._handles: dict[int, RequestHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0  # sequences admitted and not yet released (event-loop side only)
        self._adds: list[tuple] = []  # (key, prompts, params) submitted in this tick of the event loop
        self._adds_lock = threading.Lock()  # stop() may flush them from another thread
        self._adds_since = 0.0  # when the first of them was queued
        self._steps = 0  # the engine's step count last reported (kiln_engine_steps_total follows it)
        self.accepting = False
        self.error: str | None = None  # the engine's crash, if any

    def _engine_facts(self, max_model_len: int, num_blocks: int, max_num_seqs: int) -> None:
        self.max_model_len, self.num_blocks = max_model_len, num_blocks
        self.metrics = ServerMetrics(num_blocks)
        self.capacity = max_num_seqs + self.max_waiting

    # ---- event-loop side ------------------------------------------------------------------------------
    def start(self) -> None:
        """Inside the server's event loop (the app's lifespan)."""
        self._loop = asyncio.get_running_loop()
        self._start()
        self.accepting = True

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
        # registered before the command leaves: a crash reported from now on fails this handle too
        self._handles[handle.id] = handle
        with self._adds_lock:
            now = time.monotonic()
            if not self._adds:  # the first add of this tick: it leaves after the tick's other handlers ran
                self._adds_since = now
                self._loop.call_soon(self._flush_adds)
            self._adds.append((handle.id, prompts, params))
            now_too = now - self._adds_since >= ADD_BATCH_S  # a long tick: do not hold the head back
        if now_too:
            self._flush_adds()
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

    def _flush_adds(self) -> None:
        with self._adds_lock:
            adds, self._adds = self._adds, []
            if adds:  # stamped: the engine times the command's crossing (kiln_admission_stage_seconds)
                now = time.monotonic()
                self.metrics.stage["batch"].observe(max(0.0, now - self._adds_since))
                self.send(("add", adds, now))

    def command(self, command: tuple) -> None:
        """Send a command after the adds still waiting for the end of the tick (an abort follows its add)."""
        self._flush_adds()
        self.send(command)

    def _release(self, handle: RequestHandle) -> None:
        if handle.n_seqs:
            self.in_flight -= handle.n_seqs
            handle.n_seqs = 0

    def abort_all(self) -> None:
        """Abort every request in the engine (shutdown's deadline): their handlers end them with "abort"."""
        self.command(("abort_all",))

    # ---- the sink: called from the transport's delivery thread ------------------------------------------
    def intake(
        self,
        results: list[tuple[int, int, str | None]],
        steps: int,
        timing: tuple[float | None, float] = (None, 0.0),
        stages: dict[str, float] | None = None,
    ) -> None:
        """The engine's answer to the adds it took before one step: (key, prompt tokens, None) accepted,
        (key, 0, message) rejected; `steps`: the engine steps run before them; `timing`: the engine's
        (command_s, intake_s) (engine_loop.py); `stages`: the transport's own (the process transport's
        sender and pipe), all observed in kiln_admission_stage_seconds."""
        m = self.metrics
        accepted = sum(1 for r in results if r[2] is None)
        if accepted:
            m.intake.observe(accepted)
        tokens = sum(r[1] for r in results)
        if tokens:
            m.prompt_tokens.inc(tokens)
        command_s, intake_s = timing
        if command_s is not None:
            m.stage["command"].observe(max(0.0, command_s))
        m.stage["intake"].observe(max(0.0, intake_s))
        for name, seconds in (stages or {}).items():
            m.stage[name].observe(max(0.0, seconds))
        self._loop.call_soon_threadsafe(self._settle, results, time.monotonic())

    def step(self, items: list[tuple[int, int, RequestOutput]], gauges: tuple) -> None:
        """Deliver one step's outputs (or several steps' newest ones) in one wake-up of the event loop;
        gauges: (running, waiting, KV blocks used, engine steps run, the wall seconds of each step run
        since the last delivery)."""
        m = self.metrics
        for seconds in gauges[4]:
            m.step_seconds.observe(seconds)
        m.running.set(gauges[0])
        m.waiting.set(gauges[1])
        m.kv_blocks_used.set(gauges[2])
        if gauges[3] > self._steps:
            m.steps.inc(gauges[3] - self._steps)
            self._steps = gauges[3]
        now = time.monotonic()
        batch, generated = [], 0
        for key, i, out in items:
            handle = self._handles.get(key)
            if handle is None:  # answered already (a crash)
                continue
            generated += self._observe(handle, i, out, now)
            done = False
            if out.finished:
                handle._engine_finished += 1
                done = handle._engine_finished == len(handle.prompts)
            if done or (not handle.closed and (handle.stream or out.finished)):
                batch.append((handle, i, out, done))
        if generated:  # one increment per delivery (a counter's inc takes a lock: not one per request)
            m.generation_tokens.inc(generated)
        if batch:  # one wake-up of the event loop per delivery, not one per request
            self._loop.call_soon_threadsafe(self._deliver, batch)

    def crashed(self, message: str) -> None:
        """The engine failed: every waiting handler gets a 500, /health turns 503."""
        self.error = message
        self.log(f"kiln serve: the engine stopped: {message}")
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the event loop has closed: nobody is waiting
                self._loop.call_soon_threadsafe(
                    self._fail_all, APIError(500, f"the engine failed: {message}")
                )

    # ---- event-loop callbacks --------------------------------------------------------------------------
    def _settle(self, results: list[tuple[int, int, str | None]], handed: float) -> None:
        now = time.monotonic()
        self.metrics.stage["event_loop"].observe(max(0.0, now - handed))
        for key, _, error in results:
            handle = self._handles.get(key)
            if handle is None or handle.accepted.done():
                continue
            if error is None:
                self.metrics.admission.observe(now - handle.arrival)
                handle.accepted.set_result(None)
            else:
                del self._handles[key]
                handle.accepted.set_exception(KilnError(error))

    def _deliver(self, batch: list) -> None:
        for handle, i, out, done in batch:
            if done:
                self._handles.pop(handle.id, None)
            if not handle.closed and (handle.stream or out.finished):
                handle.outputs.put_nowait((i, out))

    def _fail_all(self, failure: APIError) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            if not handle.accepted.done():
                handle.accepted.set_exception(failure)
            else:
                handle.outputs.put_nowait(failure)

    # ---- metrics (delivery thread) ------------------------------------------------------------------------
    def _observe(self, handle: RequestHandle, i: int, out: RequestOutput, now: float) -> int:
        """The latency metrics of one output; returns its new tokens (the caller counts them)."""
        m = self.metrics
        generated = 0
        for c in out.outputs:
            key = (i, c.index)
            seen, last = handle._seen.get(key, (0, handle.arrival))
            new = len(c.token_ids) - seen
            if new > 0:
                generated += new
                if seen == 0:
                    m.ttft.observe(now - handle.arrival)
                else:  # several tokens in one delivery (a coalesced backlog): spread the gap over them
                    for _ in range(new):
                        m.itl.observe((now - last) / new)
                handle._seen[key] = (len(c.token_ids), now)
        if out.finished:
            m.e2e.observe(now - handle.arrival)
            for c in out.outputs:
                m.finished.labels(finish_reason=c.finish_reason or "unknown").inc()
        return generated


class ThreadWorker(EngineWorker):
    """The engine loop in a daemon thread of this process, on `engine` (which the caller built)."""

    def __init__(self, engine: LLMEngine, max_waiting: int, log=print):
        super().__init__(max_waiting, log)
        self._engine_facts(
            engine.max_model_len, engine.block_manager.num_blocks, engine.scheduler.config.max_num_seqs
        )
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        loop = EngineLoop(self.engine, self, log=self.log)
        self._thread = threading.Thread(target=loop.run, args=(self._get,), name="kiln-engine", daemon=True)
        self._thread.start()

    def _get(self, timeout: float | None) -> tuple:
        return self._commands.get(block=timeout != 0, timeout=timeout or None)

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, end the thread. In-flight HTTP handlers see their requests finish (abort)."""
        self.accepting = False
        if self._thread is not None and self._thread.is_alive():
            self.command(("stop",))
            self._thread.join(timeout)
