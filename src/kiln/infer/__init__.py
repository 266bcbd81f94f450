"""The inference engine's core: requests, the KV block manager, the scheduler and the sampler.

from kiln.infer import SamplingParams, Sequence, BlockManager, Scheduler, SchedulerConfig, Sampler
"""

from kiln.infer.block_manager import BlockManager
from kiln.infer.sampler import Sampler, SamplerOutput, SamplingTensors
from kiln.infer.sampling_params import SamplingParams
from kiln.infer.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kiln.infer.sequence import Sequence, SequenceStatus

__all__ = [
    "BlockManager",
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
