"""The MoE router kernel vs its torch reference (interpreter on CPU, device on GPU), the reference
vs Hugging Face's routing, ties to the lower expert id in both, and the argument checks."""

import pytest
import torch

from nanovllm.kernels.moe_router import route, route_ref
from tests.interpreter import DEVICE, DTYPES

pytestmark = pytest.mark.gpu

# the kernel's fp32 exp and sum vs torch's: last bits, then at most one rounding of the dtype apart
RTOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
TOKENS = [1, 3, 37, 130]
CASES = [(8, 1), (8, 2), (8, 8), (60, 2), (60, 4), (128, 1), (128, 4), (128, 8)]  # (experts, top_k)


def untied_logits(tokens: int, experts: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Each token's logits a shuffle of ``experts`` levels ~6 / experts apart (a random scale and
    offset each): distinct in every dtype, and neighbouring probabilities a few percent apart, far
    from rounding, so that the top-k choice is unambiguous."""
    gen = torch.Generator().manual_seed(seed)
    levels = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).float()
    scale = 0.5 + torch.rand(tokens, 1, generator=gen)
    offset = 4 * torch.rand(tokens, 1, generator=gen) - 2
    return ((levels - experts / 2) * (6 / experts) * scale + offset).to(dtype)


def hf_route(logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3MoeTopKRouter's routing as transformers writes it (Mixtral's: always renormalised)."""
    router_probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if renormalise:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_top_value.to(logits.dtype), router_indices


def assert_routes_match(got, want, dtype):
    (weights, ids), (weights_ref, ids_ref) = got, want
    assert ids.dtype == ids_ref.dtype == torch.int64 and weights.dtype == weights_ref.dtype == dtype
    assert weights.shape == ids.shape == ids_ref.shape
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(weights.cpu(), weights_ref.cpu(), rtol=RTOL[dtype], atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalise", [False, True], ids=["raw", "renormalised"])
@pytest.mark.parametrize("experts, top_k", CASES)
def test_kernel_matches_reference(experts, top_k, renormalise, dtype):
    for tokens in TOKENS:
        logits = untied_logits(tokens, experts, dtype, seed=tokens).to(DEVICE)
        weights, ids = route(logits, top_k, renormalise)
        assert weights.shape == (tokens, top_k) and weights.is_contiguous() and ids.is_contiguous()
        assert_routes_match((weights, ids), route_ref(logits, top_k, renormalise), dtype)
        if renormalise:
            torch.testing.assert_close(weights.float().sum(-1).cpu(), torch.ones(tokens), rtol=0, atol=1e-2)


def test_kernel_on_many_experts_strided_rows_and_no_tokens():
    """256 experts (a wide row, one program for few tokens), every expert chosen, logits a slice
    of a wider tensor (a row stride past the experts), and zero tokens (nothing launched)."""
    logits = untied_logits(9, 256, torch.float32).to(DEVICE)
    assert_routes_match(route(logits, 8, True), route_ref(logits, 8, True), torch.float32)
    logits = untied_logits(5, 12, torch.float32, seed=1)
    assert_routes_match(route(logits.to(DEVICE), 12, False), route_ref(logits, 12, False), torch.float32)
    wide = untied_logits(6, 40, torch.float32, seed=2).to(DEVICE)[:, 3:23]
    assert wide.stride(0) == 40
    assert_routes_match(route(wide, 3, True), route_ref(wide, 3, True), torch.float32)
    weights, ids = route(torch.empty(0, 8, device=DEVICE), 2, True)
    assert weights.shape == ids.shape == (0, 2) and ids.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalise", [False, True], ids=["raw", "renormalised"])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (60, 4), (128, 8)])
def test_reference_is_hf_routing(experts, top_k, renormalise, dtype):
    """Without ties the reference's stable sort picks what ``torch.topk`` picks, bit for bit."""
    logits = untied_logits(37, experts, dtype, seed=3)
    weights, ids = route_ref(logits, top_k, renormalise)
    weights_hf, ids_hf = hf_route(logits, top_k, renormalise)
    assert torch.equal(ids, ids_hf) and torch.equal(weights, weights_hf)
    randn = torch.randn(64, experts, generator=torch.Generator().manual_seed(4))  # fp32: no ties
    weights, ids = route_ref(randn, top_k, renormalise)
    weights_hf, ids_hf = hf_route(randn, top_k, renormalise)
    assert torch.equal(ids, ids_hf) and torch.equal(weights, weights_hf)


def tied_logits(experts: int, top_k: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``low < high`` share one logit, the ``top_k``-th largest, so only one of them fits
    in the top k: ``top_k - 1`` other experts clearly above the pair, the rest below (two rows,
    the others shuffled differently)."""
    gen = torch.Generator().manual_seed(low * experts + high)
    rows = []
    for _ in range(2):
        others = [e for e in torch.randperm(experts, generator=gen).tolist() if e not in (low, high)]
        row = torch.empty(experts)
        row[others[: top_k - 1]] = 5.0 + torch.arange(top_k - 1.0)
        row[others[top_k - 1 :]] = -1.0 - torch.arange(experts - top_k - 1.0)
        row[[low, high]] = 2.5
        rows.append(row * 0.5)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "experts, top_k, low, high", [(8, 1, 2, 5), (8, 2, 6, 7), (8, 2, 0, 7), (60, 4, 17, 3), (128, 8, 100, 9)]
)
def test_ties_go_to_the_lower_id(experts, top_k, low, high, dtype):
    low, high = min(low, high), max(low, high)
    logits = tied_logits(experts, top_k, low, high, dtype)
    _, ids_ref = route_ref(logits, top_k, True)
    assert (ids_ref[:, -1] == low).all() and not (ids_ref == high).any()
    assert torch.equal(route(logits.to(DEVICE), top_k, True)[1].cpu(), ids_ref)
    # inside the top k, both tied experts chosen, the lower id first
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 3.0, 0.5, 3.0]], dtype=dtype)
    for _, ids in (route_ref(logits, 6, False), route(logits.to(DEVICE), 6, False)):
        assert ids.cpu().tolist() == [[1, 3, 5, 7, 4, 2]]
    uniform = torch.zeros(3, experts, dtype=dtype)
    for weights, ids in (route_ref(uniform, top_k, False), route(uniform.to(DEVICE), top_k, False)):
        assert torch.equal(ids.cpu(), torch.arange(top_k).expand(3, top_k))
        torch.testing.assert_close(
            weights.float().cpu(), torch.full((3, top_k), 1 / experts), rtol=1e-3, atol=0
        )


@pytest.mark.parametrize("fn", [route, route_ref], ids=["kernel", "reference"])
def test_bad_arguments(fn):
    logits = torch.zeros(4, 8, device=DEVICE)
    for top_k in (0, 9, -1):
        with pytest.raises(ValueError, match="top_k"):
            fn(logits, top_k, True)
    with pytest.raises(ValueError, match="2-d"):
        fn(logits[0], 2, True)
    with pytest.raises(ValueError, match="floating"):
        fn(torch.zeros(4, 8, dtype=torch.int32, device=DEVICE), 2, True)
    if fn is route:
        with pytest.raises(ValueError, match="unit stride"):
            route(torch.zeros(8, 4, device=DEVICE).t(), 2, True)
        with pytest.raises(ValueError, match="above"):
            route(torch.zeros(1, 2048, device=DEVICE), 2, True)
