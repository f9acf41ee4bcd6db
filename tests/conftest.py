"""Shared fixtures: tiny random checkpoints and the Hugging Face greedy oracle."""

import random

import pytest
import torch

from tests.checkpoints import make_random_checkpoint


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    return make_random_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "Qwen3ForCausalLM", seed=0)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("qwen2")), "Qwen2ForCausalLM", seed=1, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Mixed lengths: shorter than a block, around block boundaries, several blocks."""
    rng = random.Random(0)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 17, 40, 63, 100)]


def hf_greedy(
    model_dir: str, prompts: list[list[int]], max_new_tokens: int, attn_implementation: str | None = None
) -> list[list[int]]:
    """Greedy completions from transformers ``generate`` in fp32, EOS ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.generation_config.eos_token_id = None  # otherwise generate falls back to the model's EOS
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), generation_config=config)
            outs.append(out[0, len(p) :].tolist())
    return outs


_hf_cache: dict = {}


@pytest.fixture(scope="session")
def hf_reference():
    """``hf_reference(model_dir, prompts, n)``, memoised across tests."""

    def get(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        key = (model_dir, tuple(map(tuple, prompts)), max_new_tokens)
        if key not in _hf_cache:
            _hf_cache[key] = hf_greedy(model_dir, prompts, max_new_tokens)
        return _hf_cache[key]

    return get
