"""The engine in a child process of its own (`kiln serve`): the HTTP process's event loop (JSON, SSE,
uvicorn's sends for hundreds of streams) and the engine no longer share one GIL, so a GPU step never waits
for the event loop's work, nor for the GIL after each CUDA wait (vLLM V1's engine-core process, the same
reason).

    server process                                         engine process (multiprocessing spawn)
    ProcessWorker.send -> commands (mp.Queue) ---------->  EngineLoop (engine_loop.py) on the LLMEngine
                                                           it built from (model path, engine options)
    reader thread <- replies (a one-way pipe) <- sender thread <- _ChildSink: one message per step
      DeltaDecoder rebuilds the cumulative RequestOutputs,
      EngineWorker.step delivers them (one wake-up of the event loop)

Replies: ("ready", engine facts) or ("failed", message) once at start; ("intake", [(key, prompt tokens,
None | rejection message)], steps, sent) per intake (every add taken before one step: engine_loop.py);
("step", [deltas.py's delta per output], (running, waiting, KV blocks used, steps), sent) per step that
produced outputs or moved a gauge (sent: the engine process's time.monotonic() when it made the message,
the same clock as this process's on Linux: kiln_engine_reply_lag_seconds); ("crashed", message);
("stopped",) last. Commands arrive as the HTTP side batched them: the adds of one tick of its event loop
in one message (worker.py).

The engine never waits on the server process: its messages go through a sender thread's unbounded buffer,
so a server process that falls behind grows that buffer (and coalesces: the reader takes every message
already in the pipe and delivers only each prompt's newest output) instead of slowing the steps. The
server process owns the only read end of the pipe and the engine process the only write end: the engine
process's death, however it happens, is an EOF for the reader, and every waiting request gets a 500.
The engine process ignores SIGINT (the server's graceful shutdown stops it with a "stop" command) and
stops on its own when its parent is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time

from kiln.errors import KilnError
from kiln.infer.config import EngineConfig
from kiln.infer.engine import RequestOutput
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
        self._commands = ctx.Queue()
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_engine_main,
            args=(str(model), dict(engine), engine_log, self._commands, child_conn),
            name="kiln-engine",
            daemon=True,  # a backstop: multiprocessing terminates it if this process exits without stop()
        )
        self._proc.start()
        child_conn.close()  # the child's end only: its death is then an EOF here
        self._reader: threading.Thread | None = None
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
        self._reader = threading.Thread(target=self._read, name="kiln-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    @property
    def healthy(self) -> bool:
        return (
            self.error is None
            and self._proc.is_alive()
            and self._reader is not None
            and self._reader.is_alive()
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left and end the engine process (killed after `timeout` seconds); no orphan."""
        self.accepting = False
        self._stopping = True
        if self._proc.is_alive():
            self.command(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        self._proc.join(timeout)
        self._kill()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        if self._reader is not None:
            self._reader.join(10)  # the kill is an EOF for it
        self._close()

    def _close(self) -> None:
        self._commands.close()
        self._commands.cancel_join_thread()  # a dead engine reads nothing: do not wait to flush at exit
        if self._reader is None or not self._reader.is_alive():
            self._conn.close()

    # ---- the reader thread -------------------------------------------------------------------------------
    def _read(self) -> None:
        """Take every message already in the pipe with one read (os.read of up to READ_BYTES) and apply
        them as one run. multiprocessing's Connection.recv makes two or three system calls per message
        (poll, the 4-byte header, the body), each giving up the GIL, and a thread that gives up the GIL
        while the event loop's thread computes can wait up to the 5 ms switch interval to get it back;
        the engine's intake replies (admission) wait behind every step message before them. One read per
        wake-up takes them all. The frames are multiprocessing's own (_frames)."""
        fd, buf = self._conn.fileno(), bytearray()
        with contextlib.suppress(AttributeError, OSError):  # Linux: room for a few steps' messages at once
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        try:
            while True:
                try:
                    data = os.read(fd, READ_BYTES)  # blocks (without the GIL) until bytes come; b"": EOF
                except OSError:  # the pipe closed under the read: the same as EOF
                    data = b""
                if not data:
                    break
                buf += data
                msgs = _frames(buf)
                if msgs and self._handle(msgs):
                    return
        except BaseException as e:  # noqa: BLE001 - a bug here must still answer the waiting requests
            self.crashed(f"the engine process's reader failed: {type(e).__name__}: {e}")
            return
        if self.error is None and not self._stopping:
            self._proc.join(5)
            self.crashed(f"the engine process died ({_exit_words(self._proc.exitcode)})")

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
            elif kind == "intake":  # msg[3]: made, msg[5]: written by the sender thread
                self.intake(msg[1], msg[2], msg[4], {"sender": msg[5] - msg[3], "pipe": now - msg[5]})
            elif kind == "crashed":
                flush()
                self.crashed(msg[1])
            elif kind == "stopped":
                flush()
                return True
        flush()
        return False


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
class _Sender:
    """Sends the engine process's messages from a thread of its own: `put` never blocks (a server process
    that reads slowly grows this buffer instead of stalling the steps). Pickling happens here too, while
    the engine thread waits on the GPU."""

    def __init__(self, conn):
        self._conn = conn
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False  # the server process is gone
        self._thread = threading.Thread(target=self._run, name="kiln-engine-sender", daemon=True)
        self._thread.start()

    def put(self, msg: tuple) -> None:
        self._items.put(msg)

    def _run(self) -> None:
        while (msg := self._items.get()) is not None:
            try:  # stamped last with the time it is written (the reader times the sender's wait by it)
                self._conn.send((*msg, time.monotonic()))
            except (OSError, ValueError):
                self.broken = True
                return

    def close(self, timeout: float = 30.0) -> None:
        self._items.put(None)
        self._thread.join(timeout)
        self._conn.close()


class _ChildSink:
    """EngineLoop's events as messages: each step's outputs as deltas (deltas.py), in one message."""

    def __init__(self, sender: _Sender):
        self.sender, self.encoder = sender, DeltaEncoder()
        self._gauges = None
        self._took: tuple[float, ...] = ()  # the wall times of the steps not yet reported

    def intake(self, results: list, steps: int, timing: tuple) -> None:
        self.sender.put(("intake", results, steps, time.monotonic(), timing))

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
        self.sender.put(("step", deltas, (*gauges[:4], took), time.monotonic()))

    def crashed(self, message: str) -> None:
        self.sender.put(("crashed", message))


def _engine_main(model: str, engine: dict, engine_log: bool, commands, conn) -> None:
    """The engine process: load, report ready, run the loop until "stop" (or the parent is gone)."""
    # Ctrl-C (or a service manager's SIGTERM) reaches the whole process group: the server process decides
    # when the engine stops (its graceful shutdown), and a parent that is gone stops it (`get` below)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sender = _Sender(conn)
    parent = os.getppid()
    try:
        from kiln.infer.engine import LLM

        log = (lambda *a: print(*a, flush=True)) if engine_log else None  # stdout may be a file: flush
        llm = LLM(model, log=log, **engine)
    except BaseException as e:  # noqa: BLE001 - reported to the parent: `kiln: error: ...`, exit 2
        msg = str(e) if isinstance(e, KilnError) else f"loading the model failed: {type(e).__name__}: {e}"
        sender.put(("failed", msg))
        sender.close()
        return
    eng = llm.engine
    sender.put(
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
        if sender.broken:  # the server process is gone: stop now, even with requests running
            return ("stop",)
        if timeout is not None:
            return commands.get(block=timeout > 0, timeout=timeout or None)
        while True:
            try:
                return commands.get(timeout=PARENT_CHECK_S)
            except queue.Empty:
                if os.getppid() != parent or sender.broken:
                    return ("stop",)

    EngineLoop(eng, _ChildSink(sender), live=True).run(get)
    sender.put(("stopped",))
    sender.close()
