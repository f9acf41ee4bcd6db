"""Structured outputs against Hugging Face ``generate`` with xgrammar's own logits processor, on a
tiny random model whose byte-level BPE tokenizer splits JSON punctuation across tokens
('{"', '":', '",' are tokens of their own)."""

import json
import re

import pytest
import torch

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.demo_models import write_large_tokenizer
from tests.checkpoints import make_random_checkpoint

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

VOCAB = 4096
MAX_TOKENS = 40
OPTIONS_CPU = dict(device="cpu", dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=16)
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},  # (maxLength lets control bytes in)
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "bb", "ccc"]},
    },
    "required": ["name", "ok", "kind"],
}
GREETING = 'root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z] [a-z]? [a-z]?'
EMAIL = r"[a-z]{2,5}@(ab|cd)\.(com|org)"
CHOICES = ["quick brown fox", "lazy dog", "Nano"]
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=RECORD),
    "json_compact": StructuredOutputsParams(json=json.dumps(RECORD), disable_any_whitespace=True),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=EMAIL),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GREETING),
}
BOUNDED = ("json_compact", "regex", "choice", "grammar")  # a random model still ends these


@pytest.fixture(scope="session")
def json_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("structured"))
    eos = write_large_tokenizer(path, VOCAB, regular_tokens=VOCAB - 8)
    return make_random_checkpoint(path, tokenizer=False, seed=3, vocab_size=VOCAB, eos_token_id=eos)


