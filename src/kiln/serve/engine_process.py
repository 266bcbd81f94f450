"""The engine in a child process of its own (`kiln serve`): the HTTP process's event loop (JSON, SSE,
uvicorn's sends for hundreds of streams) and the engine no longer share one GIL, so a GPU step never waits
for the event loop's work, nor for the GIL after each CUDA wait (vLLM V1's engine-core process, the same
reason).

    server process (event loop thread)                    engine process (multiprocessing spawn; one thread)
    ProcessWorker.send: frame, os.write ---- commands --> _EngineIO.get: one os.read per wake-up, before
      (non-blocking; add_writer for what       (a pipe)     each step -> EngineLoop (engine_loop.py) on the
      does not fit)                                         LLMEngine it built from (model, engine options)
    _read_some (add_reader): one os.read <--- replies ---- _EngineIO.put: frame, non-blocking os.write (a
      per wake-up; DeltaDecoder rebuilds       (a pipe)     buffer for what does not fit) <- _ChildSink:
      the RequestOutputs, EngineWorker                      one message per step, one per intake
      delivers them

No helper thread carries a message either way. On the H200 every one of 256 requests sent at once was
admitted only ~5-6 s later (issue 16), and at a fixed rate the engine took commands 15 times in 24 s while
stepping ~45 times a second. Three helper threads were on that way (multiprocessing.Queue's feeder, the
engine's sender, the server's reader), each needing its process's GIL while that process's main thread
was busy; the suspected mechanism (not reproduced on the CPU machine): a thread waiting for the GIL asks
for it only after 5 ms without a switch, so a holder that keeps releasing and retaking it (an event loop's
system calls, an engine's CUDA launches) can keep it away for long. Now the event loop writes commands
itself, the engine process's one thread reads them before each step and writes its replies itself, and
the event loop reads the replies (docs/serve.md, Performance).

Replies: ("ready", engine facts) or ("failed", message) once at start; ("intake", [(key, prompt tokens,
None | rejection message)], steps, made, (command_s, intake_s)) per intake (every add taken before one
step: engine_loop.py); ("step", [deltas.py's delta per output], (running, waiting, KV blocks used, steps,
step seconds), made) per step that produced outputs or moved a gauge; ("crashed", message); ("stopped",)
last. Every reply ends with the time it was framed for writing; made is when the engine made it (both the
engine process's time.monotonic(), the same clock as this process's on Linux: kiln_engine_reply_lag_seconds
and kiln_admission_stage_seconds). Commands arrive as the HTTP side batched them: the adds of one tick of
its event loop in one message (worker.py).

The engine never waits on the server process: a reply the pipe has no room for waits in an unbounded
buffer (written before the next command is read), so a server process that falls behind grows that buffer
(and coalesces: the reader takes every message already in the pipe and delivers only each prompt's newest
output) instead of slowing the steps. The server process owns the only read end of the reply pipe and the
only write end of the command pipe, the engine process the other ends: the engine process's death, however
it happens, is an EOF for the reader (every waiting request gets a 500), and the server process's death
is an EOF for the engine (it stops). The engine process ignores SIGINT (the server's graceful shutdown
stops it with a "stop" command).
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import threading
import time

import torch

from kiln.errors import KilnError
from kiln.infer.config import EngineConfig
from kiln.infer.engine import RequestOutput
from kiln.kernels.compile_watch import CompileWatch
from kiln.serve.deltas import DeltaDecoder, DeltaEncoder
from kiln.serve.engine_loop import EngineLoop
from kiln.serve.worker import EngineWorker

PARENT_CHECK_S = 1.0  # how often an idle engine process checks that the server process still exists
READ_BYTES = 1 << 20  # the reader takes up to this much of the pipe per read (every message there, usually)
PIPE_BYTES = 1 << 20  # the reply pipe's capacity asked of Linux (its default, 64 KiB, is ~8 step messages)


class ProcessWorker(EngineWorker):
    """Starts the engine process at once (`LLM(model, **engine)` there); `wait_ready()` blocks until it
    has loaded the model (or raises its load error as a KilnError) and must come before serving."""

    def __init__(self, model: str, engine: dict, max_waiting: int, log=print, engine_log: bool = True):
        super().__init__(max_waiting, log)
        EngineConfig(**engine)  # bad options are a KilnError here, before a process starts
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state or threads of this one
        # commands: written by this process's event loop itself (send), no feeder thread (docs/serve.md)
        child_commands, self._commands = ctx.Pipe(duplex=False)
        self._cmd_fd = self._commands.fileno()
        with contextlib.suppress(AttributeError, OSError):  # Linux: a burst of adds fits at once
            fcntl.fcntl(self._cmd_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self._cmd_fd, False)
        self._out = bytearray()  # framed commands the pipe had no room for yet
        self._out_lock = threading.Lock()  # send runs in the event loop, and in shutdown's timer thread
        self._writer_armed = False  # the event loop writes the rest when the pipe has room
        self._loop_thread: int | None = None
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_main,
            args=(str(model), dict(engine), engine_log, child_commands, child_conn),
            name="kiln-engine",
            daemon=True,  # a backstop: multiprocessing terminates it if this process exits without stop()
        )
        self._proc.start()
        child_conn.close()  # the child's ends only: its death is then an EOF here (and ours one there)
        child_commands.close()
        self._reply_fd = self._conn.fileno()
        self._inbuf = bytearray()  # reply bytes read, not yet a whole message
        self._read_lock = threading.Lock()  # the event loop's reader, or stop() draining after it
        self._reading = False  # the event loop reads the replies (add_reader) until "stopped" or EOF
        self._decoder = DeltaDecoder()
        self._stopping = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self) -> None:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(10)
            self._close()
            raise KilnError(
                f"the engine process exited while loading the model ({_exit_words(self._proc.exitcode)})"
            ) from None
        except BaseException:  # Ctrl-C while loading: no orphan
            self._kill()
            raise
        if msg[0] == "failed":
            self._proc.join(10)
            self._kill()
            raise KilnError(msg[1])
        facts = msg[1]
        self._engine_facts(facts["max_model_len"], facts["num_blocks"], facts["max_num_seqs"])

    # ---- transport ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        self._loop_thread = threading.get_ident()  # start() runs in the event loop
        with contextlib.suppress(AttributeError, OSError):  # Linux: room for many steps' messages at once
            fcntl.fcntl(self._reply_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(self._reply_fd, False)
        self._reading = True
        self._loop.add_reader(self._reply_fd, self._read_some)

    def send(self, command: tuple) -> None:
        """Frame the command and write it now, from the calling thread (the event loop, usually): no
        other thread has to get the GIL for it to leave (multiprocessing's Queue hands every put to a
        feeder thread). The pipe holds PIPE_BYTES; what does not fit is written by the event loop when
        the engine has read (add_writer), or, from another thread or with no loop, before this returns."""
        frame = _frame(command)
        with self._out_lock:
            self._out += frame
            self._write_out()
            if not self._out:
                return
            loop = self._loop
            in_loop = loop is not None and self._loop_thread == threading.get_ident() and loop.is_running()
            if in_loop and not self._stopping:
                if not self._writer_armed:
                    self._writer_armed = True
                    loop.add_writer(self._cmd_fd, self._on_writable)
                return
            # another thread (shutdown's timer), or stop() (which then blocks the loop anyway): wait for room
            deadline = time.monotonic() + 10.0
            while self._out and time.monotonic() < deadline:
                _wait({self._cmd_fd: select.POLLOUT}, max(0.0, deadline - time.monotonic()))
                self._write_out()

    def _write_out(self) -> None:
        """Write what fits of the pending commands (the caller holds _out_lock)."""
        while self._out:
            try:
                n = os.write(self._cmd_fd, self._out)
            except BlockingIOError:
                return
            except OSError:  # the engine process is gone: the reader's EOF reports it
                self._out.clear()
                return
            del self._out[:n]

    def _on_writable(self) -> None:
        with self._out_lock:
            self._write_out()
            if not self._out and self._writer_armed:
                self._writer_armed = False
                self._loop.remove_writer(self._cmd_fd)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._proc.is_alive() and self._reading

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and end the engine process (killed after `timeout` seconds); no orphan. The
        replies until "stopped" are read here (stop runs in the event loop, whose reader then cannot)."""
        self.accepting = False
        self._stopping = True
        if self._proc.is_alive():
            self.command(("stop",))
        deadline = time.monotonic() + timeout
        while self._reading and time.monotonic() < deadline:
            _wait({self._reply_fd: select.POLLIN}, max(0.0, deadline - time.monotonic()))
            self._read_some()
        self._proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._close()

    def _close(self) -> None:
        with self._out_lock:
            if self._writer_armed and self._loop is not None and not self._loop.is_closed():
                if self._loop_thread == threading.get_ident():
                    self._loop.remove_writer(self._cmd_fd)
                else:
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        self._loop.call_soon_threadsafe(self._loop.remove_writer, self._cmd_fd)
            self._writer_armed = False
            self._out.clear()  # a dead engine reads nothing
            if not self._commands.closed:
                self._commands.close()
        with self._read_lock:
            self._stop_reading()
            if not self._conn.closed:
                self._conn.close()

    # ---- the reader (in the event loop) -------------------------------------------------------------------------------
    def _read_some(self) -> None:
        """Take every message already in the pipe with one read (os.read of up to READ_BYTES) and apply
        them as one run, in the event loop (add_reader): no reader thread has to get the GIL back while
        the event loop computes (a thread waits up to the 5 ms switch interval each time, and longer when
        the loop keeps taking the GIL back after its own system calls; issue 16, docs/serve.md). The
        frames are multiprocessing's own (_frames)."""
        # the event loop never waits for the lock: whoever holds it (stop, _close) reads or ends the reading
        if not self._read_lock.acquire(blocking=threading.get_ident() != self._loop_thread):
            return
        try:
            if not self._reading:
                return
            try:
                data = os.read(self._reply_fd, READ_BYTES)
            except BlockingIOError:
                return
            except OSError:  # the pipe closed under the read: the same as EOF
                data = b""
            if not data:
                self._stop_reading()
                if self.error is None and not self._stopping:
                    self._proc.join(5)  # EOF: the process has exited (the kernel closed its end)
                    self.crashed(f"the engine process died ({_exit_words(self._proc.exitcode)})")
                return
            self._inbuf += data
            msgs = _frames(self._inbuf)
            if msgs and self._handle(msgs):
                self._stop_reading()
        except BaseException as e:  # noqa: BLE001 - a bug here must still answer the waiting requests
            self._stop_reading()
            self.crashed(f"the engine process's reader failed: {type(e).__name__}: {e}")
        finally:
            self._read_lock.release()

    def _stop_reading(self) -> None:
        """No more replies are read (the caller holds _read_lock)."""
        if not self._reading:
            return
        self._reading = False
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if self._loop_thread == threading.get_ident():
            loop.remove_reader(self._reply_fd)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(loop.remove_reader, self._reply_fd)

    def _handle(self, msgs: list) -> bool:
        """Apply a run of messages; step outputs are delivered once, each prompt's newest. True: stopped."""
        newest: dict[tuple[int, int], tuple[bool, dict | None]] = {}
        gauges = None

        def flush():
            nonlocal gauges
            if gauges is None:
                return
            items = []
            for (key, i), (finished, metrics) in newest.items():
                handle = self._handles.get(key)
                copy = handle is not None and handle.stream  # only streams see unfinished outputs
                items.append((key, i, self._decoder.output(key, i, finished, metrics, copy)))
            newest.clear()
            self.step(items, gauges)
            gauges = None

        now = time.monotonic()
        for msg in msgs:
            kind = msg[0]
            if kind in ("step", "intake"):
                self.metrics.reply_lag.observe(max(0.0, now - msg[3]))
            if kind == "step":
                for delta in msg[1]:
                    newest[self._decoder.apply(delta)] = (delta[2], delta[5])
                took = () if gauges is None else gauges[4]  # steps of earlier messages in this run
                gauges = (*msg[2][:4], took + msg[2][4])
            elif kind == "intake":  # msg[3]: made, msg[5]: framed for writing
                self.intake(msg[1], msg[2], msg[4], {"sender": msg[5] - msg[3], "pipe": now - msg[5]})
            elif kind == "crashed":
                flush()
                self.crashed(msg[1])
            elif kind == "stopped":
                flush()
                return True
        flush()
        return False


