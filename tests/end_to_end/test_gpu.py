"""The engine on CUDA: every available backend, eager and with CUDA graphs, against HF."""

import importlib.util

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.small_batch_gemm import small_batch_gemm, small_batch_gemm_pays
from tests.checkpoints import make_random_checkpoint
from tests.conftest import hf_greedy
from tests.end_to_end.arrivals import num_mixed_steps, run_with_arrivals
from tests.end_to_end.hf_oracle import float8_kv_attention, hf_logits
from tests.end_to_end.prefill import prefill_logits
from tests.execution.halves_recorder import record_halves

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BACKENDS = ["triton", "torch"] + (["flash_attn"] if importlib.util.find_spec("flash_attn") else [])
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory) -> str:
    # head_dim 64 and GQA 4:1, as in real models, still small enough for an fp32 oracle
    return make_random_checkpoint(
        str(tmp_path_factory.mktemp("qwen3_gpu")),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
    )


def gpu_llm(model_dir: str, backend: str, eager: bool, **options) -> LLM:
    block = 256 if backend == "flash_attn" else options.pop("kvcache_block_size", 16)
    return LLM(
        model_dir,
        device="cuda",
        dtype=options.pop("dtype", "float32"),
        attention_backend=backend,
        enforce_eager=eager,
        kvcache_block_size=block,
        **{"max_model_len": 1024, "max_num_seqs": 20, **options},
    )


def assert_bf16_logits_as_close_as_hf(ours: torch.Tensor, model_dir: str, prompt: list[int]) -> None:
    """The stated tolerance: our bf16 logits' error against HF in fp32 is no worse than 1.5x HF's
    own bf16 error (+ slack)."""
    ref = hf_logits(model_dir, prompt, torch.bfloat16, "cuda")
    exact = hf_logits(model_dir, prompt, torch.float32, "cuda")
    ours_err = (ours - exact).abs().max().item()
    hf_err = (ref - exact).abs().max().item()
    assert ours_err <= 1.5 * hf_err + 0.02, (ours_err, hf_err)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_matches_hf(gpu_model_dir, prompts, hf_reference, backend, eager):
    # two rounds: the second hits the first's cached prefixes; 11 sequences use the size-16 graph
    batch = prompts + [p + [1, 2, 3] for p in prompts[3:7]]
    expected = hf_reference(gpu_model_dir, batch, 32)
    llm = gpu_llm(gpu_model_dir, backend, eager)
    try:
        for _ in range(2):
            outs = llm.generate(batch, GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == expected
    finally:
        llm.exit()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_preemption(gpu_model_dir, prompts, hf_reference, backend, eager):
    blocks = 3 if backend == "flash_attn" else 24
    llm = gpu_llm(
        gpu_model_dir,
        backend,
        eager,
        max_num_batched_tokens=37,
        num_kvcache_blocks=blocks,
        max_model_len=256 if backend != "flash_attn" else 512,
    )
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(gpu_model_dir, prompts, 32)
        assert llm.scheduler.num_preemptions > 0
    finally:
        llm.exit()


@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prompts_arriving_while_others_decode_match_hf(gpu_model_dir, prompts, hf_reference, backend, mixed):
    """With graphs and async scheduling: decodes share steps with prompt chunks (mixed) or
    wait for them (split); every step is planned while the one before runs."""
    llm = gpu_llm(
        gpu_model_dir, backend, False, max_num_batched_tokens=40, mixed_steps=mixed, async_scheduling=True
    )
    try:
        seqs, results = run_with_arrivals(llm, prompts, GREEDY)
        assert [s.completion_token_ids for s in seqs] == hf_reference(gpu_model_dir, prompts, 32)
        assert (num_mixed_steps(results) > 0) == mixed
    finally:
        llm.exit()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_kv_cache_keeps_most_greedy_tokens(gpu_model_dir, prompts, hf_reference, eager):
    """The Triton kernels store and read a float8 cache; prefix hits and decodes read it.

    On this random-weight model 25% of greedy tokens equal HF's (measured on the H200). Each
    sequence's first token comes from unquantised K/V (3% of all tokens): a cache read
    wrongly agrees on little more than those."""
    batch = prompts + [p + [1, 2, 3] for p in prompts[3:7]]
    expected = hf_reference(gpu_model_dir, batch, 32)
    llm = gpu_llm(gpu_model_dir, "triton", eager, kv_cache_dtype="fp8")
    try:
        assert llm.executor.runner.kv_cache.tensor.dtype == torch.float8_e4m3fn
        for _ in range(2):
            outs = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            same = sum(a == b for out, ref in zip(outs, expected) for a, b in zip(out, ref))
            assert same / sum(map(len, expected)) > 0.15, same / sum(map(len, expected))
    finally:
        llm.exit()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_fp8_kv_cache_matches_hf_reading_float8_kv(gpu_model_dir, prompts, eager):
    """HF's greedy tokens exactly, when HF's attention rounds K and V to e4m3 as the cache
    stores them; the second round reads float8 blocks the first one cached."""
    from transformers import AttentionInterface

    AttentionInterface.register("sdpa_float8_kv", float8_kv_attention)
    batch = prompts + [p + [1, 2, 3] for p in prompts[3:7]]
    expected = hf_greedy(gpu_model_dir, batch, 32, attn_implementation="sdpa_float8_kv")
    llm = gpu_llm(gpu_model_dir, "triton", eager, kv_cache_dtype="fp8")
    try:
        for _ in range(2):
            outs = [o["token_ids"] for o in llm.generate(batch, GREEDY, use_tqdm=False)]
            same = sum(a == b for out, ref in zip(outs, expected) for a, b in zip(out, ref))
            assert outs == expected, f"{same} of {sum(map(len, expected))} tokens"
    finally:
        llm.exit()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_close_to_hf(gpu_model_dir, prompts, backend):
    prompt = (prompts[-1] * 4)[:300]
    llm = gpu_llm(gpu_model_dir, backend, True, dtype="bfloat16")
    try:
        ours, _ = prefill_logits(llm, prompt)
    finally:
        llm.exit()
    assert_bf16_logits_as_close_as_hf(ours, gpu_model_dir, prompt)


def test_long_prompt_logits_close_to_hf(gpu_model_dir, monkeypatch):
    # long enough for cuDNN's attention where it runs (Hopper), the Triton kernel elsewhere
    import nanovllm.attention.cudnn_prefill as cudnn_prefill
    import nanovllm.attention.triton_backend as triton_backend
    from nanovllm.attention.cudnn_prefill import MIN_PROMPT_TOKENS, cudnn_prefill_supported

    monkeypatch.setattr(cudnn_prefill, "ENABLED", True)
    calls = []
    cudnn = triton_backend.cudnn_causal_prefill
    monkeypatch.setattr(triton_backend, "cudnn_causal_prefill", lambda *a: calls.append(1) or cudnn(*a))
    prompt = [3 + 7 * i % 500 for i in range(MIN_PROMPT_TOKENS + 100)]
    llm = gpu_llm(gpu_model_dir, "triton", True, dtype="bfloat16", max_model_len=4096)
    calls.clear()  # the start-up's own long prompts (memory profile, warm-up) went the same way
    try:
        ours, _ = prefill_logits(llm, prompt)
    finally:
        llm.exit()
    assert len(calls) == (3 if cudnn_prefill_supported(torch.device("cuda")) else 0)  # one a layer
    assert_bf16_logits_as_close_as_hf(ours, gpu_model_dir, prompt)


def test_long_context_decode_with_graphs(gpu_model_dir):
    prompt = [3 + i % 500 for i in range(1500)]
    llm = gpu_llm(gpu_model_dir, "triton", False, max_model_len=2048)
    try:
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
        )
    finally:
        llm.exit()
    from tests.conftest import hf_greedy

    assert out[0]["token_ids"] == hf_greedy(gpu_model_dir, [prompt], 8)[0]