@pytest.fixture(scope="module")
def llm(json_model_dir):
    with LLM(json_model_dir, enforce_eager=True, max_model_len=512, max_num_seqs=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def tokenizer(json_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(json_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer, json_model_dir):
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=VOCAB, stop_token_ids=[tokenizer.eos_token_id]
    )
    return xgr.GrammarCompiler(info)


def compile_for_hf(compiler, params: StructuredOutputsParams):
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        return compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
    if params.regex is not None:
        return compiler.compile_regex(params.regex)
    if params.choice is not None:
        return compiler.compile_grammar(
            " | ".join(json.dumps(c) for c in params.choice).join(["root ::= ", ""])
        )
    return compiler.compile_grammar(params.grammar)


def hf_constrained(model_dir: str, prompt: list[int], compiled, eos: int, max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    processor = xgr.contrib.hf.LogitsProcessor(compiled)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
            pad_token_id=0, logits_processor=[processor],
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def satisfies(kind: str, text: str, token_ids: list[int], compiler) -> bool:
    params = CONSTRAINTS[kind]
    if kind.startswith("json"):
        value = json.loads(text)
        jsonschema.validate(
            value, params.json if isinstance(params.json, dict) else json.loads(params.json or "{}")
        )
        return kind != "json_object" or isinstance(value, dict)
    if kind == "regex":
        return re.fullmatch(EMAIL, text) is not None
    if kind == "choice":
        return text in CHOICES
    matcher = xgr.GrammarMatcher(compile_for_hf(compiler, params))
    return all(matcher.accept_token(t) for t in token_ids) and matcher.is_completed()


PROMPTS = ["Hello", "The quick brown", "list all prime numbers", "introduce yourself"]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_equals_hf_with_xgrammar_processor(llm, tokenizer, compiler, json_model_dir, kind):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[kind])
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    compiled = compile_for_hf(compiler, CONSTRAINTS[kind])
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        expected = hf_constrained(json_model_dir, prompt, compiled, tokenizer.eos_token_id, MAX_TOKENS)
        assert completion.token_ids == expected
        if kind in BOUNDED:
            assert completion.finish_reason == "stop"
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == tokenizer.eos_token_id  # the end only once complete
            assert satisfies(kind, completion.text, completion.token_ids[:-1], compiler), completion.text


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    plain = SamplingParams(temperature=0.8, seed=7, max_tokens=24)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    sampled = SamplingParams(
        temperature=0.9, n=2, seed=11, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"]
    )
    params = [
        plain,
        sampled,
        plain,
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["choice"]),
    ]
    mixed = llm.generate(PROMPTS, params, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[2].outputs[0].token_ids
    assert len(mixed[1].outputs) == 2 and all(re.fullmatch(EMAIL, c.text) for c in mixed[1].outputs)
    assert mixed[3].outputs[0].text in CHOICES


@pytest.fixture(scope="module")
def mixed_run(llm):
    """A batch of every kind greedy, two kinds sampled (``n=2``, seeds) and an unconstrained
    row, on prompts long enough to chunk and span blocks; and its greedy outputs."""
    kinds = list(CONSTRAINTS)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[k]) for k in kinds
    ]
    params += [
        SamplingParams(temperature=0.8, seed=s, n=2, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[k])
        for s, k in enumerate(["regex", "json_compact"])
    ] + [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)]
    prompts = [p * (1 + i % 3) * 5 for i, p in enumerate(PROMPTS * 3)][: len(params)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    greedy = [o.outputs[0].token_ids for o, p in zip(outputs, params) if p.temperature == 0]
    return prompts, params, greedy


def check_run(outputs, params, greedy) -> None:
    """Greedy rows equal the plain run's token for token (sampled rows may part from it where
    batch shapes round a logit differently); every completion that ended keeps its constraint."""
    assert [o.outputs[0].token_ids for o, p in zip(outputs, params) if p.temperature == 0] == greedy
    for output, p in zip(outputs, params):
        for c in output.outputs:
            if p.structured_outputs is not None and c.finish_reason == "stop":
                kind = next(k for k, v in CONSTRAINTS.items() if v is p.structured_outputs)
                if kind in ("regex", "choice") or kind.startswith("json"):
                    assert satisfies(kind, c.text, c.token_ids[:-1], None), (kind, c.text)


@pytest.mark.parametrize(
    "options",
    [
        dict(max_num_batched_tokens=16),  # chunked prompts
        dict(async_scheduling=False),
        dict(mixed_steps=False),
        dict(num_kvcache_blocks=13, kvcache_block_size=16, max_model_len=208),  # preempts
    ],
    ids=["chunked", "sync", "unmixed", "preempted"],
)
def test_variants_equal_the_plain_run(json_model_dir, mixed_run, options):
    prompts, params, greedy = mixed_run
    with LLM(
        json_model_dir, **{**dict(enforce_eager=True, max_model_len=512, max_num_seqs=16), **options}
    ) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
        if "num_kvcache_blocks" in options:
            assert engine.llm_engine.scheduler.num_preemptions > 0
    check_run(outputs, params, greedy)


def test_prefix_cache_hits_equal_the_plain_run(llm, mixed_run):
    prompts, params, greedy = mixed_run
    again = llm.generate(prompts, params, use_tqdm=False)
    assert any(o.num_cached_tokens for o in again)
    check_run(again, params, greedy)


def test_stream_stop_strings_and_logprobs_under_a_constraint(llm, tokenizer):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=3, stop=["@"], structured_outputs=CONSTRAINTS["regex"]
    )
    final = [o for o in llm.stream(["Hello"], params) if o.finished][0].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "@"
    assert re.fullmatch(r"[a-z]{2,5}", final.text)
    # log-probabilities of the masked distribution: a letter's top entries hold only letters
    # (and tokens the mask takes out, at -inf)
    first = final.logprobs[0]
    for token, lp in first.items():
        assert re.fullmatch(r"[a-z]+", tokenizer.decode([token])) or lp.logprob == float("-inf")
    assert sum(torch.tensor([lp.logprob for lp in first.values()]).exp()) <= 1 + 1e-5


def test_ignore_eos_still_ends_when_the_grammar_is_complete(llm):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, structured_outputs=CONSTRAINTS["choice"]
    )
    completion = llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.text in CHOICES


@pytest.mark.parametrize(
    "constraint, message",
    [
        (dict(json="{not json"), "not valid JSON"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "JSON schema"),
        (dict(regex="(unclosed"), "regex"),
        (dict(grammar="root ::= missing_rule"), "grammar"),
    ],
)
def test_bad_constraints_raise_naming_the_prompt_and_leave_the_engine_usable(llm, constraint, message):
    good = SamplingParams(temperature=0, max_tokens=8)
    bad = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(**constraint)
    )
    with pytest.raises(ValueError, match=rf"prompt 1: structured_outputs: .*{message}"):
        llm.generate(["Hello", "The quick"], [good, bad], use_tqdm=False)
    assert llm.llm_engine.is_finished()
    assert len(llm.generate(["Hello"], good, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    "constraint",
    [
        dict(),
        dict(json={}, regex="a"),
        dict(choice=[]),
        dict(choice="ab"),
        dict(structural_tag="{}"),
        dict(json_object=False),
    ],
)
def test_malformed_params_are_refused(constraint):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**constraint)


