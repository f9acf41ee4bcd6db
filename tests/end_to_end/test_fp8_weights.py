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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_bf16_greedy_agrees_with_hf_with_the_same_rounding(qwen3_dir, prompts, eager):
    """In bf16 the prefill's products run on cuBLAS (``torch._scaled_mm``) and the decode steps'
    on the Triton kernel. The oracle: HF in bf16 on the same device with each FP8 product exact.
    The rest of the two bf16 models (attention, norms) rounds differently, and a random model's
    logits are close, so completions part after a token or two (agreement printed); the first
    token, the prefill's, must agree."""
    from transformers import AutoModelForCausalLM

    hf = hf_fp8_model(AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.bfloat16).to("cuda"))
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p], device="cuda"), max_new_tokens=12, do_sample=False, pad_token_id=0
            )
            expected.append(out[0, len(p) :].tolist())
    options = dict(OPTIONS, device="cuda", dtype="bfloat16", enforce_eager=eager)
    with LLM(qwen3_dir, quantization="fp8", **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e))
    print(f"bf16 FP8 vs HF's bf16 FP8 emulation: {same} of {sum(map(len, expected))} tokens agree")
    assert [g[:1] for g in got] == [e[:1] for e in expected]


BLOCK_MODEL = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_block_checkpoint(source: str, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``source``'s checkpoint as Qwen3-*-FP8 ships: each decoder linear's weight in e4m3 with
    its 128 x 128 blocks' ``weight_scale_inv``; returns those, by weight name."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from nanovllm.kernels.fp8 import quantize_weight_blockwise_ref

    tensors, quantized = load_file(os.path.join(source, "model.safetensors")), {}
    for name in list(tensors):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            weight, scale_inv = quantize_weight_blockwise_ref(tensors[name])
            tensors[name], tensors[name + "_scale_inv"] = weight, scale_inv
            quantized[name] = (weight, scale_inv)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(source, "generation_config.json"), path)
    return quantized


def block_forward(weight_fp8: torch.Tensor, scale_inv: torch.Tensor, bias, parts: int):
    """What nanovllm's FP8 block layer computes on ``parts`` ranks (float64 inside)."""
    weight = (
        weight_fp8.double()
        * scale_inv.double()
        .repeat_interleave(128, 0)
        .repeat_interleave(128, 1)[: weight_fp8.shape[0], : weight_fp8.shape[1]]
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows, y = x.reshape(-1, x.shape[-1]), 0
        for x_part, w_part in zip(rows.chunk(parts, dim=-1), weight.chunk(parts, dim=-1)):
            x_fp8, x_scales = quantize_per_token_group_ref(x_part, group=128)
            x_deq = x_fp8.double() * x_scales.double().repeat_interleave(128, 1)[:, : x_part.shape[-1]]
            y = y + (x_deq @ w_part.T).to(x.dtype)
        return (y + (bias if bias is not None else 0)).view(*x.shape[:-1], -1)

    return forward


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_an_fp8_block_checkpoint_loads_as_stored_and_matches_its_dequantized_twin(tmp_path, prompts, tp):
    """Teacher-forced on the twin's greedy completions: rounding activations to e4m3 turns the
    last-ulp differences between two float32 implementations of attention and norms (1e-6 here)
    into an occasional different e4m3 value, so tokens are compared position by position, not
    as whole greedy runs."""
    from transformers import AutoModelForCausalLM

    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=9, **BLOCK_MODEL)
    quantized = write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    twin = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    twin.generation_config.eos_token_id = None
    for name, module in twin.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            module.forward = block_forward(*quantized[name + ".weight"], module.bias, parts)
    sequences = [p + c for p, c in zip(prompts, hf_generate(twin, prompts))]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=tp, **OPTIONS) as llm:
        assert llm.config.quantization == "fp8"
        stored = llm.apply_model(lambda model: model.model.layers[0].self_attn.o_proj.weight.dtype)
        assert stored == [torch.float8_e4m3fn] * tp
        outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    agree = total = close = 0
    for sequence, output in zip(sequences, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(twin(torch.tensor([sequence])).logits[0, :-1].float(), dim=-1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], sequence[1:])])
        gap = (ours - reference.gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)).abs()
        assert gap.max() < 0.25  # a flipped e4m3 value moves a log-probability by ~0.1 at most here
        close += int((gap < 1e-4).sum())
        top = [
            max(lp, key=lambda t: lp[t].logprob if lp[t].rank == 1 else float("-inf"))
            for lp in output.prompt_logprobs[1:]
        ]
        agree += sum(a == b for a, b in zip(top, reference.argmax(dim=-1).tolist()))
        total += len(top)
    assert close >= 0.95 * total and agree >= 0.97 * total, (close, agree, total)


def test_an_fp8_block_model_takes_model_dtype_updates(tmp_path, prompts):
    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=9, **BLOCK_MODEL)
    write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    updated = make_random_checkpoint(str(tmp_path / "new"), "Qwen3ForCausalLM", seed=10, **BLOCK_MODEL)
    expected_dir = str(tmp_path / "new_fp8")
    write_fp8_block_checkpoint(updated, expected_dir)
    with LLM(expected_dir, **OPTIONS) as reference:
        expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    from safetensors.torch import load_file

    with LLM(str(tmp_path / "fp8"), **OPTIONS) as llm:
        llm.load_weights(
            load_file(f"{updated}/model.safetensors").items()
        )  # bf16/fp32 tensors: quantized here
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
