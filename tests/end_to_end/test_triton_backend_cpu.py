"""The engine through our Triton kernels, on CPU under the Triton interpreter, against HF."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

RUN = textwrap.dedent("""
    import json, sys
    from nanovllm import LLM, SamplingParams
    model_dir, prompts, padded = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "padded"
    llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=16,
              max_model_len=128, max_num_batched_tokens=24, max_num_seqs=8)
    if padded:  # decode steps padded and read from fixed addresses, as by CUDA graphs, run eagerly
        runner = llm.executor.runner
        runner.graphs = runner._capture_decode_graphs(capture=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # served from the prefix cache
    print(json.dumps([[o["token_ids"] for o in first], [o["token_ids"] for o in again]]))
    llm.exit()
""")


@pytest.mark.parametrize("decode", ["plain", "padded"])
def test_triton_backend_matches_hf_under_interpreter(qwen3_dir, prompts, hf_reference, decode):
    # chunked prefill (budget 24), prefixes not on block boundaries, decode across a block edge;
    # padded: decode steps of 1-3 rows padded to 1, 2 and 4 rows (the graphs' sizes)
    batch = [prompts[1], prompts[3], prompts[4]]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", RUN, qwen3_dir, json.dumps(batch), decode],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    first, again = json.loads(res.stdout.strip().splitlines()[-1])
    expected = hf_reference(qwen3_dir, batch, 6)
    assert first == expected
    assert again == expected
