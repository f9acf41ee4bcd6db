"""The fused MoE kernels with e4m3 experts (``quantization="fp8"``) against a float64 reference,
stage by stage (interpreter on CPU, compiled on CUDA at Qwen3-30B-A3B's shapes), and the layer's
loader of e4m3 experts."""

import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import fused_moe as fused_moe_module
from nanovllm.kernels.fp8 import (
    GROUP,
    quantize_per_token_group_ref,
    quantize_weight_blockwise_ref,
    quantize_weight_per_channel_ref,
)
from nanovllm.kernels.fused_moe import fused_moe, fused_moe_ref
from tests.interpreter import DEVICE, DTYPES
from tests.kernels.moe_cases import make_moe

pytestmark = pytest.mark.gpu

FP8_SMALL = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)  # the fp8 MMA's K is at least 32
# The sums' relative error (of the sum of absolute terms): fp32 sums of exact e4m3 products in the
# interpreter; Hopper's fp8 tensor cores sum each K step in reduced precision (about 14 bits)
# before the fp32 accumulation, as in tests/kernels/test_fp8.py
REL = 5e-3 if DEVICE == "cuda" else 1e-5


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[experts, rows, in]`` to e4m3 with one scale per expert and row (the layer's loader)."""
    q, scale = quantize_weight_per_channel_ref(w.reshape(-1, w.shape[-1]).float())
    return q.view(w.shape), scale.view(w.shape[:-1])


def quantize_expert_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[experts, rows, in]`` to e4m3 by 128 x 128 blocks of each expert's gate, up (the first
    and second half of ``w13``'s rows) or down rows, as an FP8 checkpoint stores them, with the
    blocks' scales kept per row: ``(weight, scale [experts, rows, ceil(in / 128)])``."""
    halves = w.chunk(2, dim=1) if w.shape[1] % 2 == 0 else (w,)
    weights, scales = [], []
    for e in range(w.shape[0]):
        parts = [quantize_weight_blockwise_ref(half[e].float()) for half in halves]
        weights.append(torch.cat([q for q, _ in parts]))
        scales.append(torch.cat([sc.repeat_interleave(GROUP, 0)[: q.shape[0]] for q, sc in parts]))
    return torch.stack(weights), torch.stack(scales)


def make_fp8_moe(
    tokens, experts, top_k, hidden, inter, dtype, seed=0, used=None, device=DEVICE, blocks=False
):
    """:func:`make_moe`'s routing with tokens and weight rows of magnitudes 0.3 to 3 (the scales
    differ), the weights in e4m3 (per row, or ``blocks``: by 128 x 128 blocks, the scales per row
    and 128 features): ``[x, w13, w2, weights, ids, w13_scale, w2_scale]``."""
    gen = torch.Generator().manual_seed(seed + 1)

    def magnitudes(n: int) -> torch.Tensor:
        return torch.logspace(-0.5, 0.5, n)[torch.randperm(n, generator=gen), None]

    x, w13, w2, weights, ids = make_moe(tokens, experts, top_k, hidden, inter, torch.float32, seed, used)
    quantize = quantize_expert_blocks if blocks else quantize_experts
    w13, w13_scale = quantize(w13.cpu() * magnitudes(2 * inter))
    w2, w2_scale = quantize(w2.cpu() * magnitudes(hidden))
    x = (x.cpu() * magnitudes(tokens)).to(dtype)
    return [t.to(device) for t in (x, w13, w2, weights, ids, w13_scale, w2_scale)]


def exact_pairs(a_fp8, a_scale, rows_of, w_fp8, w_scale, pair_expert):
    """Each pair's product with its expert's e4m3 rows in float64, computed as the reference
    computes it, and the sums of absolute terms that bound the kernels' rounding, ``[pairs,
    rows]``. Per-row scales: ``a_fp8[rows_of[p]] @ w_fp8[e].T * a_scale * w_scale[e]`` (exact sums
    of exact products); block scales (``w_scale [experts, rows, groups]``): both sides dequantized
    per 128 features first."""
    pairs, (n, k) = len(pair_expert), w_fp8.shape[1:]
    prod = torch.zeros(pairs, n, dtype=torch.float64, device=a_fp8.device)
    bound = torch.zeros_like(prod)
    for e in pair_expert.unique().tolist():
        sel = (pair_expert == e).nonzero().squeeze(1)
        a, w = a_fp8[rows_of[sel]].double(), w_fp8[e].double()
        if w_scale.dim() == 3:
            a = a * a_scale[rows_of[sel]].double().repeat_interleave(GROUP, dim=1)[:, :k]
            w = w * w_scale[e].double().repeat_interleave(GROUP, dim=1)[:, :k]
            prod[sel], bound[sel] = a @ w.T, a.abs() @ w.abs().T
            continue
        s_a, s_w = a_scale[rows_of[sel]].double().reshape(-1, 1), w_scale[e].double().reshape(1, -1)
        prod[sel] = (a @ w.T) * s_a * s_w
        bound[sel] = (a.abs() @ w.abs().T) * s_a * s_w
    return prod, bound


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An upper bound on one unit in the last place of ``dtype`` at ``v`` (subnormals included)."""
    info = torch.finfo(dtype)
    return info.eps * v.abs().clamp(min=info.tiny)


def check_fp8(monkeypatch, x, w13, w2, weights, ids, w13_scale, w2_scale, config=None):
    """The e4m3 kernels against a float64 reference, stage by stage (``monkeypatch`` lets the test
    see each GEMM's input as it is quantized). Gate / up: the kernel's
    ``silu(gate) * up`` (taken from the quantizer it is handed to) within the bound that the
    sums' errors (:data:`REL` x the sum of absolute terms) and one rounding each of gate, up, silu and
    the product allow. Down: from the kernel's own intermediate (an ulp there may move an e4m3
    value by a sixteenth, so the reference continues from it), each pair's product within :data:`REL`
    x its absolute terms and its roundings, summed over the token's experts. Also: the torch
    reference is exactly this float64 computation."""
    (tokens, hidden), inter = x.shape, w2.shape[2]
    top_k, dtype = ids.shape[1], x.dtype
    grouped = w13_scale.dim() == 3  # block scales: inputs rounded per 128 features
    calls = []

    def spy(a, group):
        calls.append((a, *quantize(a, group)))
        return calls[-1][1:]

    quantize = fused_moe_module.quantize_per_token_group
    monkeypatch.setattr(fused_moe_module, "quantize_per_token_group", spy)
    got = fused_moe(x, w13, w2, weights, ids, config, w13_scale=w13_scale, w2_scale=w2_scale)
    monkeypatch.undo()
    assert got.shape == x.shape and got.dtype == dtype
    assert len(calls) == 2 and calls[0][0] is x  # the tokens once, then the pairs' intermediates
    for a, q, s in calls:  # each GEMM's input rounded per row, over the whole row or per 128
        q_ref, s_ref = quantize_per_token_group_ref(a, group=GROUP if grouped else a.shape[1])
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    h_got, h_fp8, h_scale = calls[1]
    assert h_got.shape == (tokens * top_k, inter) and h_got.dtype == dtype

    pair_expert = ids.reshape(-1)
    pair_token = torch.arange(tokens * top_k, device=x.device) // top_k
    x_fp8, x_scale = calls[0][1:]
    gate_up, gu_bound = exact_pairs(x_fp8, x_scale, pair_token, w13, w13_scale, pair_expert)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    d_gate = REL * gu_bound[:, :inter] + ulp(gate, dtype)  # the sums' errors, one rounding
    d_up = REL * gu_bound[:, inter:] + ulp(up, dtype)
    act = F.silu(gate.to(dtype)).double()
    d_act = 1.1 * d_gate + 2 * ulp(act, dtype)  # |silu'| < 1.1; the rounding, fp32 exp's error
    h_ref = F.silu(gate.to(dtype)) * up.to(dtype)
    d_h = d_act * (up.abs() + d_up) + act.abs() * d_up + 2 * ulp(h_ref.double(), dtype)
    err = (h_got.double() - h_ref.double()).abs()
    assert (err <= 2 * d_h).all(), f"gate/up: max error {err.max().item():.3g}"

    def down(h_fp8, h_scale):
        """Each pair's weighted output rounded as the kernel rounds it, and its error bound."""
        pairs = torch.arange(len(pair_expert), device=x.device)
        prod, bound = exact_pairs(h_fp8, h_scale, pairs, w2, w2_scale, pair_expert)
        w = weights.reshape(-1, 1).float()
        out = (prod.to(dtype).float() * w).to(dtype)  # in fp32, as the kernels and HF multiply
        return out, (REL * bound + ulp(prod, dtype)) * w.double().abs() + ulp(out.double(), dtype)

    out, d_out = down(h_fp8, h_scale)
    want = out.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(dtype)
    tol = d_out.view(tokens, top_k, hidden).sum(1) + ulp(want.double(), dtype)
    err = (got.double() - want.double()).abs()
    assert (err <= 2 * tol).all(), f"down: max error {err.max().item():.3g}"

    # the torch reference (the CPU engine's path) computes exactly what this test computes
    ref = fused_moe_ref(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale)
    h_fp8, h_scale = quantize_per_token_group_ref(h_ref, group=GROUP if grouped else inter)
    out, _ = down(h_fp8, h_scale)
    assert torch.equal(ref, out.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(dtype))
    return got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 4), (8, 2)])
