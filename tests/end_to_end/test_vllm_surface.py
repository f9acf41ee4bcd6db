"""A vLLM offline script's arguments and types: honoured, accepted with their meaning here, or
refused by name (CPU, tiny checkpoint, HF greedy as the oracle)."""

import pytest

from nanovllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from nanovllm.engine_args import ACCEPTED, REFUSED

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_a_vllm_script_runs_unchanged(qwen3_dir, prompts, hf_reference):
    llm = LLM(
        model=qwen3_dir,
        tokenizer=qwen3_dir,
        trust_remote_code=True,
        swap_space=4,
        max_model_len=None,  # None: the default, as in vLLM
        max_num_seqs=None,
        block_size=16,
        enable_chunked_prefill=True,
        disable_log_stats=True,
        enable_lora=False,
        quantization=None,
        revision=None,
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=2**24,
    )
    try:
        assert llm.config.kvcache_block_size == 16
        assert llm.llm_engine.model_config.max_model_len == llm.config.max_model_len
        assert llm.llm_engine.model_config.hf_config.vocab_size == 512
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts[:2]]
        outs = llm.generate(inputs, GREEDY, use_tqdm=False, lora_request=None)
        assert [o.outputs[0].token_ids for o in outs] == hf_reference(qwen3_dir, prompts[:2], 8)
        text = llm.generate([TextPrompt(prompt="Hello, Nano-vLLM.")], GREEDY, use_tqdm=False)[0]
        assert text.prompt == "Hello, Nano-vLLM." and len(text.outputs[0].token_ids) == 8
        with pytest.raises(ValueError, match="lora_request is not supported"):
            llm.generate(inputs, GREEDY, use_tqdm=False, lora_request=object())
    finally:
        llm.exit()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_arguments_name_themselves_and_the_alternative(qwen3_dir, name):
    allowed, why = REFUSED[name]
    with pytest.raises(ValueError, match=f"{name}=.* is not supported: {why[:20]}"):
        LLM(qwen3_dir, device="cpu", **{name: "something else"})


def test_accepted_arguments_take_any_value(qwen3_dir):
    assert all(meaning for meaning in ACCEPTED.values())  # each says what it means here
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", **{name: 1 for name in ACCEPTED})
    llm.exit()


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(block_size=16, kvcache_block_size=32), ValueError, "one option"),
        (dict(kv_cache_memory_gb=1, kv_cache_memory_bytes=2**30), ValueError, "set one"),
        (dict(tokenizer_mode="mistral"), ValueError, "tokenizer_mode"),
        (dict(tokenizer="/no/such/folder"), FileNotFoundError, "tokenizer folder"),
        (dict(not_an_option=1), ValueError, r"unknown LLM options \['not_an_option'\]"),
    ],
)
def test_bad_engine_arguments(qwen3_dir, options, error, match):
    with pytest.raises(error, match=match):
        LLM(qwen3_dir, device="cpu", **options)


def test_skip_tokenizer_init_takes_token_ids_only(qwen3_dir, prompts, hf_reference):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", skip_tokenizer_init=True)
    try:
        assert llm.get_tokenizer() is None
        out = llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_reference(qwen3_dir, prompts[:1], 8)[0]
        assert out.outputs[0].text == ""
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate(["text"], GREEDY, use_tqdm=False)
    finally:
        llm.exit()


def test_truncate_prompt_tokens_keeps_the_last_k(qwen3_dir, prompts, hf_reference):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_model_len=64)
    try:
        long = (prompts[-1] * 2)[:80]  # longer than max_model_len: fits once truncated
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=20)
        out = llm.generate([long], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == long[-20:]
        assert out.outputs[0].token_ids == hf_reference(qwen3_dir, [long[-20:]], 8)[0]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=-1)
        out = llm.generate([long], params, use_tqdm=False)[0]
        assert out.prompt_token_ids == long[-63:] and len(out.outputs[0].token_ids) == 1
    finally:
        llm.exit()


