"""kiln's OpenAI-compatible HTTP server on the inference engine (docs/serve.md): `kiln serve --model PATH`.

    protocol.py   request bodies (validated), OpenAI's error shape
    responses.py  response bodies, stream chunks (text deltas), usage, logprobs
    engine_loop.py  the loop that owns the engine (commands in, one event per step out), any transport
    worker.py     admission bound (503), request handles, delivery and latency metrics; the thread transport
    engine_process.py  the process transport (`kiln serve`): the engine in a spawned child process
    deltas.py     what crosses the pipe per step: each output's change, rebuilt into cumulative outputs
    metrics.py    Prometheus metrics
    app.py        the FastAPI app: routes, auth, body limit, SSE, disconnects
    cli.py        `kiln serve` on uvicorn (the engine in its own process), graceful shutdown

In Python: `kiln.serve.app.build_app(LLM(path).engine, ServeConfig(model_name="m"))` is an ASGI app (the
engine in a thread of this process).
"""
