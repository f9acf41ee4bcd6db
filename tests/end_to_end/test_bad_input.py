"""Bad input gets a clear ValueError / FileNotFoundError, and the engine keeps working."""

import json
import os

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import write_config
from tests.checkpoints import TINY_QWEN3

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=64, kvcache_block_size=16, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, **OPTIONS)
    yield engine
    engine.exit()


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    write_config(str(tmp_path), num_hidden_layers=1)
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")


def test_missing_weights(tmp_path):
    write_config(str(tmp_path), **TINY_QWEN3)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path), device="cpu", max_model_len=64)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(tensor_parallel_size=3), "divide"),
        (dict(kvcache_block_size=24), "power of two"),
        (dict(dtype="int8"), "dtype"),
        (dict(attention_backend="magic"), "attention_backend"),
        (dict(num_kvcache_blocks=2), "KV cache holds 32 tokens"),
        (dict(kv_cache_memory_gb=1e-6), "KV cache holds"),
        (dict(bogus_option=1), "unknown LLM options"),
        (dict(max_num_seqs=0), "max_num_seqs"),
    ],
)
def test_bad_engine_options(qwen3_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_dir, **{**OPTIONS, **options})


@pytest.mark.parametrize(
    "prompts, match",
    [
        ([[1, 2, 3], []], "prompt 1 is empty"),
        ([[1, 2, 3], list(range(3, 3 + 65))], "more than max_model_len=64"),
        ([[1, 2, 512]], "outside the vocabulary"),
        ([[1, -1]], "outside the vocabulary"),
        ([[1, 2], [1.5, 2]], TypeError("prompt 1: token ids must be ints")),
        ([[1, 2], {"prompt_ids": [1]}], "prompt 1: unknown keys"),
    ],
)
def test_bad_prompts_fail_whole_call_before_work(llm, prompts, match):
    error = type(match) if isinstance(match, Exception) else ValueError
    with pytest.raises(error, match=str(match)):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.is_finished()  # nothing was queued
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4


@pytest.mark.parametrize(
    "params, match",
    [
        (SamplingParams(logprobs=513), "logprobs=513 is more than the vocabulary's 512 tokens"),
        (SamplingParams(prompt_logprobs=10**6), "prompt_logprobs=1000000 is more than the vocabulary"),
        (SamplingParams(allowed_token_ids=[2], min_tokens=3), "leave no token to sample"),
        (SamplingParams(allowed_token_ids=[5, 7], stop_token_ids=[5, 7], min_tokens=1), "leave no token"),
    ],
)
def test_sampling_params_the_model_cannot_serve_fail_before_work(llm, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3], [4, 5]], [GREEDY, params], use_tqdm=False)
    assert llm.is_finished()  # nothing was queued
    # the same constraints are fine where they leave a token: EOS ignored, or a token not held back
    ok = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[2, 9], min_tokens=3)
    out = llm.generate([[1, 2, 3]], ok, use_tqdm=False)[0]
    assert out.outputs[0].token_ids[:3] == [9, 9, 9]


def test_sampling_params_list_length(llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        llm.generate([[1], [2], [3]], [GREEDY, GREEDY], use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_string_prompt_without_tokenizer(tmp_path, qwen3_dir):
    for name in os.listdir(qwen3_dir):
        if not name.startswith("tokenizer"):
            os.symlink(os.path.join(qwen3_dir, name), tmp_path / name)
    engine = LLM(str(tmp_path), **OPTIONS)
    try:
        with pytest.raises(ValueError, match="no tokenizer"):
            engine.generate(["hello"], GREEDY, use_tqdm=False)
        assert engine.generate([[5, 6]], GREEDY, use_tqdm=False)[0]["text"] == ""
    finally:
        engine.exit()