def test_whitespace_pattern_limits_json_whitespace(llm):
    params = SamplingParams(
        temperature=0,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=RECORD, whitespace_pattern=r"[ ]?"),
    )
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        text = output.outputs[0].text
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not re.search(r"\s\s|[\n\t\r]", outside_strings), text
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), RECORD)


def test_tensor_parallel_matches_one_rank(json_model_dir, mixed_run):
    prompts, params, greedy = mixed_run
    with LLM(
        json_model_dir, enforce_eager=True, max_model_len=512, max_num_seqs=16, tensor_parallel_size=2
    ) as engine:
        outputs = engine.generate(prompts, params, use_tqdm=False)
    check_run(outputs, params, greedy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_greedy_equals_hf_with_xgrammar_processor(json_model_dir, tokenizer, compiler, eager):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    kinds = list(CONSTRAINTS)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS[k]) for k in kinds
    ]
    options = dict(device="cuda", dtype="float32", enforce_eager=eager, max_model_len=512, max_num_seqs=16)
    with LLM(json_model_dir, **options) as engine:
        for prompt in prompts:  # every kind in one batch, the prompt repeated
            outputs = engine.generate([prompt] * len(kinds), params, use_tqdm=False)
            for kind, output in zip(kinds, outputs):
                compiled = compile_for_hf(compiler, CONSTRAINTS[kind])
                expected = hf_constrained(
                    json_model_dir, prompt, compiled, tokenizer.eos_token_id, MAX_TOKENS
                )
                assert output.outputs[0].token_ids == expected, kind


def test_a_grammar_that_fails_to_compile_aborts_its_call_then_is_refused_up_front(llm, monkeypatch):
    def broken(*spec):
        raise RuntimeError("compiler out of memory")

    monkeypatch.setattr(llm.llm_engine.structured_outputs, "_compile", broken)
    params = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="zz+")
    )
    with pytest.raises(RuntimeError, match="compiler out of memory"):
        llm.generate(["Hello"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: structured_outputs: the constraint cannot be compiled"):
        llm.generate(["Hello"], params, use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].text.startswith("zz")


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_ctrl_c_while_a_step_awaits_its_bitmask_leaves_the_engine_correct(json_model_dir, monkeypatch, tp):
    """The forward pass is launched, its sampling waits for the bitmask: an interrupt there
    (with two ranks, the worker waits inside the broadcast of samples) ends only that call."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=CONSTRAINTS["regex"])
    with LLM(json_model_dir, tensor_parallel_size=tp, **dict(OPTIONS_CPU)) as engine:
        expected = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        structured = engine.llm_engine.structured_outputs
        fill, calls = structured.bitmask, [0]

        def interrupted(step, out=None):
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt
            return fill(step, out)

        monkeypatch.setattr(structured, "bitmask", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS, params, use_tqdm=False)
        monkeypatch.undo()
        assert engine.llm_engine.is_finished()
        again = engine.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected


def test_the_engine_wide_config_as_vllm_takes_it(llm, json_model_dir):
    def free_whitespace(text: str) -> bool:  # a JSON string holds no raw newline or tab
        return "\n" in text or "\t" in text

    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=CONSTRAINTS["json_object"])
    assert any(free_whitespace(o.outputs[0].text) for o in llm.generate(PROMPTS, params, use_tqdm=False))
    compact = dict(
        OPTIONS_CPU, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}
    )
    with LLM(json_model_dir, **compact) as engine:
        for output in engine.generate(PROMPTS, params, use_tqdm=False):
            assert not free_whitespace(output.outputs[0].text), output.outputs[0].text
    for config, message in [
        ({"backend": "guidance"}, "backend='guidance' is not supported: xgrammar"),
        ({"reasoning_parser": "deepseek_r1"}, "reasoning parsers are not implemented"),
        ({"no_such_key": 1}, "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(json_model_dir, **dict(OPTIONS_CPU, structured_outputs_config=config))
