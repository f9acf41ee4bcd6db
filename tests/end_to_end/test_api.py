"""The vLLM-style API: RequestOutput, the prompt forms vLLM takes, n samples, stop strings and
stop ids, detokenize, and streaming with cancellation (CPU, tiny checkpoint, HF as oracle)."""

import numpy as np
import pytest
import torch

from nanovllm import LLM, CompletionOutput, RequestOutput, SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=96, kvcache_block_size=16, max_num_seqs=8)
PROMPT = [7, 300, 42, 19, 250, 3, 88, 121, 64, 5, 400, 17, 230, 9, 31, 77, 150]


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(0.0, max_tokens, True, **kw)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, **OPTIONS)
    yield engine
    engine.exit()


def test_request_output_fields_and_dict_access(llm, qwen3_dir, hf_reference):
    text = llm.get_tokenizer().decode(PROMPT)
    out = llm.generate([text, PROMPT], greedy(), use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in out)
    assert [o.prompt for o in out] == [text, None]
    want = hf_reference(qwen3_dir, [out[0].prompt_token_ids], 24)[0]
    first = out[0].outputs[0]
    assert isinstance(first, CompletionOutput) and first.index == 0
    assert first.token_ids == want and first.finish_reason == "length" and first.stop_reason is None
    assert first.text == llm.get_tokenizer().decode(want, skip_special_tokens=True)
    assert out[0].finished and out[0]["token_ids"] == want and out[0]["text"] == first.text
    assert out[1].prompt_token_ids == PROMPT
    assert out[1]["token_ids"] == hf_reference(qwen3_dir, [PROMPT], 24)[0]
    assert len({o.request_id for o in out}) == 2


def test_prompt_forms_give_the_same_completion(llm, qwen3_dir, hf_reference):
    forms = [PROMPT, {"prompt_token_ids": PROMPT}, tuple(PROMPT)]
    outs = llm.generate([PROMPT], greedy(), use_tqdm=False) + llm.generate(forms[1], greedy(), use_tqdm=False)
    outs += llm.generate([forms[2]], greedy(), use_tqdm=False)
    assert {tuple(o["token_ids"]) for o in outs} == {tuple(hf_reference(qwen3_dir, [PROMPT], 24)[0])}
    text = llm.get_tokenizer().decode(PROMPT)
    by_text = llm.generate([{"prompt": text}, text], greedy(), use_tqdm=False)
    want = hf_reference(qwen3_dir, [llm.get_tokenizer().encode(text)], 24)[0]
    assert by_text[0]["token_ids"] == by_text[1]["token_ids"] == want


@pytest.mark.parametrize(
    "prompts, error, match",
    [
        (np.array([1, 2, 3]), TypeError, "got ndarray"),
        (torch.tensor([1, 2, 3]), TypeError, "got Tensor"),
        ((p for p in [[1, 2]]), TypeError, "got generator"),
        (None, TypeError, "got NoneType"),
        ([[1, 2], None], TypeError, "prompt 1"),
        ([[1, 2], [True, 3]], TypeError, "prompt 1: token ids must be ints, got True"),
        ([[1, 2], np.array([1, 2])], TypeError, "prompt 1"),
        ([{"prompt": "a", "images": []}], ValueError, "prompt 0: unknown keys"),
        ([{"prompt": 5}], TypeError, "prompt 0"),
        ([{"prompt_token_ids": "abc"}], TypeError, "prompt 0"),
    ],
)
def test_bad_prompt_forms_name_the_prompt(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.is_finished()


def test_n_greedy_samples_all_equal_hf(llm, qwen3_dir, hf_reference):
    out = llm.generate([PROMPT], greedy(12, n=3), use_tqdm=False)[0]
    want = hf_reference(qwen3_dir, [PROMPT], 12)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == want for c in out.outputs)


def test_n_seeded_samples_differ_and_reproduce(llm):
    params = SamplingParams(1.0, 16, True, n=4, seed=123)
    first = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    single = llm.generate([PROMPT], SamplingParams(1.0, 16, True, seed=123), use_tqdm=False)[0]
    assert single["token_ids"] == first[0]  # sample 0 keeps the request's own seed


