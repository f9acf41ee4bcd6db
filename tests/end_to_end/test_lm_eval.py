"""lm-evaluation-harness's vLLM backend runs on nanovllm unchanged, through a ``vllm`` package
that maps vLLM's import paths and nothing else (``tests/lm_eval_alias``), and scores as
lm-eval's Hugging Face backend does on the same checkpoint (CPU, fp32)."""

import os
import sys

import pytest

ALIAS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "lm_eval_alias")
CONTEXTS = ["Hello there", "The quick brown fox", "Nano-vLLM is", "introduce yourself"]
CONTINUATIONS = [" general Kenobi", " jumps over", " small", " please"]


@pytest.fixture(scope="module")
def backends(qwen3_dir):
    sys.path.insert(0, ALIAS)
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.huggingface import HFLM
        from lm_eval.models.vllm_causallms import VLLM

        ours = VLLM(pretrained=qwen3_dir, dtype="float32", max_model_len=256, max_gen_toks=12)
        hf = HFLM(pretrained=qwen3_dir, dtype="float32", device="cpu", batch_size=4)
        yield Instance, ours, hf
        ours.model.exit()
    finally:
        sys.path.remove(ALIAS)
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


def test_loglikelihoods_equal_hf(backends):
    Instance, ours, hf = backends
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(zip(CONTEXTS, CONTINUATIONS))]
    got, want = ours.loglikelihood(requests), hf.loglikelihood(requests)
    assert [greedy for _, greedy in got] == [greedy for _, greedy in want]
    assert [value for value, _ in got] == pytest.approx([value for value, _ in want], abs=5e-5)


def test_greedy_generations_equal_hf(backends):
    Instance, ours, hf = backends
    until = {"until": ["\n\n"], "do_sample": False, "max_gen_toks": 12}
    requests = [Instance("generate_until", {}, (context, until), i) for i, context in enumerate(CONTEXTS)]
    texts = ours.generate_until(requests)
    assert texts == hf.generate_until(requests) and all(texts)
