"""The start-up's eager steps: every step size a kernel may pick its tiles by, within the limits."""

import pytest

from nanovllm import LLM
from nanovllm.config import Config, Platform
from nanovllm.execution.startup_steps import dummy_batch, prompt_rows, warm_up_lens

OPTIONS = dict(device="cpu", dtype="float32", kvcache_block_size=16)


def config(model: str, **options) -> Config:
    return Config.from_options(model, Platform(), **OPTIONS, **options)


def test_prompt_rows_fill_the_tokens_within_the_limits(qwen3_dir):
    limits = config(qwen3_dir, max_model_len=100, max_num_seqs=3, max_num_batched_tokens=512)
    assert prompt_rows(250, limits) == [100, 100, 50]
    assert prompt_rows(300, limits) == [100, 100, 100]
    assert prompt_rows(512, limits) == [100, 100, 100]  # no more rows than max_num_seqs
    assert prompt_rows(7, limits) == [7]


@pytest.mark.parametrize(
    "max_model_len, max_num_seqs, budget, ladder",
    [(256, 8, 1024, [64, 128, 256, 512]), (128, 2, 2048, [64, 128]), (64, 4, 64, [])],
)  # the second: the largest step is two rows of 128 tokens
def test_steps_of_each_power_of_two_below_the_largest(qwen3_dir, max_model_len, max_num_seqs, budget, ladder):
    limits = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    steps = warm_up_lens(config(qwen3_dir, **limits))
    assert steps[4] == ([1], 0)  # one token: the MoE alignment's one-program path, for one
    assert [sum(lens) for lens, _ in steps[5:]] == ladder  # after the five small steps
    for lens, prefix in steps:
        assert len(lens) <= max_num_seqs and all(0 < n and prefix + n <= max_model_len for n in lens)


@pytest.mark.parametrize("max_num_seqs", [1, 4])  # 1: the mixed steps cut to one row
def test_the_warm_up_steps_run(qwen3_dir, max_num_seqs):
    limits = dict(max_model_len=128, max_num_seqs=max_num_seqs, max_num_batched_tokens=512)
    with LLM(qwen3_dir, **OPTIONS, **limits) as llm:
        runner = llm.executor.runner
        for lens, prefix in warm_up_lens(runner.config):
            output = runner.run(dummy_batch(lens, runner.config.kvcache_block_size, prefix))
            assert len(output.sampled_token_ids) == len(lens)
