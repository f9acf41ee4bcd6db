"""Prefill logits against HF transformers."""

import torch

from nanovllm import LLM
from tests.end_to_end.hf_oracle import hf_logits
from tests.end_to_end.prefill import prefill_logits


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
