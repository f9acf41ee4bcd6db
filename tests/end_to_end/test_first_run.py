"""A warm engine compiles nothing: after ``LLM()`` and one short generate (bench.py's warm-up),
a first run of prompts it has not seen (every step shape: prompt chunks of any length, mixed with
decodes, decode batches of every size) compiles no Triton kernel variant and no torch.compile
graph; a compile in a run is paid for by the step that meets it."""

import random

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.compiled import compiled_variants, dynamo_graphs, triton_kernels


def varied_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 300))] for _ in range(48)]
    lengths = [rng.randint(1, 48) for _ in prompts]
    return prompts, [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in lengths]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_nothing_compiles_after_the_warm_up_generate(qwen3_dir, quantization):
    kernels = triton_kernels()
    # a small token budget: prompts chunked, steps of many sizes, decodes mixed in
    options = dict(device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=16)
    options.update(max_num_batched_tokens=160)
    with LLM(qwen3_dir, quantization=quantization, **options) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
        variants, graphs = compiled_variants(kernels), dynamo_graphs()
        for seed in (0, 1):
            llm.generate(*varied_workload(seed), use_tqdm=False)
        after = compiled_variants(kernels)
    new = {name: sorted(after[name] - variants[name])[:2] for name in after if after[name] - variants[name]}
    assert not new, f"compiled during the run: {new}"
    assert dynamo_graphs() == graphs
