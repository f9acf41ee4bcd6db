"""Rope scaling: our frequency tables against Hugging Face's rope initialisation, and greedy
generation past the original context against HF for each implemented type (CPU).

Dynamic scaling rotates each token by its sequence's length as HF's ``generate`` sees it:
a prompt by its whole length, a generated token by its position + 1. HF keeps the last
length's frequencies between calls, so its references come one prompt per model load."""

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nanovllm import LLM, SamplingParams
from nanovllm.layers.rotary_embedding import RotaryEmbedding, inv_freq_and_attention_factor
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


DYNAMIC_CONTEXT = 64  # max_position_embeddings; factor 4 serves 256 positions
DYNAMIC = dict(rope_type="dynamic", factor=4.0)
GREEDY = SamplingParams(0.0, 40, True)
TEXT = [(i * 37 + 11) % 500 for i in range(120)]
SHORT, LONG, LONGER = TEXT[:40], TEXT[:100], TEXT[:120]  # one prefix; SHORT generates past 64


def test_dynamic_frequencies_match_hf_at_each_length():
    config = hf_config("LlamaForCausalLM", DYNAMIC, DYNAMIC_CONTEXT)
    init_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")
    theta, scaling = rope_settings(config)
    assert torch.equal(inv_freq_and_attention_factor(HEAD_DIM, theta, scaling, DYNAMIC_CONTEXT)[0], init_freq)
    rope = RotaryEmbedding(HEAD_DIM, 4 * DYNAMIC_CONTEXT, theta, scaling, DYNAMIC_CONTEXT)
    lengths = torch.tensor([1, 40, 64, 64, 65, 100, 100, 256])
    positions = torch.tensor([0, 39, 10, 63, 64, 0, 99, 255])
    rows = rope.cos_sin_rows(positions, lengths)
    for row, position, length in zip(rows, positions, lengths):
        # a tensor length, as HF's forward passes it: its fp32 arithmetic
        freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=length)
        angles = position * freq
        torch.testing.assert_close(row, torch.cat([angles.cos(), angles.sin()]), rtol=0, atol=1e-5)
    longer = lengths > DYNAMIC_CONTEXT
    assert torch.equal(rows[~longer], rope.cos_sin_cache[positions[~longer]])
    for row, position in zip(rows[longer], positions[longer]):
        if position:  # (position 0 turns by no angle at any frequency)
            assert not torch.allclose(row, rope.cos_sin_cache[position])


@pytest.fixture(scope="module")
def dynamic_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dynamic"))
    rope = {"rope_theta": 10000.0, **DYNAMIC}
    return make_random_checkpoint(
        path, "LlamaForCausalLM", max_position_embeddings=DYNAMIC_CONTEXT, rope_parameters=rope
    )


def dynamic_llm(path: str, **options) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, **options)


def hf_each(hf_reference, path: str, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_reference(path, [p], GREEDY.max_tokens)[0] for p in prompts]


@pytest.mark.parametrize("budget", [16384, 16, 2], ids=["whole", "chunks-of-16", "one-token-chunks"])
def test_dynamic_greedy_matches_hf(dynamic_dir, hf_reference, budget):
    """Prompts shorter and longer than the original context; chunked, a prompt still turns
    on its whole length (with a budget of 2, as one-token chunks beside a decode)."""
    prompts = [SHORT, LONG, LONGER]
    with dynamic_llm(dynamic_dir, max_num_batched_tokens=budget) as llm:
        got = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_each(hf_reference, dynamic_dir, prompts)


def test_dynamic_prefix_cache_shares_only_prompts_within_the_original_context(dynamic_dir, hf_reference):
    """A prompt past the original context is rotated by its own length: LONGER must not take
    LONG's blocks (nor LONG its own); SHORT hits its own from the first call."""
    with dynamic_llm(dynamic_dir) as llm:
        first = llm.generate([SHORT, LONG], GREEDY, use_tqdm=False)
        second = llm.generate([SHORT, LONG, LONGER], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in second] == [32, 0, 0]
    got = [o["token_ids"] for o in first + second]
    assert got == hf_each(hf_reference, dynamic_dir, [SHORT, LONG, SHORT, LONG, LONGER])


def test_dynamic_recomputation_after_preemption_matches_hf(dynamic_dir, hf_reference):
    prompts = [LONG, LONGER, SHORT]
    with dynamic_llm(dynamic_dir, num_kvcache_blocks=16) as llm:  # 256 tokens: not all three
        got = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.scheduler.num_preemptions > 0
    assert got == hf_each(hf_reference, dynamic_dir, prompts)
