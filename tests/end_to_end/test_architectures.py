"""Each dense architecture of the registry against HF on a tiny random checkpoint built by
transformers itself: greedy token for token, with chunked prefill and prefix-cache hits, and
with tensor parallelism (gloo)."""

import pytest

from nanovllm import SamplingParams
from tests.checkpoints import make_random_checkpoint
from tests.end_to_end.cached_twice import generate_twice

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


def test_greedy_matches_hf_chunked_and_cached(model_dir, prompts, hf_reference):
    ours = generate_twice(model_dir, prompts, GREEDY, dict(BASE, max_num_batched_tokens=24))
    assert ours == hf_reference(model_dir, prompts, 20)


def test_tensor_parallel_matches_hf(model_dir, prompts, hf_reference):
    batch = prompts[2:6]
    ours = generate_twice(model_dir, batch, GREEDY, dict(BASE, tensor_parallel_size=2))
    assert ours == hf_reference(model_dir, batch, 20)
