"""Qwen3-MoE and Mixtral end to end on CPU against HF: routing with and without renormalised
top-k, dense layers mixed in (``mlp_only_layers``, ``decoder_sparse_step``), chunked prefill,
prefix-cache hits and tensor parallelism (experts split by intermediate size)."""

import pytest
import torch

from nanovllm import SamplingParams
from tests.checkpoints import make_random_checkpoint
from tests.end_to_end.cached_twice import generate_twice

GREEDY = SamplingParams(0.0, 16, True)
BASE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, kvcache_block_size=16)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.0)
CHECKPOINTS = {
    "renormalised": ("Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=True, mlp_only_layers=[1])),
    "raw-top4-every-2nd": ("Qwen3MoeForCausalLM", dict(MOE, norm_topk_prob=False, num_experts_per_tok=4,
                                                       decoder_sparse_step=2, num_hidden_layers=3)),
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=40,
                                           sliding_window=None, router_aux_loss_coef=0.0)),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def moe_dir(request, tmp_path_factory) -> str:
    architecture, overrides = CHECKPOINTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    return make_random_checkpoint(path, architecture, seed=5, **overrides)


def test_greedy_matches_hf_chunked_and_cached(moe_dir, prompts, hf_reference):
    ours = generate_twice(moe_dir, prompts, GREEDY, dict(BASE, max_num_batched_tokens=24))
    assert ours == hf_reference(moe_dir, prompts, 16)


def test_tensor_parallel_matches_hf(moe_dir, prompts, hf_reference):
    batch = prompts[2:6]
    ours = generate_twice(moe_dir, batch, GREEDY, dict(BASE, tensor_parallel_size=2))
    assert ours == hf_reference(moe_dir, batch, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_fused_kernel_matches_hf(moe_dir, prompts, hf_reference, eager):
    options = dict(BASE, device="cuda", enforce_eager=eager, max_num_batched_tokens=24)
    assert generate_twice(moe_dir, prompts, GREEDY, options) == hf_reference(moe_dir, prompts, 16)
