"""Each dense architecture of the registry against HF on a tiny random checkpoint built by
transformers itself: greedy token for token, with chunked prefill and prefix-cache hits, and
with tensor parallelism (gloo)."""

import pytest

from nanovllm import LLM, SamplingParams
from tests.checkpoints import make_random_checkpoint

GREEDY = SamplingParams(0.0, 20, True)
BASE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, kvcache_block_size=16)
CHECKPOINTS = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "llama-3.2": (
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    "qwen2.5": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # Qwen2.5's class, with q/k/v biases
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def model_dir(request, tmp_path_factory) -> str:
    architecture, overrides = CHECKPOINTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    return make_random_checkpoint(path, architecture, seed=3, **overrides)


def generate(model_dir: str, prompts, **options) -> list[list[int]]:
    with LLM(model_dir, **{**BASE, **options}) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        again = [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]  # prefix-cache hits
        assert llm.scheduler.block_manager.hash_to_block
    assert first == again
    return first


def test_greedy_matches_hf_chunked_and_cached(model_dir, prompts, hf_reference):
    assert generate(model_dir, prompts, max_num_batched_tokens=24) == hf_reference(model_dir, prompts, 20)


def test_tensor_parallel_matches_hf(model_dir, prompts, hf_reference):
    batch = prompts[2:6]
    assert generate(model_dir, batch, tensor_parallel_size=2) == hf_reference(model_dir, batch, 20)
