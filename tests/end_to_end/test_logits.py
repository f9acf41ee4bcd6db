"""Prefill logits against HF transformers, and the helpers the GPU tests reuse."""

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


def hf_logits(model_dir: str, prompt: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    with torch.no_grad():
        return model(torch.tensor([prompt], device=device)).logits[0].float().cpu()


def test_prefill_logits_match_hf_fp32(qwen3_dir, prompts):
    llm = LLM(
        qwen3_dir, device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=4
    )
    try:
        prompt = prompts[-1]
        ours, start = prefill_logits(llm, prompt)
        assert start == 0
        ref = hf_logits(qwen3_dir, prompt, torch.float32, "cpu")
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    finally:
        llm.exit()
