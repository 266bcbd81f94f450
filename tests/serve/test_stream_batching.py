"""A stream that falls behind the engine takes the newest output per prompt (several tokens per chunk)."""

from __future__ import annotations

import asyncio
import itertools
import types

import pytest

from kiln.infer.engine import CompletionOutput, RequestOutput
from kiln.infer.sampling_params import SamplingParams
from kiln.serve.protocol import APIError
from kiln.serve.worker import RequestHandle


def _out(i: int, tokens: list[int], finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(0, "x" * len(tokens), tokens, "length" if finished else None)
    return RequestOutput(f"r-{i}", None, [1], [comp], finished)


def test_next_batch_keeps_the_newest_output_per_prompt():
    async def main():
        worker = types.SimpleNamespace(_handle_ids=itertools.count())
        h = RequestHandle(worker, [[1], [2]], SamplingParams(max_tokens=3), asyncio.get_running_loop(), True)
        for item in [
            (0, _out(0, [5])),
            (1, _out(1, [6])),
            (0, _out(0, [5, 7])),
            (0, _out(0, [5, 7, 8], True)),
        ]:
            h.outputs.put_nowait(item)
        batch = await h.next_batch()
        assert [(i, o.outputs[0].token_ids) for i, o in batch] == [(0, [5, 7, 8]), (1, [6])]
        assert h.finished == {0} and not h.done
        h.outputs.put_nowait((1, _out(1, [6, 9], True)))
        h.outputs.put_nowait(APIError(500, "the engine failed"))
        with pytest.raises(APIError):
            await h.next_batch()

    asyncio.run(main())