class RecordingTokenizer:
    """A tokenizer that records the keywords of every decode (this test's fast tokenizer
    ignores ``spaces_between_special_tokens``, so its text alone would not show the flag)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decode_keywords = tokenizer, []

    def decode(self, token_ids, **keywords):
        self.decode_keywords.append(keywords)
        return self.tokenizer.decode(token_ids, **keywords)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.mark.parametrize("stream", [False, True])
def test_spaces_between_special_tokens_reaches_the_tokenizer(qwen3_dir, stream):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32")
    try:
        llm.tokenizer = recorder = RecordingTokenizer(llm.tokenizer)
        params = SamplingParams(
            temperature=0, max_tokens=4, skip_special_tokens=False, spaces_between_special_tokens=False
        )
        if stream:
            outs = [out for out in llm.stream(["Hello"], params)][-1:]
        else:
            outs = llm.generate(["Hello"], params, use_tqdm=False)
        assert outs[0].outputs[0].text and recorder.decode_keywords
        for keywords in recorder.decode_keywords:
            assert keywords == {"skip_special_tokens": False, "spaces_between_special_tokens": False}
    finally:
        llm.exit()


def test_the_engine_seed_makes_unseeded_sampling_repeat(qwen3_dir, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int) -> list[list[int]]:
        llm = LLM(qwen3_dir, device="cpu", dtype="float32", seed=seed)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.exit()

    first = sample(3)
    assert sample(3) == first
    assert sample(4) != first


def test_eos_and_stop_ids_come_before_stop_strings_and_leave_their_text_out(qwen3_dir):
    """As vLLM: a completion ended by EOS or a stop token id reports that (not a stop string
    equal to its text), and its text leaves that token's text out unless
    include_stop_str_in_output."""
    llm = LLM(qwen3_dir, device="cpu", dtype="float32")
    tok = llm.tokenizer
    try:
        prompt = [7, 300, 42, 19, 250, 3, 88]
        full = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        # a token whose text appears nowhere before it, so that only its id can end the completion
        cut = next(
            j + 1
            for j in range(2, len(full))
            if full[j] not in full[:j] and tok.decode([full[j]]).strip()
            and tok.decode([full[j]]) not in tok.decode(full[:j + 1])[: -len(tok.decode([full[j]]))]
        )  # fmt: skip
        stop_id, stop_text = full[cut - 1], tok.decode([full[cut - 1]])
        for include in (False, True):
            params = SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id], stop=[stop_text],
                include_stop_str_in_output=include,
            )  # fmt: skip
            for out in (
                llm.generate([prompt], params, use_tqdm=False)[0].outputs[0],
                [o for o in llm.stream([prompt], params)][-1].outputs[0],
            ):
                assert out.token_ids == full[:cut] and out.finish_reason == "stop"
                # included, the id's text is searched for stop strings too, and holds one
                assert out.stop_reason == (stop_text if include else stop_id)
                assert out.text == tok.decode(full[: cut if include else cut - 1])
        eos = llm.config.eos_token_ids[0]
        eos_text = tok.decode([eos])
        params = SamplingParams(
            temperature=0, max_tokens=8, allowed_token_ids=[eos], stop=[eos_text], skip_special_tokens=False
        )
        for out in (
            llm.generate([prompt], params, use_tqdm=False)[0].outputs[0],
            [o for o in llm.stream([prompt], params)][-1].outputs[0],
        ):
            assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None
            assert out.text == ""
    finally:
        llm.exit()


def test_bad_words_match_hf(qwen3_dir, prompts):
    """Words chosen from the plain greedy completion (so they would occur): ours, as strings and as
    token ids, equal HF's greedy generate with NoBadWordsLogitsProcessor on the completion."""
    from tests.end_to_end.hf_oracle import hf_generate

    llm = LLM(qwen3_dir, device="cpu", dtype="float32", max_num_seqs=4)
    tok = llm.tokenizer
    try:
        batch, params, want = prompts[1:4], [], []
        for prompt in batch:
            plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            ids = SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True, bad_words_token_ids=[plain[2:4], [plain[6]]]
            )
            params.append(ids)
            want.append(hf_generate(qwen3_dir, prompt, ids))
            assert want[-1] != plain  # the words matter
        outs = llm.generate(batch + [prompts[0]], params + [GREEDY], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:3]] == want
        # as a string: the word and, where it tokenizes differently, the word after a space
        word = tok.decode(want[0][3:5]).strip()
        variants = [
            tok.encode(word, add_special_tokens=False),
            tok.encode(" " + word, add_special_tokens=False),
        ]
        words = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
        oracle = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True,
            bad_words_token_ids=[v for v in variants if v == variants[0] or (
                v[0] != variants[0][0] and len(v) == len(variants[0]))],
        )  # fmt: skip
        got = llm.generate([batch[0]], words, use_tqdm=False)[0].outputs[0].token_ids
        assert got == hf_generate(qwen3_dir, batch[0], oracle) and got != want[0]
    finally:
        llm.exit()


def test_bad_words_need_a_tokenizer_or_token_ids(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="bad_words need a tokenizer"):
            llm.generate([[1, 2, 3]], SamplingParams(bad_words=["x"]), use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 3]], SamplingParams(bad_words_token_ids=[[1, 9999]]), use_tqdm=False)
    finally:
        llm.exit()