def _wait(fds: dict[int, int], timeout: float | None) -> set[int]:
    """The fds of `fds` ({fd: POLLIN or POLLOUT}) that are ready (or hung up / in error) within `timeout`
    seconds (None: no limit). poll, not select: a server with hundreds of connections can hold fds past
    select's 1024."""
    poller = select.poll()
    for fd, events in fds.items():
        poller.register(fd, events)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    return {fd for fd, _ in poller.poll(ms)}


def _frame(obj) -> bytes:
    """`obj` pickled and framed as multiprocessing's Connection.send frames it (what `_frames` reads)."""
    body = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    n = len(body)
    head = (
        n.to_bytes(4, "big", signed=True)
        if n < 0x7FFFFFFF
        else (-1).to_bytes(4, "big", signed=True) + n.to_bytes(8, "big")
    )
    return head + body


def _frames(buf: bytearray) -> list:
    """Unpickle the whole messages at the start of `buf` and remove them from it; a partial one stays.
    The framing is multiprocessing.connection's (Connection.send: a 4-byte big-endian signed length, or -1
    and an 8-byte length for bodies over 2 GiB, then the pickled body)."""
    msgs, pos, end = [], 0, len(buf)
    while end - pos >= 4:
        size, head = int.from_bytes(buf[pos : pos + 4], "big", signed=True), 4
        if size == -1:
            if end - pos < 12:
                break
            size, head = int.from_bytes(buf[pos + 4 : pos + 12], "big"), 12
        if end - pos - head < size:
            break
        msgs.append(pickle.loads(buf[pos + head : pos + head + size]))
        pos += head + size
    del buf[:pos]
    return msgs


