"""Rope scaling: our frequency tables against Hugging Face's rope initialisation, and greedy
generation past the original context against HF for each implemented type (CPU)."""

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import inv_freq_and_attention_factor
from nanovllm.models.registry import rope_settings
from tests.checkpoints import make_random_checkpoint

HEAD_DIM = 16
SCALINGS = {
    "linear": dict(rope_type="linear", factor=4.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "yarn-mscale": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=16,
                        beta_slow=2, mscale=0.9, mscale_all_dim=0.5),
}  # fmt: skip


def hf_config(architecture: str, scaling: dict, max_position: int = 256):
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    return AutoConfig.for_model(
        model_type, hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=max_position, rope_parameters={"rope_theta": 10000.0, **scaling},
    )  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_frequencies_match_hf(name):
    config = hf_config("LlamaForCausalLM", SCALINGS[name])
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](config, "cpu")
    theta, scaling = rope_settings(config)
    freq, factor = inv_freq_and_attention_factor(HEAD_DIM, theta, scaling, config.max_position_embeddings)
    torch.testing.assert_close(freq, want_freq.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-9)
    assert not torch.equal(freq, inv_freq_and_attention_factor(HEAD_DIM, theta, {}, 256)[0])


CASES = [  # (architecture, scaling, max_position_embeddings, tie_word_embeddings)
    ("LlamaForCausalLM", "llama3", 256, True),  # Llama 3.2: tied embeddings
    ("LlamaForCausalLM", "linear", 64, False),  # positions past 64 are in the scaled context
    ("Qwen3ForCausalLM", "yarn", 256, False),
    ("Qwen3ForCausalLM", "yarn-mscale", 256, False),
]


@pytest.mark.parametrize("architecture, name, max_position, tied", CASES)
def test_greedy_past_the_original_context_matches_hf(
    tmp_path, hf_reference, architecture, name, max_position, tied
):
    path = make_random_checkpoint(
        str(tmp_path), architecture, max_position_embeddings=max_position, tie_word_embeddings=tied,
        rope_parameters={"rope_theta": 10000.0, **SCALINGS[name]},
    )  # fmt: skip
    prompt = [(i * 37 + 11) % 500 for i in range(90)]  # past every original context above
    want = hf_reference(path, [prompt], 40)[0]
    with LLM(path, device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16) as llm:
        got = llm.generate([prompt], SamplingParams(0.0, 40, True), use_tqdm=False)[0]["token_ids"]
    assert got == want
