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
