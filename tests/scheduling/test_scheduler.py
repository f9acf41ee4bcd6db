"""Scheduler: budgets, chunked prefill, decode positions and stop conditions (fake model)."""

import pytest

from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.scheduling.sequence import SequenceStatus
from tests.scheduling.harness import DUMMY, Harness, cdiv, model


def test_max_num_seqs_not_multiple_of_16():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=7)
    seqs = [h.add([i + 1] * 3, max_tokens=4) for i in range(10)]
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == seqs[:7]
    assert list(h.sched.waiting) == seqs[7:]
    batch, is_prefill, _ = h.step()
    assert not is_prefill and batch == seqs[:7]  # running is full: nothing more admitted
    sizes = []
    while not h.sched.is_finished():
        batch, _, _ = h.step()
        sizes.append(len(batch))
    assert max(sizes) == 7
    h.check_done()


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=25)
    a, b, c, d = (h.add([k] * 10, max_tokens=3) for k in (1, 2, 3, 4))
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [a, b, c]
    assert [len(s) for s in (a, b, c)] == [11, 11, 10]  # c got only a 5-token chunk
    assert c.num_computed_tokens == 5 and c.completion_token_ids == []
    assert d.status == SequenceStatus.WAITING
    # next prefill: c's remaining 5 tokens first, then d (10) within 25
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [c, d]
    assert c.num_computed_tokens == 10 and len(c.completion_token_ids) == 1
    assert d.num_computed_tokens == 10
    h.run()
    h.check_done()


def test_chunked_prefill_advances_by_the_chunk_and_samples_once():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=16)
    prompt = [(7 * i) % 97 for i in range(50)]
    s = h.add(prompt, max_tokens=3)
    chunks = []
    while s.num_computed_tokens < 50:
        before = s.num_computed_tokens
        batch, is_prefill, _ = h.step(tokens_for=lambda _: 999)
        assert batch == [s] and is_prefill
        chunks.append(s.num_computed_tokens - before)
        if s.num_computed_tokens < 50:
            assert len(s) == 50, "a prompt chunk must not sample a token"
    assert chunks == [16, 16, 16, 2]
    assert s.completion_token_ids == [999]
    h.run()
    assert s.completion_token_ids[0] == 999 and len(s.completion_token_ids) == 3


def test_step_batch_covers_exactly_the_chunk():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=6)
    prompt = list(range(1, 15))
    s = h.add(prompt, max_tokens=2)
    seen = []
    while s.num_computed_tokens < len(prompt):
        step = h.sched.schedule()
        h.apply_batch(step)
        sb = step.batch
        start, (n,) = s.num_computed_tokens, sb.num_tokens
        assert sb.start_positions == [start] and n == min(6, 14 - start)
        assert sb.token_ids == prompt[start : start + n]
        seen.extend(sb.token_ids)
        h.update(step, [DUMMY if start + n < 14 else 5])
    assert seen == prompt  # every prompt token computed once, in order, keys end at the chunk


def test_chunk_ending_just_before_the_last_prompt_token():
    """Prompt 17, budget 16: after the chunk only the last token lacks KV, which the next
    (decode) step computes at position 16 and samples from."""
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=16)
    s = h.add(list(range(1, 18)), max_tokens=2)
    batch, is_prefill, _ = h.step()
    assert is_prefill and s.num_computed_tokens == 16 and len(s) == 17
    step = h.sched.schedule()
    h.apply_batch(step)
    assert step.seqs == [s] and step.batch.num_tokens == [1] and step.batch.is_decode
    assert step.batch.start_positions == [16]
    assert step.batch.token_ids == [17]
    h.compute(s, 16, 1)
    h.update(step, [model(s.token_ids)])
    assert len(s.completion_token_ids) == 1
    h.run()
    h.check_done()


def test_without_mixed_steps_prefill_goes_before_decode():
    h = Harness(num_blocks=100, block_size=4, mixed=False)
    a = h.add([1, 2, 3], max_tokens=10)
    h.step()
    assert len(a) == 4
    b = h.add([4, 5, 6, 7, 8], max_tokens=10)
    batch, is_prefill, _ = h.step()
    assert is_prefill and batch == [b]
    assert len(a) == 4, "the decode-ready sequence waits while a prefill runs"
    batch, is_prefill, _ = h.step()
    assert not is_prefill and batch == [a, b]
    h.run()
    h.check_done()


