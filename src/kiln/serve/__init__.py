"""kiln's OpenAI-compatible HTTP server on the inference engine (docs/serve.md): `kiln serve --model PATH`.

    protocol.py   request bodies (validated), OpenAI's error shape
    responses.py  response bodies, stream chunks (text deltas), usage, logprobs
    worker.py     the engine's own thread; admission bound (503)
    metrics.py    Prometheus metrics
    app.py        the FastAPI app: routes, auth, body limit, SSE, disconnects
    cli.py        `kiln serve` on uvicorn, graceful shutdown

In Python: `kiln.serve.app.build_app(LLM(path).engine, ServeConfig(model_name="m"))` is an ASGI app.
"""
