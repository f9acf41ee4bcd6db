"""A step mixing decode rows and prompt chunks: the attention layer gives each row what it
would get alone, with the torch reference and with the Triton kernels (interpreter on CPU)."""

import math

import pytest
import torch

from nanovllm.attention import QKTransform, get_attention_backend
from nanovllm.config import Config
from nanovllm.execution.step_inputs import StepInputBuilder
from nanovllm.layers.attention import Attention
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.step import BlockTableUpdate, NewSlot, StepBatch
from tests.interpreter import DEVICE

# on a GPU machine these run on the device too (``-m gpu``); on CPU, under the interpreter
pytestmark = pytest.mark.gpu

BLOCK, HEADS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 16, 4, 2, 64, 24
# (start, num_tokens): two decodes, a prompt with no cached prefix, a chunk after a prefix
ROWS = [(20, 1), (5, 1), (0, 9), (17, 6)]


def naive(q, keys, values, start):
    """Causal attention of queries at positions start.. over keys 0.., heads grouped."""
    keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    values = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) / math.sqrt(HEAD_DIM)
    q_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float())


@pytest.fixture(scope="module")
def config(qwen3_dir) -> Config:
    return Config(qwen3_dir, device="cpu", kvcache_block_size=BLOCK, max_num_seqs=8, max_model_len=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_mixed_step_attends_as_each_row_alone(config, backend, dtype):
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(NUM_BLOCKS, generator=gen).view(len(ROWS), -1)[:, :2].tolist()
    batch = StepBatch(
        slots=list(range(len(ROWS))),
        num_tokens=[n for _, n in ROWS],
        token_ids=[0] * sum(n for _, n in ROWS),
        start_positions=[s for s, _ in ROWS],
        num_single_token_rows=2,
        new_slots=[NewSlot(r, s + n, SamplingParams()) for r, (s, n) in enumerate(ROWS)],
        block_table_updates=[BlockTableUpdate(r, 0, t) for r, t in enumerate(tables)],
    )
    builder = StepInputBuilder(config, torch.device(DEVICE), samples=False)
    inputs = builder.build(batch)
    inputs.resolve(torch.zeros(len(ROWS), dtype=torch.int64), builder.slot_table.block_tables.device)
    meta = inputs.meta
    assert meta.is_prefill and meta.num_decode_tokens == 2 and meta.has_prefix
    assert meta.seqlens_q == (9, 6)  # the prompt rows, on the host

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache, v_cache = (
        rand(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM),
        rand(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM),
    )
    num_tokens = sum(n for _, n in ROWS)
    q, k, v = (
        rand(num_tokens, HEADS, HEAD_DIM),
        rand(num_tokens, KV_HEADS, HEAD_DIM),
        rand(num_tokens, KV_HEADS, HEAD_DIM),
    )
    expected, offset = [], 0
    for (start, n), table in zip(ROWS, tables):
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start)], dtype=torch.long)
        keys = torch.cat((k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], k[offset : offset + n]))
        values = torch.cat((v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots], v[offset : offset + n]))
        expected.append(naive(q[offset : offset + n], keys, values, start))
        offset += n

    layer = Attention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, get_attention_backend(backend))
    layer.k_cache, layer.v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    # a rotary table of cos 1, sin 0 leaves q and k as they are: this test is about attention
    identity = torch.cat((torch.ones(128, HEAD_DIM // 2), torch.zeros(128, HEAD_DIM // 2)), dim=-1)
    positions = torch.cat([torch.arange(s, s + n) for s, n in ROWS])
    transform = QKTransform(positions.to(DEVICE), identity.to(DEVICE))
    out = layer(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), transform, meta)
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float().cpu(), torch.cat(expected), atol=tol, rtol=tol)
    # the layer stored every token's K/V in its slot first
    for (start, n), table, offset in zip(ROWS, tables, (0, 1, 2, 11)):
        for i, p in enumerate(range(start, start + n)):
            stored = layer.k_cache[table[p // BLOCK], p % BLOCK].cpu()
            torch.testing.assert_close(stored, k[offset + i], atol=0, rtol=0)