def test_fp8_kernel_matches_reference(dtype, tokens, experts, top_k, monkeypatch):
    # 80 / 72 fit no tile; default tiles (one K step of 128)
    check_fp8(monkeypatch, *make_fp8_moe(tokens, experts, top_k, 80, 72, dtype, seed=tokens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 17, 64])
@pytest.mark.parametrize("experts, top_k", [(4, 1), (4, 4), (8, 2)])
def test_fp8_block_kernel_matches_reference(dtype, tokens, experts, top_k, monkeypatch):
    # 300 / 200: three and two 128-feature groups, the last one short, so K steps meet their edges
    moe = make_fp8_moe(tokens, experts, top_k, 300, 200, dtype, seed=tokens, blocks=True)
    check_fp8(monkeypatch, *moe)
    check_fp8(monkeypatch, *moe, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32))  # several K steps a group


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, used", [(17, [1, 5]), (9, [0, 2, 3]), (5, [7])], ids=str)
def test_fp8_kernel_with_idle_experts_and_small_tiles(dtype, tokens, used, monkeypatch):
    top_k = min(2, len(used))
    moe = make_fp8_moe(tokens, 8, top_k, 112, 72, dtype, seed=len(used), used=used)
    check_fp8(monkeypatch, *moe, FP8_SMALL)  # several N tiles and K steps, in the accumulator
    check_fp8(monkeypatch, *moe, FP8_SMALL | dict(FAST_ACCUM=False))  # each K step summed apart


