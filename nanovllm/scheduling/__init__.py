"""The resource layer: sequences, KV blocks and the scheduler that plans each step. No torch."""

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler
from nanovllm.scheduling.sequence import Sequence, SequenceStatus
from nanovllm.scheduling.step import ScheduledStep, StepBatch, StepOutput, TokenLogprobs

__all__ = [
    "BlockManager",
    "ScheduledStep",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "StepBatch",
    "StepOutput",
    "TokenLogprobs",
]
