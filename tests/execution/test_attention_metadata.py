"""Attention metadata pads itself into a captured batch, whatever fields it has."""

import dataclasses

import pytest
import torch

from nanovllm.attention import AttentionMetadata


def decode_meta(n: int, width: int, offset: int) -> AttentionMetadata:
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.arange(n, dtype=torch.int64) + offset,
        context_lens=torch.arange(n, dtype=torch.int32) + 10 + offset,
        block_tables=torch.arange(n * width, dtype=torch.int32).view(n, width) + offset,
    )


def test_rows_are_copied_and_the_rest_padded_up_to_the_graph_size():
    static = decode_meta(8, 3, offset=100).static_copy()
    batch = decode_meta(3, 3, offset=0)
    static.copy_rows_from(batch, 6)
    assert static.slot_mapping.tolist()[:6] == [0, 1, 2, -1, -1, -1]
    assert static.context_lens.tolist()[:6] == [10, 11, 12, 1, 1, 1]
    assert torch.equal(static.block_tables[:3], batch.block_tables)
    assert (static.block_tables[3:6] == 0).all()
    # rows past the graph's size are not touched
    assert static.slot_mapping.tolist()[6:] == [106, 107]
    assert static.block_tables[6:].tolist() == decode_meta(8, 3, offset=100).block_tables[6:].tolist()


def test_static_copy_owns_its_buffers_and_first_rows_are_views():
    meta = decode_meta(4, 2, offset=0)
    static = meta.static_copy()
    static.slot_mapping.fill_(7)
    assert meta.slot_mapping.tolist() == [0, 1, 2, 3]
    view = static.first_rows(2)
    assert (
        view.block_tables.shape == (2, 2) and view.block_tables.data_ptr() == static.block_tables.data_ptr()
    )
    assert view.is_prefill is False and view.max_seqlen_q == meta.max_seqlen_q


def test_a_tensor_field_without_padding_value_is_refused():
    meta = dataclasses.replace(decode_meta(2, 2, 0), cu_seqlens_q=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q has no padding value"):
        meta.static_copy()
