"""Decode steps run as two halves (``NANOVLLM_DECODE_HALVES``): the same tokens as HF, on CPU
through the padded decode path (on CUDA the halves run on two streams: ``tests/end_to_end/test_gpu.py``)."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention import AttentionMetadata
from nanovllm.execution.decode_halves import halves_setting, rows_of
from tests.execution.halves_recorder import record_halves


@pytest.mark.parametrize(
    "mode, min_rows, error",
    [
        ("both", "768", "NANOVLLM_DECODE_HALVES must be one of"),
        ("high", "1", "integer >= 2"),
        ("high", "x", "integer >= 2"),
    ],
)
def test_bad_settings_are_refused(monkeypatch, mode, min_rows, error):
    monkeypatch.setenv("NANOVLLM_DECODE_HALVES", mode)
    monkeypatch.setenv("NANOVLLM_DECODE_HALVES_MIN_ROWS", min_rows)
    with pytest.raises(ValueError, match=error):
        halves_setting()


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("NANOVLLM_DECODE_HALVES", raising=False)
    monkeypatch.delenv("NANOVLLM_DECODE_HALVES_MIN_ROWS", raising=False)
    assert halves_setting() == ("off", 768)


def test_rows_of_a_batch_run_longest_first():
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.arange(6),
        context_lens=torch.tensor([5, 9, 2, 7, 7, 1]),
        block_tables=torch.arange(12).view(6, 2),
        decode_order=torch.tensor([1, 3, 4, 0, 2, 5], dtype=torch.int32),
    )
    half = rows_of(meta, 3, 6)
    assert half.context_lens.tolist() == [7, 7, 1]
    assert half.block_tables.tolist() == [[6, 7], [8, 9], [10, 11]]
    assert half.slot_mapping.tolist() == [3, 4, 5]
    assert half.decode_order.tolist() == [0, 1, 2]  # its own rows, not the whole batch's
    assert rows_of(meta, 0, 3).decode_order.tolist() == [1, 0, 2]


def test_decode_steps_in_halves_match_hf(qwen3_dir, prompts, hf_reference, monkeypatch):
    # every padded size from 2 rows up runs in halves; rows of different lengths, a block edge crossed
    sizes = record_halves(monkeypatch, "offset-high", 2)
    batch = prompts[:5]
    options = dict(kvcache_block_size=16, max_model_len=128, max_num_seqs=8)
    llm = LLM(qwen3_dir, device="cpu", dtype="float32", **options)
    try:
        runner = llm.executor.runner
        runner.graphs = runner._capture_decode_graphs(capture=False)  # padded, fixed inputs, eager
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(batch, greedy, use_tqdm=False)
    finally:
        llm.exit()
    assert [o["token_ids"] for o in outs] == hf_reference(qwen3_dir, batch, 8)
    assert sizes and min(sizes) >= 2 and 8 in sizes  # the 5 rows ran padded to 8, in halves
