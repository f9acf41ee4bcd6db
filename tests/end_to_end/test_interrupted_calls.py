"""A call cut short in any way leaves the engine idle and correct, and a second caller is told
so at once (CPU, tiny checkpoint, HF greedy as the oracle)."""

import gc
import threading

import pytest

from nanovllm import LLM, SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=128, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, **OPTIONS)
    yield engine
    engine.exit()


def assert_idle_and_correct(llm: LLM, qwen3_dir, prompts, hf_reference) -> None:
    assert llm.is_finished()
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
    assert sorted(llm.scheduler.free_slots) == list(range(OPTIONS["max_num_seqs"]))
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, prompts, 12)


def test_a_stream_never_read_owns_nothing(llm, qwen3_dir, prompts, hf_reference):
    stream = llm.stream(prompts, GREEDY)
    assert llm.is_finished()  # nothing queued until it is read
    del stream
    gc.collect()
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)


def test_a_stream_dropped_while_read_cancels_its_requests(llm, qwen3_dir, prompts, hf_reference):
    stream = llm.stream(prompts, GREEDY)
    next(stream)
    assert not llm.is_finished()
    del stream
    gc.collect()
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)


def test_bad_input_to_a_stream_raises_at_the_call(llm):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.stream([[1, 2], []], GREEDY)


@pytest.mark.parametrize("nth", [1, 3])
def test_ctrl_c_while_queueing_loses_nothing(llm, qwen3_dir, prompts, hf_reference, monkeypatch, nth):
    add, calls = llm.scheduler.add, [0]

    def interrupted(seq):
        calls[0] += 1
        if calls[0] == nth:
            raise KeyboardInterrupt
        add(seq)

    with monkeypatch.context() as m:
        m.setattr(llm.scheduler, "add", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)


def test_a_second_caller_is_refused_at_once(llm, qwen3_dir, prompts, hf_reference):
    stream = llm.stream(prompts, GREEDY)
    first = next(stream)
    errors = []

    def other_caller():
        try:
            llm.generate(prompts, GREEDY, use_tqdm=False)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=other_caller)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(errors) == 1 and "one call at a time" in str(errors[0])
    with pytest.raises(RuntimeError, match="one call at a time"):  # the same thread too
        llm.generate(prompts, GREEDY, use_tqdm=False)
    last = {}  # the stream is untouched by the refused calls
    for out in [first, *stream]:
        last[out.request_id] = out
    in_order = sorted(last.values(), key=lambda o: int(o.request_id))  # ids count up in prompt order
    assert [o["token_ids"] for o in in_order] == hf_reference(qwen3_dir, prompts, 12)
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)


def test_two_threads_generating_never_corrupt_outputs(llm, qwen3_dir, prompts, hf_reference):
    """Each call either completes correctly or is refused: no empty or aborted outputs."""
    want = hf_reference(qwen3_dir, prompts, 12)
    results, errors = [], []

    def call():
        try:
            results.append([o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(results) + len(errors) == 4 and results
    assert all(r == want for r in results)
    assert all("one call at a time" in str(e) for e in errors)
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)


def broken_logits(monkeypatch, llm: LLM, on_call: int, row: int, value: float) -> None:
    """The model's logits for ``row`` of its ``on_call``-th step become ``value`` throughout."""
    runner = llm.executor.runner
    compute, calls = runner.model.compute_logits, [0]

    def patched(hidden):
        logits = compute(hidden)
        calls[0] += 1
        if calls[0] == on_call and row < logits.shape[0]:
            logits[row] = value
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", patched)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_row_with_no_token_to_sample_ends_its_request_alone(
    qwen3_dir, prompts, hf_reference, monkeypatch, async_scheduling
):
    llm = LLM(qwen3_dir, **OPTIONS, async_scheduling=async_scheduling)
    try:
        want = hf_reference(qwen3_dir, prompts[:2], 12)
        with monkeypatch.context() as m:
            broken_logits(m, llm, on_call=4, row=0, value=float("-inf"))  # a decode step of both
            outs = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        reasons = [o.outputs[0].finish_reason for o in outs]
        assert sorted(reasons) == ["abort", "length"]
        for out, tokens in zip(outs, want):
            got = out.outputs[0].token_ids
            if out.outputs[0].finish_reason == "abort":  # no token for the masked row, none after
                assert 0 < len(got) < 12 and got == tokens[: len(got)]
            else:
                assert got == tokens
        assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)
    finally:
        llm.exit()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_raise_naming_the_request(
    llm, qwen3_dir, prompts, hf_reference, monkeypatch, value
):
    with monkeypatch.context() as m:
        broken_logits(m, llm, on_call=3, row=1, value=value)
        with pytest.raises(RuntimeError, match=r"request \d+: the model's logits are NaN or infinite"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert_idle_and_correct(llm, qwen3_dir, prompts, hf_reference)
