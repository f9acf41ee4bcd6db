"""FP8 weights (``quantization="fp8"``) against Hugging Face transformers running the same
rounding: every decoder linear's weight in per-channel e4m3, its input rounded to e4m3 per token
(per rank's slice of the input, for row-parallel layers), each product exact."""

import pytest
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from nanovllm.kernels.fp8 import (
    quantize_per_token_group_ref,
    quantize_weight_per_channel_ref,
)
from tests.checkpoints import make_random_checkpoint

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ROW_PARALLEL = ("o_proj", "down_proj")  # their input is split across ranks


def fp8_forward(weight: torch.Tensor, bias: torch.Tensor | None, parts: int):
    """A linear layer's forward as nanovllm's FP8 layer computes it on ``parts`` ranks: the
    weight per output channel in e4m3, the input per token (per rank's slice of it) in e4m3,
    each rank's product exact (float64), rounded, the partial products summed in rank order."""
    weight_fp8, weight_scale = quantize_weight_per_channel_ref(weight)

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = 0
        for x_part, w_part in zip(rows.chunk(parts, dim=-1), weight_fp8.chunk(parts, dim=-1)):
            x_fp8, x_scale = quantize_per_token_group_ref(x_part, group=x_part.shape[-1])
            exact = (x_fp8.double() @ w_part.double().T) * x_scale.double() * weight_scale.double()
            y = y + exact.to(x.dtype)  # each rank's part rounded, then summed in rank order
        y = y + (bias if bias is not None else 0)
        return y.view(*x.shape[:-1], -1)

    return forward


def hf_fp8_model(model_or_dir, tp: int = 1):
    """A Hugging Face model whose decoder linears compute what nanovllm's FP8 layers compute."""
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if isinstance(model_or_dir, str):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    for name, module in model.model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "gate":
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            module.forward = fp8_forward(module.weight.data, module.bias, parts)
    return model


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int = 12) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


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


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(quantization="awq"), "quantization='awq' is not supported"),
        (dict(quantization="fp8", architecture="Qwen3MoeForCausalLM"), "mixture-of-experts"),
    ],
)
def test_unsupported_settings_are_refused(tmp_path, options, message):
    architecture = options.pop("architecture", "Qwen3ForCausalLM")
    moe = (
        dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) if "Moe" in architecture else {}
    )
    path = make_random_checkpoint(str(tmp_path), architecture, **moe)
    with pytest.raises(ValueError, match=message):
        LLM(path, **OPTIONS, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_greedy_equals_hf_with_the_same_rounding(qwen3_dir, prompts, eager):
    expected = hf_generate(hf_fp8_model(qwen3_dir), prompts)
    options = dict(OPTIONS, device="cuda", enforce_eager=eager)
    with LLM(qwen3_dir, quantization="fp8", **options) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
