"""The engine's own logits for a prompt, read through the paged prefill."""

import torch

from nanovllm import LLM
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import Sequence, StepBatch
from nanovllm.scheduling.step import BlockTableUpdate, NewSlot


def prefill_logits(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, int]:
    """Logits of the uncached prompt positions (and where they start), via the paged prefill."""
    params = SamplingParams(temperature=0)
    seq = Sequence(-1, prompt, params)
    manager = llm.scheduler.block_manager
    start = manager.allocate(seq)
    assert start is not None
    try:
        n = len(prompt) - start
        batch = StepBatch(  # slot 0: the engine is idle, every slot is free
            slots=[0],
            num_tokens=[n],
            token_ids=prompt[start:],
            start_positions=[start],
            num_single_token_rows=int(n == 1),
            new_slots=[NewSlot(0, len(prompt), params)],
            block_table_updates=[BlockTableUpdate(0, 0, seq.block_table)],
        )
        runner = llm.executor.runner
        with torch.inference_mode():
            hidden = runner.forward(runner.inputs.build(batch))
            logits = runner.model.compute_logits(hidden)
        return logits.float().cpu(), start
    finally:
        manager.free(seq)
