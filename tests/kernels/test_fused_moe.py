"""The fused MoE kernels vs their torch reference (interpreter on CPU, device on GPU), the reference
vs Hugging Face's Qwen3-MoE sparse block, and the expert alignment on its own."""

import pytest
import torch

from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref
from nanovllm.kernels.moe_align import moe_align, moe_align_ref
from tests.interpreter import DEVICE, DTYPES
from tests.kernels.moe_cases import make_moe

pytestmark = pytest.mark.gpu

# the reference and the kernels round the same ops; only GEMM summation order differs, which may
# flip one rounding of an intermediate
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)  # several N tiles and K steps on small shapes


def check(x, w13, w2, weights, ids, config=None):
    ids = ids.to(DEVICE)
    got = fused_moe(x, w13, w2, weights, ids, config)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.shape == want.shape == x.shape and got.dtype == x.dtype
    tol = TOL[x.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 4), (8, 2), (8, 4)])
def test_kernel_matches_reference(dtype, tokens, experts, top_k):
    # 48 / 40 fit no tile; default tiles (64 tokens x 4 experts picks BLOCK_M 64)
    check(*make_moe(tokens, experts, top_k, 48, 40, dtype, seed=tokens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, used", [(17, [1, 5]), (9, [0, 2, 3]), (5, [7])], ids=str)
def test_kernel_with_idle_experts_and_small_tiles(dtype, tokens, used):
    top_k = min(2, len(used))
    check(*make_moe(tokens, 8, top_k, 80, 72, dtype, seed=len(used), used=used), SMALL)


@pytest.mark.parametrize("group_blocks", [0, 1, 2, 5, 7])
def test_program_order_changes_nothing(group_blocks):
    # blocks of pairs taken group_blocks at a time (0: all), each group's column tiles in turn:
    # every (block, column) tile still computed once, to the same bits as the default order; 12
    # blocks, 10 of them used, so that the last group is short and holds used blocks (7)
    moe = make_moe(64, 4, 2, 80, 72, torch.float32, seed=3)
    default = check(*moe, SMALL)
    assert torch.equal(check(*moe, SMALL | {"GROUP_BLOCKS": group_blocks}), default)


def test_kernel_on_a_strided_x_is_deterministic():
    x, w13, w2, weights, ids = make_moe(12, 4, 2, 48, 40, torch.float32)
    x = torch.cat([x, x.flip(0)], dim=1)[:, :48]  # row stride 96
    assert x.stride() == (96, 1)
    first = check(x, w13, w2, weights, ids)
    assert torch.equal(first, fused_moe(x, w13, w2, weights, ids.to(DEVICE)))


def test_no_tokens():
    x, w13, w2, weights, ids = make_moe(0, 4, 2, 48, 40, torch.float32)
    assert fused_moe(x, w13, w2, weights, ids.to(DEVICE)).shape == (0, 48)
    assert fused_moe_ref(x, w13, w2, weights, ids.to(DEVICE)).shape == (0, 48)


def hf_block(norm_topk_prob, dtype, experts=8, top_k=2, seed=0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    for p in block.parameters():  # the experts' weights are created empty
        torch.nn.init.normal_(p, std=0.2)
    return block.to(dtype)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [2, 4])
def test_reference_is_hf_sparse_moe_block(norm_topk_prob, top_k):
    block = hf_block(norm_topk_prob, torch.float32, top_k=top_k)
    x = torch.randn(1, 13, 64)
    with torch.no_grad():
        want = block(x)[0]
        _, weights, ids = block.gate(x[0])
        experts = block.experts  # transformers 5 stacks them: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        got = fused_moe_ref(x[0], experts.gate_up_proj, experts.down_proj, weights, ids)
    assert ids.shape == (13, top_k) and len(ids.unique()) > top_k
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_reference_rounds_like_hf_in_bf16():
    # with top_k 2 every rounding step is HF's, weights rounded to bf16 as HF's router rounds them
    block = hf_block(True, torch.bfloat16)
    x = torch.randn(1, 13, 64).bfloat16()
    with torch.no_grad():
        want = block(x)[0]
        _, weights, ids = block.gate(x[0])
        got = fused_moe_ref(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights.float(), ids)
    assert weights.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("align", [moe_align, moe_align_ref])
@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 1, 4, 16), (17, 2, 8, 16), (64, 4, 8, 4)])
def test_moe_align(align, tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=gen)  # the last expert is idle
    sorted_ids, expert_of_block, num_padded = align(ids.to(DEVICE), experts, block_m)
    sorted_ids, expert_of_block, used = sorted_ids.cpu().long(), expert_of_block.cpu().long(), int(num_padded)
    n = tokens * top_k
    assert sorted_ids.dtype == torch.long and len(sorted_ids) >= n + experts * (block_m - 1)
    assert len(sorted_ids) == len(expert_of_block) * block_m
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    valid = sorted_ids < n
    assert torch.equal(sorted_ids[valid].sort().values, torch.arange(n))  # each pair exactly once
    assert not valid[used:].any() and torch.all(sorted_ids[~valid] == n)  # padding marked invalid
    blocks = expert_of_block[: used // block_m]
    assert torch.all(blocks[1:] >= blocks[:-1])  # grouped by expert, in expert order
    assert torch.all(expert_of_block[used // block_m :] == experts)
    row_expert = blocks.repeat_interleave(block_m)
    for e in range(experts):  # each expert's rows contiguous, padded to block_m, pairs in order
        rows = sorted_ids[:used][row_expert == e]
        assert len(rows) % block_m == 0 and len(rows) - int(counts[e]) < block_m
        pairs = rows[rows < n]
        assert len(pairs) == counts[e] and torch.all(ids.flatten()[pairs] == e)
        assert torch.all(pairs[1:] > pairs[:-1])
        assert torch.all(rows[: len(pairs)] == pairs)  # padding after the pairs


@pytest.mark.parametrize(
    "tokens, top_k, experts, block_m",
    [(300, 8, 128, 16), (1000, 8, 128, 64), (40, 3, 512, 32), (9, 2, 6, 16), (64, 8, 128, 16)],
)
@pytest.mark.parametrize("one_program", [True, False])
def test_moe_align_kernel_equals_reference(tokens, top_k, experts, block_m, one_program):
    """Many chunks of pairs, experts not a power of two, more experts than pairs; both the one
    program and the three launches, whatever the size."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).to(DEVICE)
    got = moe_align(ids, experts, block_m, one_program=one_program)
    for got_part, want in zip(got, moe_align_ref(ids, experts, block_m), strict=True):
        assert torch.equal(got_part, want)


def test_bad_inputs_are_refused():
    x, w13, w2, weights, ids = make_moe(4, 4, 2, 48, 40, torch.float32)
    ids = ids.to(DEVICE)
    with pytest.raises(ValueError, match="must be 2-d"):
        fused_moe(x[None], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ValueError, match="do not fit"):
        fused_moe(x[:, :40], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x[:3], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="share one float dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="floating point"):
        fused_moe(x, w13, w2, ids, ids)
    with pytest.raises(ValueError, match="unit stride"):
        fused_moe(x.t().contiguous().t(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="2-d integer tensor"):
        moe_align(weights, 4, 16)
    with pytest.raises(ValueError, match="positive"):
        moe_align(ids, 4, 0)