def _exit_words(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# ---- the engine process ------------------------------------------------------------------------------------
class _EngineIO:
    """The engine process's two pipes, served from its one thread: commands read with one os.read per
    wake-up (the frames of `_frame`), replies framed and written at once with non-blocking writes. A reply
    that does not fit (a server process that reads slowly) waits in an unbounded buffer, written before
    the next command is looked for: the engine never waits on the server process, and no message waits
    for another thread to get the GIL (a sender thread did: issue 16, docs/serve.md)."""

    def __init__(self, commands, conn):
        self._commands, self._conn = commands, conn  # the Connections: they own the two file descriptors
        self._cmd_fd, self._reply_fd = commands.fileno(), conn.fileno()
        os.set_blocking(self._reply_fd, False)
        self._inbuf, self._out = bytearray(), bytearray()
        self._inbox: collections.deque = collections.deque()
        self.broken = False  # the server process is gone (its read end closed, or its write end: EOF)

    def put(self, msg: tuple) -> None:
        """Frame `msg` stamped last with the time it was made ready to write (the reader's `pipe` stage
        starts there) and write what fits now."""
        if not self.broken:
            self._out += _frame((*msg, time.monotonic()))
            self._flush()

    def _flush(self) -> None:
        while self._out:
            try:
                n = os.write(self._reply_fd, self._out)
            except BlockingIOError:  # the pipe is full: the rest goes before the next command is read
                return
            except OSError:  # the server process closed its end
                self.broken = True
                self._out.clear()
                return
            del self._out[:n]

    def get(self, timeout: float | None) -> tuple:
        """The next command: timeout None blocks, 0 takes only what is already there; queue.Empty when none
        came. An EOF (the server process is gone) is ("stop",)."""
        if not self._inbox:
            self._fill(timeout)
        if self._inbox:
            return self._inbox.popleft()
        raise queue.Empty

    def _fill(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._inbox:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            fds = {self._cmd_fd: select.POLLIN}
            if self._out and not self.broken:
                fds[self._reply_fd] = select.POLLOUT
            ready = _wait(fds, wait)
            readable, writable = self._cmd_fd in ready, self._reply_fd in ready
            if writable:
                self._flush()
            if readable:
                try:
                    data = os.read(self._cmd_fd, READ_BYTES)
                except OSError:
                    data = b""
                if not data:
                    self.broken = True
                    self._inbox.append(("stop",))
                    return
                self._inbuf += data
                self._inbox.extend(_frames(self._inbuf))
            elif deadline is not None and time.monotonic() >= deadline:
                return

    def close(self, timeout: float = 30.0) -> None:
        """Write what is left (for at most `timeout` seconds), then close both pipes."""
        deadline = time.monotonic() + timeout
        while self._out and not self.broken and time.monotonic() < deadline:
            _wait({self._reply_fd: select.POLLOUT}, max(0.0, deadline - time.monotonic()))
            self._flush()
        self._conn.close()
        self._commands.close()


class _ChildSink:
    """EngineLoop's events as messages: each step's outputs as deltas (deltas.py), in one message."""

    def __init__(self, io: _EngineIO):
        self.io, self.encoder = io, DeltaEncoder()
        self._gauges = None
        self._took: tuple[float, ...] = ()  # the wall times of the steps not yet reported

    def intake(self, results: list, steps: int, timing: tuple) -> None:
        self.io.put(("intake", results, steps, time.monotonic(), timing))

    def step(self, items: list, gauges: tuple) -> None:
        deltas = []
        for key, i, x in items:  # finished: a RequestOutput; running: the engine's request (live=True)
            d = (
                self.encoder.encode(key, i, x)
                if isinstance(x, RequestOutput)
                else self.encoder.encode_live(key, i, x)
            )
            if d is not None:
                deltas.append(d)
        self._took += gauges[4]
        if not deltas and gauges[:3] == self._gauges:  # the step count and time travel with the next one
            return
        self._gauges = gauges[:3]
        took, self._took = self._took, ()
        self.io.put(("step", deltas, (*gauges[:4], took), time.monotonic()))

    def crashed(self, message: str) -> None:
        self.io.put(("crashed", message))


def _engine_main(model: str, engine: dict, engine_log: bool, commands, conn) -> None:
    """The engine process: load, report ready, run the loop until "stop" (or the parent is gone).
    commands: the read end of the command pipe; conn: the write end of the reply pipe (Connections)."""
    # Ctrl-C (or a service manager's SIGTERM) reaches the whole process group: the server process decides
    # when the engine stops (its graceful shutdown), and a parent that is gone stops it (`get` below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    io = _EngineIO(commands, conn)
    parent = os.getppid()
    try:
        from kiln.infer.engine import LLM

        log = (lambda *a: print(*a, flush=True)) if engine_log else None  # stdout may be a file: flush
        llm = LLM(model, log=log, **engine)
    except BaseException as e:  # noqa: BLE001 - reported to the parent: `kiln: error: ...`, exit 2
        msg = str(e) if isinstance(e, KilnError) else f"loading the model failed: {type(e).__name__}: {e}"
        io.put(("failed", msg))
        io.close()
        return
    eng = llm.engine
    if eng.device.type == "cuda":
        # The host side of a GPU step is small tensor work that gains nothing from torch's intra-op
        # threads, while this process shares the CPUs with the HTTP process and its clients, which keep
        # them busy at saturation (a pool's threads then contend with them). On the H200 (fed6c6e,
        # bench/serve.py, 16 cores) one thread everywhere gave 20,914 / 22,232 tok/s against 19,491 /
        # 22,066 with the default pool (one / four client processes). (vLLM's workers do the same.)
        torch.set_num_threads(1)
    io.put(
        (
            "ready",
            {
                "max_model_len": eng.max_model_len,
                "num_blocks": eng.block_manager.num_blocks,
                "max_num_seqs": eng.scheduler.config.max_num_seqs,
            },
        )
    )

    def get(timeout: float | None) -> tuple:
        if io.broken:  # the server process is gone: stop now, even with requests running
            return ("stop",)
        if timeout is not None:
            return io.get(timeout)
        while True:
            try:
                return io.get(PARENT_CHECK_S)
            except queue.Empty:
                if os.getppid() != parent or io.broken:
                    return ("stop",)

    # this process is the engine's alone: its Triton compiles are the engine's, named in slow-step lines
    with CompileWatch() as compiles:
        EngineLoop(eng, _ChildSink(io), live=True, log=log, compiles=compiles).run(get)
    io.put(("stopped",))
    io.close()
