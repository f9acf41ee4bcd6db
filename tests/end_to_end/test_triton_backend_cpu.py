"""The engine through our Triton kernels, on CPU under the Triton interpreter, against HF."""

import json
import os
import subprocess
import sys
import textwrap

RUN = textwrap.dedent("""
    import json, sys
    from nanovllm import LLM, SamplingParams
    model_dir, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model_dir, device="cpu", dtype="float32", attention_backend="triton", kvcache_block_size=16,
              max_model_len=128, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)  # served from the prefix cache
    print(json.dumps([[o["token_ids"] for o in first], [o["token_ids"] for o in again]]))
    llm.exit()
""")


def test_triton_backend_matches_hf_under_interpreter(qwen3_dir, prompts, hf_reference):
    # chunked prefill (budget 24), prefixes not on block boundaries, decode across a block edge
    batch = [prompts[1], prompts[3], prompts[4]]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", RUN, qwen3_dir, json.dumps(batch)],
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
