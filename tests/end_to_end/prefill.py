"""The engine's own logits for a prompt, read through the paged prefill."""

import torch

from nanovllm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import ScheduledStep, Sequence


def prefill_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of the uncached prompt positions (and where they start), via the paged prefill."""
    seq = Sequence(-1, prompt, SamplingParams(temperature=0))
    manager = llm.scheduler.block_manager
    assert manager.allocate(seq)
    try:
        start = seq.num_computed_tokens
        seq.row = 0  # the engine is idle: every row is free
        runner = llm.executor.runner
        with torch.inference_mode():
            inputs = runner.inputs.build(
                ScheduledStep.plan([], [], [(seq, start, len(prompt) - start)]).batch, with_sampling=False
            )
            hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
            logits = runner.model.compute_logits(hidden)
        return logits.float().cpu(), start
    finally:
        manager.free(seq)
