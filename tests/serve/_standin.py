"""An engine that paces its steps like a GPU without computing anything: the real LLMEngine (scheduler,
block manager, detokenizer, outputs), whose model step is a sleep of `step_s` + `per_token_s` per scheduled
token and whose sampled token is `token` for every sequence (greedy: every sampling row's id).

It lets the CPU machine load the server as an H200 run does: hundreds of requests streaming at one token
per ~6-8 ms step (`step_s=0.006, per_token_s=5.5e-6` gives the H200's Qwen2.5-1.5B pace: 256-way decode
steps of ~7.4 ms, 8192-token prefill steps of ~51 ms). What it does not model: the model's numbers (every
token is the same; requests must be greedy, EOS is never sampled unless `token` is EOS) and the host time
the real runner spends preparing a step. The sleep releases the GIL, as a CUDA wait does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kiln.infer.engine import LLM
from kiln.infer.runner import StepOutput
from kiln.infer.scheduler import ScheduledBatch


def standin_engine(
    path: Path, step_s: float = 0.006, per_token_s: float = 5.5e-6, token: int = 100, **engine
) -> LLM:
    """LLM(path) on the CPU whose runner sleeps instead of running the model (module docstring)."""
    llm = LLM(str(path), log=None, **{"device": "cpu", **engine})
    runner = llm.engine.runner

    def execute(batch: ScheduledBatch, feed=None) -> StepOutput:
        time.sleep(step_s + per_token_s * batch.num_tokens)
        rows = len(batch.sampling_seqs)
        ids = torch.full((rows,), token, dtype=torch.int64)
        return StepOutput(logits=None, greedy_ids=ids if rows else None)

    runner.execute = execute  # this instance only
    return llm


def standin_engine_main(model: str, engine: dict, engine_log: bool, commands, conn) -> None:
    """engine_process._engine_main with the stand-in engine (default pace) in place of LLM: the target of
    a ProcessWorker made by `standin_process_worker`. This runs in the engine's own (spawned) process,
    so replacing the name `LLM` in kiln.infer.engine changes nothing outside it."""
    import kiln.infer.engine as infer_engine
    from kiln.serve import engine_process

    def build(path, log=None, **kw):
        return standin_engine(Path(path), **kw)

    infer_engine.LLM = build
    engine_process._engine_main(model, engine, engine_log, commands, conn)


def standin_process_worker(path: Path, engine: dict, max_waiting: int, log=print):
    """A ProcessWorker (kiln serve's transport) whose engine process runs the stand-in engine."""
    from kiln.serve import engine_process

    real = engine_process._engine_main
    engine_process._engine_main = standin_engine_main  # read once, by ProcessWorker.__init__ below
    try:
        return engine_process.ProcessWorker(str(path), engine, max_waiting, log=log, engine_log=False)
    finally:
        engine_process._engine_main = real