def test_fp8_kernel_on_a_strided_x_and_zero_rows(monkeypatch):
    x, w13, w2, weights, ids, w13_scale, w2_scale = make_fp8_moe(12, 4, 2, 48, 40, torch.float32)
    x[3] = 0.0  # a zero token: its scale is the least one, its products zeros
    x = torch.cat([x, x.flip(0)], dim=1)[:, :48]  # row stride 96
    w13[1, :5] = torch.zeros(5, 48, dtype=torch.float8_e4m3fn)  # zero weight rows
    first = check_fp8(monkeypatch, x, w13, w2, weights, ids, w13_scale, w2_scale, FP8_SMALL)
    again = fused_moe(x, w13, w2, weights, ids, FP8_SMALL, w13_scale=w13_scale, w2_scale=w2_scale)
    assert torch.equal(first, again)


def test_fp8_no_tokens_and_bad_inputs():
    x, w13, w2, weights, ids, w13_scale, w2_scale = make_fp8_moe(4, 4, 2, 48, 40, torch.float32)
    scales = dict(w13_scale=w13_scale, w2_scale=w2_scale)
    for moe in (fused_moe, fused_moe_ref):
        assert moe(x[:0], w13, w2, weights[:0], ids[:0], **scales).shape == (0, 48)
        with pytest.raises(ValueError, match="need w13_scale and w2_scale"):
            moe(x, w13, w2, weights, ids)
        with pytest.raises(ValueError, match="one per expert and output row"):
            moe(x, w13, w2, weights, ids, w13_scale=w13_scale[:, :40], w2_scale=w2_scale)
        with pytest.raises(ValueError, match="float32"):
            moe(x, w13, w2, weights, ids, w13_scale=w13_scale.half(), w2_scale=w2_scale)
        with pytest.raises(ValueError, match="e4m3 like w13"):
            moe(x, w13, w2.float(), weights, ids, **scales)
        with pytest.raises(ValueError, match="go with e4m3 weights"):
            moe(x, w13.float(), w2.float(), weights, ids, **scales)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe(x, w13, w2, weights, ids, dict(BLOCK_K=16), **scales)
    with pytest.raises(ValueError, match="unit stride"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=w13_scale.t().contiguous().t(), w2_scale=w2_scale)