def test_a_mixed_step_decodes_while_a_new_prompt_is_computed():
    h = Harness(num_blocks=100, block_size=4, mixed=True)
    a = h.add([1, 2, 3], max_tokens=10)
    h.step()
    b = h.add([4, 5, 6, 7, 8], max_tokens=10)
    step = h.sched.schedule()
    assert step.seqs == [a, b] and step.batch.num_single_token_rows == 1 and not step.batch.is_decode
    assert step.batch.num_tokens == [1, 5] and step.batch.start_positions == [3, 0]
    assert step.batch.token_ids == [a.token_ids[-1], 4, 5, 6, 7, 8]
    h.apply_batch(step)
    h.update(step, [h.compute(s, start, n) for s, start, n in h.rows(step)])
    assert len(a) == 5 and len(b) == 6
    h.run()
    h.check_done()


def test_decodes_take_the_budget_first_and_prompts_the_rest():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=10, mixed=True)
    a, b = h.add([1, 2, 3], max_tokens=10), h.add([4, 5, 6], max_tokens=10)
    h.step()
    c = h.add(list(range(20, 40)), max_tokens=3)
    step = h.sched.schedule()
    assert step.seqs == [a, b, c] and step.batch.num_tokens == [1, 1, 8]
    h.apply_batch(step)
    h.update(step, [h.compute(s, start, n) for s, start, n in h.rows(step)])
    step = h.sched.schedule()  # c's prompt goes on after the decodes, from token 8
    assert step.seqs == [a, b, c] and step.batch.num_tokens == [1, 1, 8]
    assert step.batch.start_positions[2] == 8
    h.apply_batch(step)
    h.update(step, [h.compute(s, start, n) for s, start, n in h.rows(step)])
    h.run()
    h.check_done()


def test_a_step_planned_ahead_admits_prompts_and_goes_on_with_chunks():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=8, mixed=True)
    a = h.add([1, 2, 3], max_tokens=10)
    first = h.sched.schedule()  # a's prompt
    h.apply_batch(first)
    b = h.add(list(range(10, 22)), max_tokens=2)
    second = h.sched.schedule_ahead(first)
    # a decodes its token in flight (batch row 0 of the first step); b gets the 7 tokens left
    assert second.seqs == [a, b] and second.batch.previous_sample_rows == [0]
    assert second.batch.num_tokens == [1, 7] and second.batch.start_positions == [3, 0]
    assert second.batch.token_ids == list(range(10, 17))
    assert [r.slot for r in second.batch.new_slots] == [b.slot]
    h.apply_batch(second)
    h.update(first, [h.compute(a, 0, 3)])
    third = h.sched.schedule_ahead(second)  # b goes on after its chunk in flight
    assert third.seqs == [a, b] and third.batch.start_positions == [4, 7]
    assert third.batch.num_tokens == [1, 5] and third.batch.previous_sample_rows == [0]
    h.apply_batch(third)
    for step in (second, third):
        h.update(step, [h.compute(s, start, n) for s, start, n in h.rows(step)])
    assert len(a) == 6 and len(b) == 13
    h.run()
    h.check_done()


def test_decode_positions_are_zero_based_and_blocks_grow_at_boundaries():
    h = Harness(num_blocks=100, block_size=4)
    s = h.add([1, 2, 3], max_tokens=10)
    h.step()  # prefill 3 tokens, sample 1 -> len 4
    for _ in range(7):
        length = len(s)
        step = h.sched.schedule()
        h.apply_batch(step)
        assert step.batch.is_decode and step.seqs == [s]
        assert step.batch.start_positions == [length - 1]  # positions are 0-based
        assert step.batch.token_ids == [s.token_ids[-1]]
        assert len(s.block_table) == cdiv(length, 4)
        h.compute(s, length - 1, 1)
        h.update(step, [model(s.token_ids)])
    h.run()
    h.check_done()


# =================================================================== stop conditions