def test_stop_token_ids_end_with_the_id_kept(llm):
    full = llm.generate([PROMPT], greedy(), use_tqdm=False)[0]["token_ids"]
    stop_id = full[5]
    cut = full.index(stop_id) + 1
    out = llm.generate([PROMPT], greedy(stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id


def _boundary_stop(tokenizer, token_ids: list[int]) -> tuple[str, str]:
    """The full text, and a stop string that starts inside one token's text and ends inside
    a later one's."""
    ends = [len(tokenizer.decode(token_ids[:m])) for m in range(len(token_ids) + 1)]
    for j in range(4, len(token_ids) - 1):
        if ends[j] - ends[j - 1] >= 2 and ends[j + 1] - ends[j] >= 2:
            text = tokenizer.decode(token_ids)
            return text, text[ends[j] - 1 : ends[j] + 1]
    pytest.fail("no two consecutive multi-character tokens in this completion: pick another prompt")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_stop_string_cuts_where_the_text_first_contains_it(qwen3_dir, include, async_scheduling):
    with LLM(qwen3_dir, **OPTIONS, async_scheduling=async_scheduling) as llm:
        tok = llm.get_tokenizer()
        full = llm.generate([PROMPT], greedy(40), use_tqdm=False)[0]
        text, stop = _boundary_stop(tok, full["token_ids"])
        params = greedy(40, stop=["never-in-this-text", stop], include_stop_str_in_output=include)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        first = text.find(stop)
        assert out.text == text[: first + len(stop) if include else first]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        # generation ends at the token whose text completes the stop string
        n = len(out.token_ids)
        assert out.token_ids == full["token_ids"][:n]
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
        assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([PROMPT], SamplingParams(0.0, None, True), use_tqdm=False)[0].outputs[0]
    assert len(PROMPT) + len(out.token_ids) == OPTIONS["max_model_len"] and out.finish_reason == "length"


def test_detokenize_false_leaves_text_empty(llm):
    out = llm.generate([PROMPT], greedy(8, detokenize=False), use_tqdm=False)[0]
    assert out["text"] == "" and len(out["token_ids"]) == 8


@pytest.mark.parametrize(
    "params",
    [greedy(stop_token_ids=[10**6]), greedy(allowed_token_ids=[3, 512]), greedy(logit_bias={600: 1.0})],
)
def test_token_ids_in_params_are_checked_against_the_vocabulary(llm, params):
    with pytest.raises(ValueError, match="sampling params of prompt 1 name token ids outside the vocabulary"):
        llm.generate([PROMPT, PROMPT], [greedy(), params], use_tqdm=False)
    assert llm.is_finished()


def test_stream_yields_growing_outputs_then_the_final_one(llm):
    prompts = [PROMPT, PROMPT[:5]]
    params = [greedy(10), greedy(6)]
    want = llm.generate(prompts, params, use_tqdm=False)
    seen: dict[str, list[RequestOutput]] = {}
    for out in llm.stream(prompts, params):
        seen.setdefault(out.prompt_token_ids.__repr__(), []).append(out)
    for w in want:
        outs = seen[w.prompt_token_ids.__repr__()]
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and lengths[-1] == len(w["token_ids"])
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1]["token_ids"] == w["token_ids"] and outs[-1]["text"] == w["text"]


def test_closing_a_stream_early_cancels_the_rest(llm):
    stream = llm.stream([PROMPT, PROMPT[:9]], greedy(30))
    first = next(stream)
    assert not first.finished
    with pytest.raises(RuntimeError, match="one call at a time"):
        llm.generate([PROMPT], greedy(), use_tqdm=False)
    stream.close()
    assert llm.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    assert len(llm.generate([PROMPT], greedy(), use_tqdm=False)[0]["token_ids"]) == 24


CONVERSATION = [{"role": "user", "content": "The quick brown fox"}]


def test_chat_renders_the_template_and_matches_hf(llm, qwen3_dir, hf_reference):
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    out = llm.chat(CONVERSATION, greedy(8), use_tqdm=False)
    assert len(out) == 1 and out[0].prompt == text and out[0].prompt_token_ids == ids
    assert out[0]["token_ids"] == hf_reference(qwen3_dir, [ids], 8)[0]
    two = llm.chat([CONVERSATION, CONVERSATION + [{"role": "assistant", "content": "jumps"}]], greedy(8))
    assert [o.prompt_token_ids for o in two][0] == ids and len(two) == 2


def test_chat_options_reach_the_template(llm):
    partial = CONVERSATION + [{"role": "assistant", "content": "jumps over"}]
    out = llm.chat(partial, greedy(4), add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt.endswith("<|im_start|>assistant\njumps over")
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = llm.chat(CONVERSATION, greedy(4), chat_template=template, chat_template_kwargs={"greeting": "Hi: "})
    assert out[0].prompt == "Hi: The quick brown fox"


@pytest.mark.parametrize(
    "messages, kwargs, error",
    [
        ([{"content": "no role"}], {}, TypeError),
        (["just a string"], {}, TypeError),
        (CONVERSATION, dict(add_generation_prompt=True, continue_final_message=True), ValueError),
    ],
)
def test_bad_chat_calls(llm, messages, kwargs, error):
    with pytest.raises(error):
        llm.chat(messages, greedy(4), **kwargs)
    assert llm.is_finished()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_n_samples_reuse_the_computed_prompt(qwen3_dir, async_scheduling):
    prompt = (PROMPT * 3)[:40]  # two full 16-token blocks and 8 tokens more
    with LLM(qwen3_dir, **OPTIONS, async_scheduling=async_scheduling) as llm:
        (request,) = llm.add_requests([prompt], SamplingParams(0.8, 6, True, n=3, seed=5))
        while not llm.is_finished():
            llm.step()
        source, *siblings = request.seqs
        assert source.num_cached_tokens == 0
        assert [s.num_cached_tokens for s in siblings] == [32, 32]
        assert all(s.num_completion_tokens == 6 for s in request.seqs)


def test_sampled_rows_keep_to_allowed_tokens(llm):
    allowed = list(range(100, 400, 3))
    params = [
        SamplingParams(1.0, 24, True, allowed_token_ids=allowed, seed=1),
        SamplingParams(0.8, 24, True, allowed_token_ids=allowed, top_k=5, top_p=0.9),
        SamplingParams(1.0, 24, True, seed=2),
    ]
    outs = llm.generate([PROMPT, PROMPT[:7], PROMPT[:3]], params, use_tqdm=False)
    assert all(set(o["token_ids"]) <= set(allowed) for o in outs[:2])
    assert not set(outs[2]["token_ids"]) <= set(allowed)