def test_fp8_layer_loads_both_forms_alike_on_every_rank():
    """The layer's loader: per-expert tensors and transformers' stacked ones give the same e4m3
    weights and scales; a row's scale is its whole row's (down's rows split across ranks after);
    a dry run (meta parameter) writes nothing."""
    from nanovllm.layers.fused_moe import FusedMoE
    from nanovllm.layers.parallel import TPGroup

    experts, hidden, inter = 4, 48, 40
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * torch.logspace(-2, 2, hidden)
    down = torch.randn(experts, hidden, inter, generator=gen) * torch.logspace(-2, 2, inter)
    gate_up_fp8, gate_up_scale = quantize_experts(gate_up)
    down_fp8, down_scale = quantize_experts(down)
    for rank in range(2):
        tp, size = TPGroup(rank, 2), inter // 2
        stacked, per_expert = (FusedMoE(experts, hidden, inter, tp, "fp8") for _ in range(2))
        stacked.w13.weight_loader(stacked.w13, gate_up, (None, 0))
        stacked.w2.weight_loader(stacked.w2, down, (None, None))
        for e in range(experts):
            per_expert.w13.weight_loader(per_expert.w13, gate_up[e, :inter], (e, 0))
            per_expert.w13.weight_loader(per_expert.w13, gate_up[e, inter:], (e, 1))
            per_expert.w2.weight_loader(per_expert.w2, down[e], (e, None))
        gate = slice(rank * size, (rank + 1) * size)
        up = slice(inter + gate.start, inter + gate.stop)
        want = dict(
            w13=torch.cat([gate_up_fp8[:, gate], gate_up_fp8[:, up]], 1),
            w13_scale=torch.cat([gate_up_scale[:, gate], gate_up_scale[:, up]], 1),
            w2=down_fp8[:, :, gate],
            w2_scale=down_scale,
        )
        for layer in (stacked, per_expert):
            for name, value in want.items():
                param = getattr(layer, name)
                assert param.dtype == value.dtype and torch.equal(param.float(), value.float()), name
            assert layer.w13_scale.derived and layer.w2_scale.derived
        meta = torch.nn.Parameter(torch.empty_like(stacked.w2, device="meta"), requires_grad=False)
        stacked.w2.weight_loader(meta, (down * 3).to("meta"), (None, None))
        assert torch.equal(stacked.w2_scale, down_scale)
        with pytest.raises(ValueError, match="floating-point"):
            stacked.w2.weight_loader(meta, down.int().to("meta"), (None, None))
        with pytest.raises(ValueError, match="expected 3 dimensions"):
            stacked.w13.weight_loader(stacked.w13, gate_up[0], (None, 0))
    assert FusedMoE(experts, hidden, inter, TPGroup()).w13.dtype == torch.get_default_dtype()


