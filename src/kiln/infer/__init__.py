"""kiln's inference engine: paged KV cache, continuous batching, per-request sampling (docs/inference.md).

from kiln.infer import LLM, SamplingParams
llm = LLM("path/to/model"); outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from kiln.infer.block_manager import BlockManager
from kiln.infer.config import EngineConfig
from kiln.infer.engine import LLM, CompletionOutput, LLMEngine, RequestOutput
from kiln.infer.sampler import Sampler, SamplerOutput, SamplingTensors
from kiln.infer.sampling_params import SamplingParams
from kiln.infer.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kiln.infer.sequence import Sequence, SequenceStatus

__all__ = [
    "LLM",
    "BlockManager",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingTensors",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]
