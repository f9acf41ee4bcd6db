"""Attention metadata declares the values of a decode step's padding rows."""

import pytest

from nanovllm.attention import AttentionMetadata


def test_padding_rows_store_nothing_and_read_one_key_in_their_own_place():
    assert AttentionMetadata.padding("slot_mapping") == -1
    assert AttentionMetadata.padding("context_lens") == 1
    assert AttentionMetadata.padding("decode_order") == -1


def test_a_field_without_padding_value_is_refused_by_name():
    with pytest.raises(ValueError, match=r"cu_seqlens_q has no padding value.*'context_lens'"):
        AttentionMetadata.padding("cu_seqlens_q")
