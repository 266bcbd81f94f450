"""A tiny served model for the server tests: a BPE tokenizer trained on a stdlib source file (with ChatML
specials and template), a random-init kiln model over its vocabulary, and a uvicorn server on 127.0.0.1
in a background thread of this process (a free port, chosen by the OS)."""

from __future__ import annotations

import contextlib
import inspect
import socket
import threading
import time
from pathlib import Path

import httpx

from kiln.infer.engine import LLM
from kiln.model.config import ModelConfig
from kiln.model.hf import save_pretrained
from kiln.model.transformer import build_model
from kiln.serve.app import ServeConfig, Server
from kiln.serve.cli import chat_template_for, make_uvicorn_server
from kiln.tokenizer.chat import CHATML
from kiln.tokenizer.train import train_bpe

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def quiet(*args, **kwargs):
    pass


def make_model_dir(path: Path, chat_template: str | None = CHATML, max_seq_len: int = 256) -> Path:
    """A random-init qwen2-shaped model and a 300-id tokenizer, saved as an HF directory at `path`."""
    text = inspect.getsource(contextlib)[:8000]
    tok = train_bpe([text], 300, special_tokens=SPECIALS, progress=False, processes=1)
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=tok.n_vocab,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        max_seq_len=max_seq_len,
        qkv_bias=True,
    )
    model = build_model(cfg, seed=0)
    path.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, path)
    opts = {"chat_template": chat_template} if chat_template else {}
    tok.save(path, **opts)
    return path


def engine_for(path: Path, **engine):
    engine = {"device": "cpu", "block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64, **engine}
    return LLM(str(path), log=quiet, **engine)


class RunningServer:
    """`with RunningServer(llm, config) as s:` serves on s.url until the block ends, the engine in a thread;
    `RunningServer(None, config, server=...)` serves a Server built otherwise (process_server)."""

    def __init__(self, llm: LLM | None, config: ServeConfig, shutdown_timeout: float = 5.0, server=None):
        self.llm = llm
        self.server = server if server is not None else Server(llm.engine, config, log=quiet)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = make_uvicorn_server(self.server.app, "127.0.0.1", self.port, shutdown_timeout)
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            time.sleep(0.05)
        raise RuntimeError("the test server did not start")

    def __exit__(self, *exc) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        self.server.worker.stop()  # the lifespan did; again in case uvicorn ended before it ran

    @property
    def engine(self):
        return self.llm.engine

    def wait_idle(self, timeout: float = 20.0) -> bool:
        """True once the engine holds no request (its thread has handed back every aborted one) and every
        handler has released its admission (a stream releases in its generator's finally, after the engine
        finished it: up to one stream interval later, so the engine idles before the handlers do)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            idle = not self.engine.requests and not self.engine.has_unfinished()
            if idle and self.server.worker.in_flight == 0:
                return True
            time.sleep(0.02)
        return False


def process_server(path: Path, name: str = "tiny", **engine) -> RunningServer:
    """A server whose engine runs in a child process (as `kiln serve` runs it), on the engine options of
    engine_for; not yet started (`with process_server(...) as s:`)."""
    from kiln.serve.cli import load_tokenizer
    from kiln.serve.engine_process import ProcessWorker

    engine = {"device": "cpu", "block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64, **engine}
    template, special = chat_template_for(str(path), None)
    config = ServeConfig(model_name=name, chat_template=template, special_tokens=special)
    worker = ProcessWorker(str(path), engine, config.max_waiting, log=quiet, engine_log=False)
    try:
        worker.wait_ready()
        server = Server.over(worker, load_tokenizer(str(path)), config, log=quiet)
        return RunningServer(None, config, server=server)
    except BaseException:
        worker.stop(timeout=5)
        raise


def served(path: Path, name: str = "tiny", **kw) -> tuple[LLM, ServeConfig]:
    template, special = chat_template_for(str(path), None)
    engine_kw = {
        k: kw.pop(k) for k in list(kw) if k in ("num_blocks", "max_num_seqs", "max_num_batched_tokens")
    }
    return engine_for(path, **engine_kw), ServeConfig(
        model_name=name, chat_template=template, special_tokens=special, **kw
    )
