"""`kiln serve` as a process: SIGTERM while a stream runs: the stream ends properly (finished or aborted at
the --shutdown-timeout deadline, then [DONE]), new connections are refused, and the process exits 0.
SIGINT takes the same handler (uvicorn's handle_exit, overridden in kiln.serve.cli); one server start
(two interpreters: the server and its engine process) costs ~15-30 s of imports on a loaded 2-core machine,
so only SIGTERM runs here. No engine process outlives the server."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_process_of(pid: int) -> int:
    """The pid of the multiprocessing child of server process `pid` (Linux /proc)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                if b"spawn_main" in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
        except OSError:
            continue
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
def test_sigterm_shuts_down_gracefully(model_dir):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "kiln.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--device", "cpu", "--num-blocks", "64", "--block-size", "4", "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # two interpreter starts (the server, then its engine process): allow for a loaded machine
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            proc.kill()  # before reading: a running server's output never ends
            proc.wait()
            pytest.fail("the server did not start: " + proc.stdout.read())
        lines: list[str] = []
        started = threading.Event()
        # 200 tokens take longer than the 1 s deadline: the stream is aborted, and still ends properly
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "stream": True, "ignore_eos": True}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for ln in r.iter_lines():
                    if ln:
                        lines.append(ln)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        engine_pid = engine_process_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0
        out = proc.stdout.read()
        assert "kiln serve: stopped" in out, out
        # the stream ended in order: its last chunk has a finish reason, then [DONE]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["choices"][0]["finish_reason"] in ("length", "abort")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
        deadline = time.monotonic() + 10  # the engine process was stopped and joined: it is gone
        while time.monotonic() < deadline and Path(f"/proc/{engine_pid}").exists():
            time.sleep(0.1)
        assert not Path(f"/proc/{engine_pid}").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
