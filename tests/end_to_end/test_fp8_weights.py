"""FP8 weights (``quantization="fp8"``) against Hugging Face transformers running the same
rounding (``fp8_oracle``): every decoder linear's weight in per-channel e4m3, its input rounded to
e4m3 per token (per rank's slice of the input, for row-parallel layers), each product exact."""

import pytest
import torch

from nanovllm import LLM
from tests.checkpoints import make_random_checkpoint
from tests.end_to_end.fp8_oracle import (
    GREEDY,
    OPTIONS,
    assert_greedy_up_to_near_ties,
    hf_fp8_model,
    hf_generate,
)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def test_greedy_equals_hf_with_the_same_rounding(tmp_path, prompts, arch, tp):
    path = make_random_checkpoint(str(tmp_path), arch, seed=7)  # Qwen2: q/k/v biases too
    expected = hf_generate(hf_fp8_model(path, tp), prompts)
    with LLM(path, quantization="fp8", tensor_parallel_size=tp, **OPTIONS) as llm:
        qkv = llm.apply_model(lambda model: model.model.layers[0].self_attn.qkv_proj.weight.dtype)
        assert qkv == [torch.float8_e4m3fn] * tp
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits
        assert [o.outputs[0].token_ids for o in again] == expected


def test_fp8_weights_with_an_fp8_kv_cache_equal_hf_rounding_both(qwen3_dir, prompts):
    """Both roundings at once: HF's linears as above, its attention reading K and V rounded to
    e4m3 as the FP8 cache stores them."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from tests.end_to_end.hf_oracle import float8_kv_attention

    AttentionInterface.register("sdpa_float8_kv", float8_kv_attention)
    hf = AutoModelForCausalLM.from_pretrained(
        qwen3_dir, dtype=torch.float32, attn_implementation="sdpa_float8_kv"
    )
    expected = hf_generate(hf_fp8_model(hf), prompts)
    assert expected != hf_generate(hf_fp8_model(qwen3_dir), prompts)  # the cache's rounding shows
    with LLM(qwen3_dir, quantization="fp8", kv_cache_dtype="fp8", **OPTIONS) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_weight_update_is_quantized_again(qwen3_dir, prompts):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    with LLM(qwen3_dir, quantization="fp8", **OPTIONS) as llm:
        llm.load_weights(policy.named_parameters())
        with pytest.raises(ValueError, match="expected a floating-point tensor"):
            llm.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.int32))])
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_generate(hf_fp8_model(policy), prompts)


def test_fp8_weights_take_half_the_bytes_of_bf16(qwen3_dir):
    def linear_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" in n)

    with LLM(qwen3_dir, **{**OPTIONS, "dtype": "bfloat16"}) as plain:
        bf16 = plain.apply_model(linear_bytes)[0]
    with LLM(qwen3_dir, quantization="fp8", **{**OPTIONS, "dtype": "bfloat16"}) as llm:
        fp8 = llm.apply_model(linear_bytes)[0]
    assert fp8 < 0.55 * bf16


def test_other_quantization_methods_are_refused(tmp_path):
    path = make_random_checkpoint(str(tmp_path), "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(path, **OPTIONS, quantization="awq")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_greedy_choices_are_hf_argmax_up_to_near_ties(qwen3_dir, prompts, dtype, eager):
    """On CUDA the products run on fp8 tensor cores (the Triton GEMM; in bf16 from 129 rows cuBLAS),
    whose MMA keeps ~14 bits in its sums: not exact as on the CPU, so a random model's near-ties
    may go either way and greedy runs part. The oracle (:func:`assert_greedy_up_to_near_ties`):
    HF with the same rounding and each product exact, teacher-forced on our completions; in bf16
    its allowance takes bf16's own effect on the FP8 model too (a bf16 rounding that moves an
    activation across an e4m3 boundary moves it a whole e4m3 step, so on this random model bf16
    moves the logits about as much as FP8 does)."""
    from transformers import AutoModelForCausalLM

    hf_fp8 = hf_fp8_model(qwen3_dir)
    hf_fp8_bf16 = hf_fp8_model(AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16))
    plain = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    options = dict(OPTIONS, device="cuda", dtype=dtype, enforce_eager=eager)
    with LLM(qwen3_dir, quantization="fp8", **options) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    bf16_twin = hf_fp8_bf16 if dtype == "bfloat16" else None
    argmax, unquantized, total = assert_greedy_up_to_near_ties(hf_fp8, plain, bf16_twin, prompts, completions)
    print(
        f"{dtype}: of {total} greedy tokens {argmax} are the exact emulation's argmax, {unquantized} "
        "the unquantized model's (teacher-forced)"
    )
