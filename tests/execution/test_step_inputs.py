"""Step inputs built from the plans alone (block-table deltas included) match the sequences.

A scheduler with a fake model runs whole workloads, with preemption, prefix hits, chunked
prefill and decode steps planned ahead; every step's tensors are checked against what the
sequences themselves say.
"""

import dataclasses
import random

import pytest
import torch

from nanovllm.config import Config
from nanovllm.execution.cuda_graph import batch_size_ladder
from nanovllm.execution.step_inputs import StepInputBuilder
from nanovllm.scheduling import ScheduledStep
from tests.scheduling.harness import VOCAB, Harness

BLOCK, SEQS, MAX_LEN = 4, 6, 48


LAST_SAMPLED = torch.arange(1000, 1000 + SEQS)  # the previous step's samples, told apart


class CheckedHarness(Harness):
    def __init__(self, builder: StepInputBuilder, pad_decodes: bool = False, **options):
        super().__init__(max_num_seqs=SEQS, max_model_len=MAX_LEN, block_size=BLOCK, **options)
        self.builder = builder
        self.pad_decodes = pad_decodes
        """Build decode steps padded to a graph's batch size, as the decode graphs take them."""
        self.steps_checked = self.padded_steps = 0
        self.decode_steps_with_rope_lengths = 0
        self.padded_addresses: dict[int, list[int]] = {}

    def apply_batch(self, step: ScheduledStep) -> None:
        super().apply_batch(step)
        b = step.batch
        pad = next(s for s in batch_size_ladder(SEQS) if s >= len(b)) if self.pad_decodes else None
        inputs = self.builder.build(b, pad_to=pad if b.is_decode else None)
        resolved_ids = inputs.resolve(LAST_SAMPLED, self.builder.slot_table.block_tables.device)
        if inputs.padded_rows is not None:
            assert inputs.padded_rows == pad
            inputs, resolved_ids = self.check_padding(inputs, resolved_ids, len(b))
        meta = inputs.meta
        positions, slots, ids, token_seqs = [], [], [], []
        for seq, start, n in zip(step.seqs, b.start_positions, b.num_tokens):
            positions += range(start, start + n)
            token_seqs += [seq] * n
            slots += [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, start + n)]
            ids += seq.token_ids[start : start + n]  # nothing yet for a token in flight
        assert inputs.positions.tolist() == positions
        if self.builder.rope_lengths:  # a prompt token turns on its whole prompt's length
            lengths = [max(p + 1, seq.num_prompt_tokens) for seq, p in zip(token_seqs, positions)]
            if inputs.rope_lengths is None:
                assert b.is_decode and lengths == [p + 1 for p in positions]
            else:
                assert inputs.rope_lengths.tolist() == lengths
                self.decode_steps_with_rope_lengths += b.is_decode
        # Triton specializes kernels on their pointers' 16-byte alignment: an input that moved
        # off it would compile another variant mid-run
        assert inputs.positions.storage_offset() == 0
        assert meta.slot_mapping.tolist() == slots
        tables = [meta.block_tables] if meta.decode is None else [meta.decode.block_tables, meta.block_tables]
        meta_tables = torch.cat(tables).tolist()
        for i, seq in enumerate(step.seqs):
            assert meta_tables[i][: len(seq.block_table)] == seq.block_table
        if b.is_decode:
            assert meta.context_lens.tolist() == [s + n for s, n in zip(b.start_positions, b.num_tokens)]
        k, d = len(b.previous_sample_rows), b.num_single_token_rows
        # the first k rows' tokens are still in flight: the previous step's samples stand in
        assert resolved_ids.tolist() == [1000 + r for r in b.previous_sample_rows] + ids
        if k:
            assert inputs.sampled_from.tolist() == b.previous_sample_rows + [-1] * len(ids)
        elif inputs.padded_rows is None:
            assert inputs.sampled_from is None
        ends = [s + n for s, n in zip(b.start_positions, b.num_tokens)]
        decode_meta = meta if b.is_decode else meta.decode
        if decode_meta is not None:  # decode attention takes the rows longest context first
            order = decode_meta.decode_order.tolist()
            assert sorted(order) == list(range(d))
            assert [ends[r] for r in order] == sorted(ends[:d], reverse=True)
        if b.is_decode:
            assert not meta.is_prefill and meta.decode is None
        else:
            lens = b.num_tokens
            assert inputs.last_token_index.tolist() == [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
            # the prompt rows (after the d decode rows) as the prefill kernels see them
            assert meta.is_prefill and meta.num_decode_tokens == d
            assert meta.cu_seqlens_q.tolist() == [sum(lens[d:i]) for i in range(d, len(lens) + 1)]
            assert meta.context_lens.tolist() == ends[d:]
            assert meta.cu_seqlens_k.tolist() == [sum(ends[d:i]) for i in range(d, len(lens) + 1)]
            assert meta.has_prefix == any(b.start_positions[d:])
            if d:
                assert meta.decode.context_lens.tolist() == ends[:d]
                assert meta.decode.block_tables.tolist() == meta_tables[:d]
            assert meta.block_tables.tolist() == meta_tables[d:]
            # every row's last token as a decode row, over its whole context
            last = meta.last_tokens
            assert not last.is_prefill and last.context_lens.tolist() == ends
            assert last.block_tables.tolist() == meta_tables
            assert [ends[r] for r in last.decode_order.tolist()] == sorted(ends, reverse=True)
        self.steps_checked += 1

    def check_padding(self, inputs, resolved_ids, n):
        """A padded decode step: its rows past ``n`` hold the padding values, and every step padded
        to the same size finds its inputs at the same addresses (where a graph reads them). Returns
        the step cut to its ``n`` rows."""
        rows, meta = inputs.padded_rows, inputs.meta
        assert resolved_ids.shape[0] == rows
        assert inputs.sampled_from[n:].tolist() == [-1] * (rows - n) and (resolved_ids[n:] == 0).all()
        assert meta.slot_mapping[n:].tolist() == [-1] * (rows - n)  # no K/V stored
        assert meta.context_lens[n:].tolist() == [1] * (rows - n)  # one key read
        assert meta.decode_order[n:].tolist() == [-1] * (rows - n)
        fields = (inputs.input_ids, inputs.sampled_from, inputs.positions, inputs.slots, inputs.block_tables)
        meta_fields = (meta.slot_mapping, meta.context_lens, meta.block_tables, meta.decode_order)
        addresses = [t.data_ptr() for t in fields + meta_fields]
        assert self.padded_addresses.setdefault(rows, addresses) == addresses
        self.padded_steps += 1
        cut = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping[:n],
            context_lens=meta.context_lens[:n],
            block_tables=meta.block_tables[:n],
            decode_order=meta.decode_order[:n],
        )
        short = dataclasses.replace(inputs, positions=inputs.positions[:n], meta=cut)
        short.sampled_from = None if (inputs.sampled_from[:n] < 0).all() else inputs.sampled_from[:n]
        return short, resolved_ids[:n]