def test_interrupted_generate_then_correct_with_graphs_and_async(
    gpu_model_dir, prompts, hf_reference, monkeypatch
):
    from nanovllm.execution.model_runner import PendingOutput

    llm = gpu_llm(gpu_model_dir, "triton", False, async_scheduling=True)
    try:
        result, calls = PendingOutput.result, [0]

        def interrupted(self):
            calls[0] += 1
            if calls[0] == 5:  # a decode step is in flight and the next one planned ahead
                raise KeyboardInterrupt
            return result(self)

        monkeypatch.setattr(PendingOutput, "result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        monkeypatch.undo()
        assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outs] == hf_reference(gpu_model_dir, prompts, 32)
    finally:
        llm.exit()


def test_small_batch_gemm_logits_close_to_hf(tmp_path, monkeypatch):
    # wide enough that every projection has a program for each SM: a prompt of 12 tokens, like a
    # decode batch of 12 rows, takes the small-batch kernel (enabled here, as by default) instead of cuBLAS
    import nanovllm.kernels.small_batch_gemm as small_batch_gemm_module
    import nanovllm.layers.activation as activation
    import nanovllm.layers.linear as linear

    model_dir = make_random_checkpoint(
        str(tmp_path), hidden_size=2304, intermediate_size=4608, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=4096,
    )  # fmt: skip
    monkeypatch.setattr(small_batch_gemm_module, "ENABLED", True)
    if not small_batch_gemm_pays(torch.zeros(12, 8, dtype=torch.bfloat16, device="cuda"), 2304):
        pytest.skip("this GPU has too many SMs for the test model's widths")
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return small_batch_gemm(*args, **kwargs)

    for layers in (linear, activation):
        monkeypatch.setattr(layers, "small_batch_gemm", counted)
    prompt = [5 + 7 * i for i in range(12)]
    llm = gpu_llm(model_dir, "triton", True, dtype="bfloat16")
    try:
        calls.clear()  # start-up's own forward passes
        ours, _ = prefill_logits(llm, prompt)
    finally:
        llm.exit()
    assert len(calls) == 2 * 4  # q/k/v, o, gate/up (with SwiGLU), down of both layers; not the LM head
    assert_bf16_logits_as_close_as_hf(ours, model_dir, prompt)


@pytest.mark.parametrize("mode", ["high", "offset-high", "attention-low"])
def test_decode_graphs_in_two_halves_match_hf(gpu_model_dir, prompts, hf_reference, monkeypatch, mode):
    # every graph from 2 rows up runs its batch as two halves on two streams; rows of different
    # lengths, so that each half's own longest-first order matters
    captured = record_halves(monkeypatch, mode, 2)
    batch = prompts + [p + [1, 2, 3] for p in prompts[3:7]]
    expected = hf_reference(gpu_model_dir, batch, 32)
    llm = gpu_llm(gpu_model_dir, "triton", False)
    try:
        assert min(captured) == 2 and max(captured) == 20  # the ladder's sizes, each in halves
        for _ in range(2):
            outs = llm.generate(batch, GREEDY, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == expected
    finally:
        llm.exit()