# the compiled kernels at Qwen3-30B-A3B's expert shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 1024])
@pytest.mark.parametrize("blocks", [False, True], ids=["per_row", "blocks"])
def test_compiled_fp8_kernel_at_qwen3_30b_a3b_shapes(dtype, tokens, blocks, monkeypatch):
    moe = make_fp8_moe(tokens, 128, 8, 2048, 768, dtype, seed=tokens, device="cuda", blocks=blocks)
    check_fp8(monkeypatch, *moe)
    if not blocks:  # each K step summed apart, the sums' other form
        check_fp8(monkeypatch, *moe, dict(FAST_ACCUM=False))


def test_fp8_block_layer_loads_checkpoint_tensors_and_updates_alike_on_every_rank():
    """The layer's loaders for an FP8 checkpoint's experts: e4m3 weights as stored, each block's
    scale given to its rows (gate / up rows split across ranks, down's groups with its columns);
    a model-dtype update, per expert or stacked, quantized by blocks as the checkpoint was."""
    from nanovllm.layers.fused_moe import FusedMoE
    from nanovllm.layers.parallel import TPGroup

    experts, hidden, inter = 3, 256, 256
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[-1])

    gate, up = randn(experts, inter, hidden), randn(experts, inter, hidden)
    down = randn(experts, hidden, inter)
    stored = {
        name: [quantize_weight_blockwise_ref(w) for w in tensor]
        for name, tensor in (("gate", gate), ("up", up), ("down", down))
    }

    def expected(rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s part of each expert's stored weights and of their blocks' scales."""
        part, want = slice(rank * inter // 2, (rank + 1) * inter // 2), {}
        for e in range(experts):
            (gate_q, gate_s), (up_q, up_s), (down_q, down_s) = (stored[n][e] for n in ("gate", "up", "down"))
            per_row = [s.repeat_interleave(GROUP, 0)[:rows] for s, rows in ((gate_s, inter), (up_s, inter))]
            parts = dict(
                w13=torch.cat([gate_q[part], up_q[part]]),
                w13_scale=torch.cat([per_row[0][part], per_row[1][part]]),
                w2=down_q[:, part],
                w2_scale=down_s.repeat_interleave(GROUP, 0)[:hidden, rank : rank + 1],  # one group a rank
            )
            for name, value in parts.items():
                want.setdefault(name, []).append(value)
        return {name: torch.stack(values) for name, values in want.items()}

    for rank in range(2):
        tp, want = TPGroup(rank, 2), expected(rank)
        layers = [FusedMoE(experts, hidden, inter, tp, "fp8_block") for _ in range(3)]
        checkpoint, per_expert, stacked = layers
        for e in range(experts):
            for half, name in ((0, "gate"), (1, "up")):
                checkpoint.w13.weight_loader(checkpoint.w13, stored[name][e][0], (e, half))
                checkpoint.w13_scale.weight_loader(checkpoint.w13_scale, stored[name][e][1], (e, half))
                per_expert.w13.weight_loader(per_expert.w13, (gate if half == 0 else up)[e], (e, half))
            checkpoint.w2.weight_loader(checkpoint.w2, stored["down"][e][0], (e, None))
            checkpoint.w2_scale.weight_loader(checkpoint.w2_scale, stored["down"][e][1], (e, None))
            per_expert.w2.weight_loader(per_expert.w2, down[e], (e, None))
        stacked.w13.weight_loader(stacked.w13, torch.cat([gate, up], dim=1), (None, 0))
        stacked.w2.weight_loader(stacked.w2, down, (None, None))
        for layer in (checkpoint, per_expert, stacked):
            for name, value in want.items():
                param = getattr(layer, name)
                assert param.dtype == value.dtype and torch.equal(param.float(), value.float()), name
        with pytest.raises(ValueError, match="blocks of 128 rows"):
            checkpoint.w13_scale.weight_loader(checkpoint.w13_scale, stored["gate"][0][1][:1], (0, 0))
        with pytest.raises(ValueError, match="one expert's 2-d block scales"):
            checkpoint.w2_scale.weight_loader(checkpoint.w2_scale, stored["down"][0][1][None], (None, None))