def test_eos_stops_and_is_kept():
    h = Harness(num_blocks=16, block_size=4, eos=(7, 9))
    s = h.add([1, 2, 3], max_tokens=10)
    feed = iter([3, 9])
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: next(feed))
    assert s.completion_token_ids == [3, 9] and s.finish_reason == "stop"
    assert h.bm.num_free_blocks == 16


def test_every_eos_id_stops():
    for eos_tok in (7, 9):
        h = Harness(num_blocks=16, block_size=4, eos=(7, 9))
        s = h.add([1, 2, 3], max_tokens=10)
        h.step(tokens_for=lambda _, t=eos_tok: t)
        assert s.is_finished and s.completion_token_ids == [eos_tok]


def test_ignore_eos_runs_to_max_tokens():
    h = Harness(num_blocks=16, block_size=4, eos=(7,))
    s = h.add([1, 2, 3], max_tokens=5, ignore_eos=True)
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: 7)
    assert s.completion_token_ids == [7] * 5 and s.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    h = Harness(num_blocks=16, block_size=4, eos=(7,))
    s = h.add([1, 2, 3], max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    feed = iter([7, 5, 42, 1])
    while not h.sched.is_finished():
        h.step(tokens_for=lambda _: next(feed))
    assert s.completion_token_ids == [7, 5, 42] and s.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_max_tokens_exact(max_tokens):
    h = Harness(num_blocks=16, block_size=4)
    s = h.add([1, 2, 3], max_tokens=max_tokens)
    h.run()
    assert len(s.completion_token_ids) == max_tokens and s.finish_reason == "length"
    h.check_done()


def test_max_model_len_caps_total_length():
    h = Harness(num_blocks=16, block_size=4, max_model_len=8)
    s = h.add([1, 2, 3, 4, 5], max_tokens=100)
    h.run()
    assert len(s) == 8 and len(s.completion_token_ids) == 3 and s.finish_reason == "length"
    h.check_done()


@pytest.mark.parametrize("max_model_len", [1, 8, 9])
def test_prompt_of_exactly_max_model_len_gets_one_token(max_model_len):
    h = Harness(num_blocks=8, block_size=4, max_model_len=max_model_len)
    s = h.add(list(range(1, max_model_len + 1)), max_tokens=50)
    batch, is_prefill, finished = h.step()
    assert finished == [s] and len(s.completion_token_ids) == 1
    assert s.finish_reason == "length"
    assert h.sched.is_finished() and h.bm.num_free_blocks == 8


@pytest.mark.parametrize("prompt_len, waits", [(8, True), (9, False)])
def test_a_parallel_sample_waits_for_its_prompt_only_if_it_can_share_it(prompt_len, waits):
    h = Harness(num_blocks=100, block_size=4)
    h.bm.max_shared_prompt_len = 8  # as with dynamic rope scaling: longer prompts share no blocks
    source, sibling = (h.add([1] * prompt_len, max_tokens=2) for _ in range(2))
    sibling.prompt_source = source
    batch, _, _ = h.step()
    assert batch == ([source] if waits else [source, sibling])
    h.run()
    h.check_done()


def test_structured_rows_are_the_constrained_rows_that_sample():
    h = Harness(num_blocks=100, block_size=4, max_num_batched_tokens=10, mixed=True)
    json_object = StructuredOutputsParams(json_object=True)
    free = h.add([1] * 3, max_tokens=4)
    constrained = h.add([2] * 12, max_tokens=4, structured_outputs=json_object)
    first = h.sched.schedule()  # free's whole prompt, 7 tokens of constrained's: no token for it
    assert first.seqs == [free, constrained] and first.batch.structured_rows == []
    h.update(first, [5, DUMMY])
    second = h.sched.schedule()  # free decodes, constrained's last chunk samples its first token
    assert second.seqs == [free, constrained] and second.batch.structured_rows == [1]
    h.update(second, [5, 6])
    third = h.sched.schedule()
    assert third.batch.num_single_token_rows == 2 and third.batch.structured_rows == [1]
    ahead = h.sched.schedule_ahead(third)  # rows fed by the step in flight sample too
    assert ahead.seqs == [free, constrained] and ahead.batch.structured_rows == [1]
