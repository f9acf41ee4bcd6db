"""A prompt step carries only its sampled rows through the last layer's attention: every token's K
and V are cached, the other rows' queries, o projection and MLP there are skipped. Same tokens as HF."""

import pytest

from nanovllm import LLM, SamplingParams


def rows_seen(llm: LLM) -> list[list[int]]:
    """Per forward pass: the rows into the first layer's o projection, the last layer's, and the LM head."""
    model = llm.executor.runner.model
    first, last = model.model.layers[0].self_attn.o_proj, model.model.layers[-1].self_attn.o_proj
    seen: list[list[int]] = []
    first.register_forward_pre_hook(lambda _, args: seen.append([len(args[0])]))
    last.register_forward_pre_hook(lambda _, args: seen[-1].append(len(args[0])))
    model.lm_head.register_forward_pre_hook(lambda _, args: seen[-1].append(len(args[0])))
    return seen


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 20}], ids=["whole_prompts", "chunked"])
def test_prompt_steps_carry_only_sampled_rows_past_attention(qwen3_dir, prompts, hf_reference, options):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256, **options)
    try:
        seen = rows_seen(llm)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(prompts, greedy, use_tqdm=False)
    finally:
        llm.exit()
    assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 6)
    assert all(last == head for _, last, head in seen)
    assert any(tokens > last for tokens, last, _ in seen)  # prompt steps were pruned


def test_prompt_logprobs_keep_every_row(qwen3_dir, prompts):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256)
    try:
        seen = rows_seen(llm)
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
        out = llm.generate([prompts[4]], params, use_tqdm=False)[0]
    finally:
        llm.exit()
    assert len(out.prompt_logprobs) == len(prompts[4])
    tokens, last = seen[0][:2]  # then the LM head's calls for the prompt's logprobs and the sample
    assert tokens == last == len(prompts[4])


def test_the_last_layer_attends_only_each_rows_last_token(qwen3_dir, prompts, hf_reference):
    # in prompt steps the last layer's attention runs in decode form, one query a row against its
    # whole context (cached prefix, earlier chunks, this step's tokens), and no prompt attention
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", kvcache_block_size=16, max_model_len=256,
              max_num_batched_tokens=48, enable_prefix_caching=True)  # fmt: skip
    try:
        model = llm.executor.runner.model
        attn = model.model.layers[-1].self_attn.attn
        backend = attn.backend
        steps: list[tuple[list, list]] = []  # per forward pass: the last layer's attention, LM head rows
        inside = []

        def enter(*_):
            inside.append(True)
            steps.append(([], []))

        attn.register_forward_pre_hook(enter)
        attn.register_forward_hook(lambda *_: inside.clear())
        for name in ("prefill", "decode", "prepare_and_decode"):
            method = getattr(backend, name)

            def spy(q, *args, name=name, method=method, **kwargs):
                if inside:
                    steps[-1][0].append((name, len(q)))
                return method(q, *args, **kwargs)

            setattr(backend, name, spy)
        model.lm_head.register_forward_pre_hook(lambda _, args: steps[-1][1].append(len(args[0])))
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        outs = llm.generate(prompts + prompts[4:], greedy, use_tqdm=False)  # the repeats hit the cache
    finally:
        llm.exit()
    assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts + prompts[4:], 4)
    for calls, [rows] in steps:
        assert calls and all(name != "prefill" and n == rows for name, n in calls)
    assert sum(("prepare_and_decode", rows) not in calls for calls, [rows] in steps) > 1  # prompt steps
