"""The paged prompt-attention kernel vs its torch reference and a naive computation, and both
attention kernels writing one mixed step's output; on CPU under the Triton interpreter, on a GPU
machine on the device too, as ``test_attention_kernels.py``.
"""

import pytest
import torch

from nanovllm.kernels import decode_attention as dec
from nanovllm.kernels import prefill_attention as pre
from tests.interpreter import DEVICE
from tests.kernels.paged_attention_cases import (
    DTYPES,
    LAYOUTS,
    check,
    make_cache,
    make_q,
    naive_attention,
    prefill_inputs,
)

pytestmark = pytest.mark.gpu


# (block_size, num_kv_heads, head_dim, prefixes, q_lens, pad); num_heads is always 8.
PREFILL_CASES = [
    (16, 8, 64, [0, 0, 19, 32, 5], [1, 37, 20, 5, 1], "neg"),
    (16, 2, 64, [0, 3], [70, 1], "garbage"),
    (32, 4, 64, [40, 0, 1], [9, 33, 64], "neg"),
    (32, 1, 128, [0, 50], [25, 14], "garbage"),
    (64, 2, 64, [70, 0], [3, 66], "neg"),
    (128, 2, 64, [200, 0, 64], [60, 130, 1], "garbage"),  # tiles within a block, many unmasked
]


@LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim,prefixes,q_lens,pad", PREFILL_CASES)
def test_prefill_attention(block_size, num_kv_heads, head_dim, prefixes, q_lens, pad, dtype, layout):
    args = prefill_inputs(prefixes, q_lens, block_size, num_kv_heads, head_dim, dtype, pad, layout)
    scale = head_dim**-0.5
    out = pre.paged_prefill_attention(*args, scale, max(q_lens), layout=layout)
    check(out, pre.paged_prefill_attention_ref(*args, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernels_write_into_rows_of_a_given_output(num_splits) -> None:
    """A mixed step's decode rows and prompt rows, each kernel writing its part of one output."""
    prefixes, q_lens = [0, 19], [9, 20]
    q_pre, k_cache, v_cache, cu, ctx, tables = prefill_inputs(prefixes, q_lens, 16, 2, 64, torch.float32)
    lens = [5, 40, 17]
    kd, vd, td, cd = make_cache(lens, 16, 2, 64, torch.float32, seed=3)
    q_dec = make_q(len(lens), 8, 2, 64, torch.float32, seed=4)
    out = torch.full((len(lens) + sum(q_lens) + 1, 8, 64), 7.0, device=DEVICE)  # a row past both
    d = len(lens)
    got_dec = dec.paged_decode_attention(q_dec, kd, vd, td, cd, 0.2, num_splits, out=out[:d])
    got_pre = pre.paged_prefill_attention(q_pre, k_cache, v_cache, cu, ctx, tables, 0.2, 20, out=out[d:-1])
    assert got_dec.data_ptr() == out.data_ptr() and got_pre.data_ptr() == out[d:].data_ptr()
    check(out[:d], dec.paged_decode_attention_ref(q_dec, kd, vd, td, cd, 0.2), torch.float32)
    check(
        out[d:-1],
        pre.paged_prefill_attention_ref(q_pre, k_cache, v_cache, cu, ctx, tables, 0.2),
        torch.float32,
    )
    assert torch.all(out[-1] == 7.0)


def test_kernels_refuse_an_output_unlike_q() -> None:
    k_cache, v_cache, tables, ctx = make_cache([5, 9], 16, 2, 64, torch.float32)
    q = make_q(2, 8, 2, 64, torch.float32)
    for bad in (torch.empty(3, 8, 64), torch.empty(2, 8, 64, dtype=torch.float16), torch.empty(2, 64, 8).mT):
        with pytest.raises(ValueError, match="out must be"):
            dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, out=bad.to(DEVICE))
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="out must be"):
        pre.paged_prefill_attention(
            q, k_cache, v_cache, cu, ctx, tables, 0.2, 1, out=torch.empty(2, 8, 32).to(DEVICE)
        )


def test_prefill_ref_vs_naive() -> None:
    prefixes, q_lens = [0, 19, 3], [1, 20, 30]
    q, k_cache, v_cache, cu, ctx, tables = prefill_inputs(
        prefixes, q_lens, 16, 2, 64, torch.float32, "garbage"
    )
    out = pre.paged_prefill_attention_ref(q, k_cache, v_cache, cu, ctx, tables, 0.2)
    for b in range(len(q_lens)):
        s, e = int(cu[b]), int(cu[b + 1])
        naive = naive_attention(q[s:e], k_cache, v_cache, tables[b], int(ctx[b]), 0.2)
        torch.testing.assert_close(out[s:e].double(), naive, atol=1e-5, rtol=1e-5)


def test_decode_matches_prefill_q_len_1() -> None:
    """Decode is prefill with one new token per sequence."""
    args = prefill_inputs([0, 20, 47], [1, 1, 1], 16, 2, 64, torch.float32)
    q, k_cache, v_cache, _, ctx, tables = args
    out = pre.paged_prefill_attention(*args, 0.2, 1)
    torch.testing.assert_close(out, dec.paged_decode_attention(q, k_cache, v_cache, tables, ctx, 0.2, 2))