@pytest.fixture(scope="module")
def config(qwen3_dir) -> Config:
    return Config(qwen3_dir, device="cpu", kvcache_block_size=BLOCK, max_num_seqs=SEQS, max_model_len=MAX_LEN)


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("plan_ahead", [False, True])
@pytest.mark.parametrize("num_blocks", [12, 200])
def test_inputs_follow_the_sequences_through_a_workload(config, plan_ahead, num_blocks, mixed, pad):
    h = CheckedHarness(
        StepInputBuilder(config, torch.device("cpu")),
        pad_decodes=pad,
        num_blocks=num_blocks,
        max_num_batched_tokens=20,
        mixed=mixed,
    )
    rng = random.Random(num_blocks)
    shared = [rng.randrange(VOCAB) for _ in range(16)]
    for _ in range(12):
        prompt = shared[: rng.randrange(0, 17)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
        h.add(prompt, max_tokens=rng.randrange(1, 16))
    if plan_ahead:
        h.run_async()
    else:
        h.run()
    h.check_done()
    assert h.steps_checked > 20
    assert (h.padded_steps > 0) == pad
    if num_blocks == 12:
        assert h.sched.num_preemptions > 0


def test_rope_lengths_follow_the_prompts_through_chunks_and_preemption(config):
    h = CheckedHarness(
        StepInputBuilder(config, torch.device("cpu"), rope_lengths=True),
        num_blocks=8,
        max_num_batched_tokens=2,  # one-token prompt chunks beside a decode: steps all of one token
        mixed=True,
    )
    rng = random.Random(0)
    for _ in range(8):
        h.add([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))], max_tokens=rng.randrange(1, 16))
    h.run()
    h.check_done()
    assert h.sched.num_preemptions > 0 and h.decode_steps_with_rope_lengths > 0


def test_sampling_values_travel_per_row(config):
    h = CheckedHarness(StepInputBuilder(config, torch.device("cpu")), num_blocks=50)
    h.add([1, 2, 3], max_tokens=2, temperature=0.7, top_k=5, seed=2**64 - 1)
    h.add([4, 5], max_tokens=2, temperature=0.0, top_p=0.5, min_p=0.1)
    step = h.sched.schedule()
    sampling = h.builder.build(step.batch).sampling
    assert sampling.temperatures.tolist() == pytest.approx([0.7, 0.0])
    assert sampling.top_ks.tolist() == [5, -1]
    assert sampling.top_ps.tolist() == [1.0, 0.5] and sampling.min_ps.tolist() == pytest.approx([0.0, 0.1])
    # any Python int seed travels as its 64 bits; the unseeded row is marked by step -1
    assert sampling.seeds.tolist()[0] == -1 and sampling.steps.tolist() == [0, -1]
    h.update(step, [9, 9])  # a decode step next: the first row's second token
    sampling = h.builder.build(h.sched.schedule().batch).sampling
    assert sampling.steps.tolist() == [1, -1] and sampling.temperatures.tolist() == pytest.approx([0.7, 0.0])
    assert not sampling.all_greedy
