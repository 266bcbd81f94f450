"""`kiln serve`: the OpenAI-compatible HTTP server (kiln.serve.app) on uvicorn, the engine in a child
process of its own (kiln.serve.engine_process).

SIGINT / SIGTERM shut down gracefully: the listening socket closes and new requests get 503, running
requests get up to --shutdown-timeout seconds to finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import threading
from pathlib import Path

from kiln.errors import KilnError


def chat_template_for(model_path: str, template_file: str | None) -> tuple[str | None, dict]:
    """(chat template, special tokens for it) of a model: --chat-template's file, else the tokenizer's
    (tokenizer_config.json / chat_template.jinja beside the weights or in the run's tokenizer/)."""
    from kiln.model.checkpoint import tokenizer_dir
    from kiln.tokenizer.formats import load_chat_template

    special: dict = {}
    template = None
    found = tokenizer_dir(model_path)
    for d in [found] if found is not None else []:
        if template is None:
            template = load_chat_template(d)
        cfg = d / "tokenizer_config.json"
        if cfg.is_file() and not special:
            try:
                data = json.loads(cfg.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                data = {}
            for name in ("bos_token", "eos_token"):
                v = data.get(name)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    special[name] = v
    if template_file is not None:
        try:
            template = Path(template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise KilnError(f"cannot read the chat template {template_file}: {e}") from e
    return template, special


def make_uvicorn_server(app, host: str, port: int, shutdown_timeout: float, on_signal=None):
    """A uvicorn server that shuts down gracefully on SIGINT/SIGTERM and then returns (exit 0): uvicorn's
    own Server re-raises the signal after its shutdown, which would end the process with 130/143."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            if on_signal is not None:
                on_signal()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=shutdown_timeout,
        lifespan="on",
    )
    return _Server(config)


def load_tokenizer(model_path: str):
    """The tokenizer beside the model's weights, or None (prompts as token ids only): the one LLM's loader
    (kiln.infer.loading.load_for_inference) finds, loaded here because the engine runs in another process."""
    from kiln.model.checkpoint import tokenizer_dir
    from kiln.tokenizer import Tokenizer

    found = tokenizer_dir(model_path)
    return Tokenizer.load(found) if found is not None else None


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.serve.app import ServeConfig, Server
    from kiln.serve.engine_process import ProcessWorker

    if not 1 <= args.port < 65536:
        raise KilnError(f"--port must be in [1, 65535], got {args.port}")
    if not args.shutdown_timeout >= 0:
        raise KilnError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not Path(args.model).exists():  # before an engine process starts only to say so
        raise KilnError(
            f"{args.model} does not exist: give an HF checkpoint directory, a kiln model directory or a run"
        )
    template, special = chat_template_for(args.model, args.chat_template)
    config = ServeConfig(
        model_name=args.served_model_name or Path(args.model).resolve().name,
        api_key=args.api_key,
        chat_template=template,
        special_tokens=special,
        max_waiting=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes,
    )
    if args.stream_interval is not None:
        config = dataclasses.replace(config, stream_interval=args.stream_interval)
    engine_opts = dict(
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        memory_fraction=args.memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        decode_backend=args.decode_backend,
        warmup=not args.no_warmup,
    )
    # the engine loads the model in its own process while this one loads the tokenizer
    worker = ProcessWorker(args.model, engine_opts, config.max_waiting)
    try:
        tokenizer = load_tokenizer(args.model)
        worker.wait_ready()
    except BaseException:
        worker.stop(timeout=5)
        raise
    server = Server.over(worker, tokenizer, config)

    # uvicorn's own deadline is a backstop: by then the aborted requests have ended their responses
    uv = make_uvicorn_server(
        server.app,
        args.host,
        args.port,
        args.shutdown_timeout + 10,
        on_signal=lambda: server.begin_shutdown(args.shutdown_timeout),
    )
    chat = "chat template found" if template else "no chat template (chat completions answer 400)"
    print(
        f"kiln serve: {config.model_name!r} on http://{args.host}:{args.port} ({chat}; "
        f"{'API key required' if args.api_key else 'no API key'})",
        flush=True,
    )
    try:
        uv.run()
    finally:  # the lifespan stops the worker; this covers a uvicorn that failed before its lifespan ran
        worker.stop(timeout=5)
    if server.worker.error is not None:
        raise KilnError(f"the engine stopped: {server.worker.error}")
    print("kiln serve: stopped", flush=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve a model over OpenAI's API: POST /v1/completions, /v1/chat/completions; GET "
        "/v1/models, /health, /metrics. docs/serve.md describes the routes and the error semantics.",
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory, kiln model directory or run")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", help="the model name clients use (default: the directory name)")
    p.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's own)")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="sequences that may wait beyond --max-num-seqs running; more get 503 (default 256)",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit (default 4 MiB)")
    p.add_argument(
        "--stream-interval",
        type=float,
        default=None,
        help="a stream sends at most one chunk per this many seconds, with every token since the last "
        "(0: one per engine step; default 0.02, ServeConfig's)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGINT/SIGTERM before they are aborted (default 30)",
    )
    e = p.add_argument_group("engine")
    e.add_argument("--device", default="auto")
    e.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from free memory)")
    e.add_argument("--memory-fraction", type=float, default=0.9)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip tuning the attention kernels at start (faster start; the first steps of each new shape stall)",
    )
    e.add_argument(
        "--decode-backend",
        choices=("graphs", "compile", "eager"),
        default="graphs",
        help="decode steps on CUDA: CUDA graphs per batch bucket (default), torch.compile + graphs, or eager",
    )
    p.set_defaults(func=_serve)
