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
from tests.conftest import hf_greedy

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


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(quantization="awq"), "quantization='awq' is not supported"),
        (dict(architecture="Qwen3MoeForCausalLM", fp8_blocks=True), "mixture-of-experts"),
    ],
)
def test_unsupported_settings_are_refused(tmp_path, options, message):
    import json

    architecture = options.pop("architecture", "Qwen3ForCausalLM")
    fp8_blocks = options.pop("fp8_blocks", False)
    moe = (
        dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) if "Moe" in architecture else {}
    )
    path = make_random_checkpoint(str(tmp_path), architecture, **moe)
    if fp8_blocks:  # an FP8 checkpoint's config (its block-scaled experts are not read: refused first)
        with open(f"{path}/config.json") as f:
            config = json.load(f)
        config["quantization_config"] = dict(
            quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128]
        )
        with open(f"{path}/config.json", "w") as f:
            json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(path, **OPTIONS, **options)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_greedy_choices_are_hf_argmax_up_to_near_ties(qwen3_dir, prompts, dtype, eager):
    """On CUDA the products run on fp8 tensor cores (the Triton GEMM; in bf16 from 33 rows cuBLAS),
    whose MMA keeps ~14 bits in its sums: not exact as on the CPU, so a random model's near-ties
    may go either way and greedy runs part. The oracle, HF with the same rounding and each product
    exact, teacher-forced on our completions: each token we chose is HF's argmax, or within a
    twentieth (float32) / a quarter (bf16: its own rounding on top) of the FP8 rounding's own
    effect on the logits (HF's FP8 emulation against the unquantized model) of it."""
    from transformers import AutoModelForCausalLM

    hf_fp8 = hf_fp8_model(qwen3_dir)
    plain = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    options = dict(OPTIONS, device="cuda", dtype=dtype, enforce_eager=eager)
    with LLM(qwen3_dir, quantization="fp8", **options) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    share = 0.05 if dtype == "float32" else 0.25
    argmax = unquantized = total = 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids, tokens = torch.tensor([prompt + completion[:-1]]), torch.tensor(completion)
            ref = hf_fp8(ids).logits[0, len(prompt) - 1 :]
            plain_logits = plain(ids).logits[0, len(prompt) - 1 :]
            effect = (ref - plain_logits).abs().max()
            gaps = ref.max(dim=1).values - ref.gather(1, tokens[:, None])[:, 0]
            assert (gaps <= share * effect).all(), (gaps.max().item(), effect.item())
            argmax += int((gaps == 0).sum())
            unquantized += int((plain_logits.argmax(dim=1) == tokens).sum())
            total += len(completion)
    print(
        f"{dtype}: of {total} greedy tokens {argmax} are the exact emulation's argmax, {unquantized} "
        "the unquantized model's (teacher-forced)"
    )


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


def write_fp8_tensor_checkpoint(source: str, path: str, scale_shape: tuple = ()) -> dict:
    """``source``'s checkpoint as AutoFP8 writes a dynamic one: each decoder linear's weight in
    e4m3 with one float32 ``weight_scale`` for the whole tensor (shape ``scale_shape``), the LM
    head left as it is; returns ``(e4m3 weight, scale)`` by weight name."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    tensors, quantized = load_file(os.path.join(source, "model.safetensors")), {}
    for name in list(tensors):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            weight = tensors[name].float()
            scale = (weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
            tensors[name] = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale.reshape(scale_shape)
            quantized[name] = (tensors[name], scale)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(source, "generation_config.json"), path)
    return quantized


def tensor_scaled_forward(weight_fp8: torch.Tensor, scale: torch.Tensor, bias, parts: int):
    """What nanovllm's layer computes from a per-tensor FP8 weight on ``parts`` ranks: the input
    rounded to e4m3 per token (per rank's slice), each rank's product exact."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows, y = x.reshape(-1, x.shape[-1]), 0
        for x_part, w_part in zip(rows.chunk(parts, dim=-1), weight_fp8.chunk(parts, dim=-1)):
            x_fp8, x_scale = quantize_per_token_group_ref(x_part, group=x_part.shape[-1])
            exact = (x_fp8.double() @ w_part.double().T) * x_scale.double() * scale.double()
            y = y + exact.to(x.dtype)
        return (y + (bias if bias is not None else 0)).view(*x.shape[:-1], -1)

    return forward


@pytest.mark.parametrize("tp, scale_shape", [(1, ()), (2, ()), (1, (1,))], ids=["tp1", "tp2", "tp1-shape1"])
def test_a_per_tensor_fp8_checkpoint_loads_as_stored_and_equals_hf_rounding_the_same(
    tmp_path, prompts, tp, scale_shape
):
    """q, k and v (and gate and up) keep their own tensors' scales inside the packed layers."""
    from transformers import AutoModelForCausalLM

    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=0)
    quantized = write_fp8_tensor_checkpoint(source, str(tmp_path / "fp8"), scale_shape)
    scales = {name.rsplit(".", 2)[-2]: s.item() for name, (_, s) in quantized.items() if ".layers.0." in name}
    assert len(set(scales.values())) == len(LINEARS)  # every part its own scale
    twin = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    twin.generation_config.eos_token_id = None
    for name, module in twin.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            module.forward = tensor_scaled_forward(*quantized[name + ".weight"], module.bias, parts)
    expected = hf_generate(twin, prompts)
    assert expected != hf_greedy(source, prompts, 12)  # the rounding changes the model's tokens
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=tp, **OPTIONS) as llm:
        assert llm.config.quantization == "fp8"
        stored = llm.apply_model(lambda model: model.model.layers[0].self_attn.qkv_proj.weight.dtype)
        assert stored == [torch.float8_e4m3fn] * tp
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_per_tensor_fp8_model_takes_model_dtype_updates(tmp_path, prompts):
    """An update in the model dtype is quantized per output channel, as ``quantization="fp8"``
    quantizes at load."""
    from safetensors.torch import load_file

    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=0)
    write_fp8_tensor_checkpoint(source, str(tmp_path / "fp8"))
    updated = make_random_checkpoint(str(tmp_path / "new"), "Qwen3ForCausalLM", seed=5)
    expected = hf_generate(hf_fp8_model(updated), prompts)
    with LLM(str(tmp_path / "fp8"), **OPTIONS) as llm:
        llm.load_weights(load_file(f"{updated}/model.safetensors").items())
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_a_per_tensor_scale_of_several_values_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=0)
    path = str(tmp_path / "fp8")
    write_fp8_tensor_checkpoint(source, path)
    tensors = load_file(f"{path}/model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight_scale"
    tensors[name] = tensors[name].reshape(1).repeat(3)
    save_file(tensors, f"{path}/model.safetensors")
    with pytest.raises(ValueError, match="o_proj.weight_scale.*one scale for the whole tensor"):
        LLM(path, **OPTIONS)


# --- mixture-of-experts models: the experts' weights in e4m3 too -------------------------------

MOE = dict(
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,  # HF sums a token's two expert outputs as nanovllm does (see below)
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
    num_hidden_layers=3,
    mlp_only_layers=[1],  # a dense layer between two MoE layers
)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_random_checkpoint(str(tmp_path_factory.mktemp("moe")), "Qwen3MoeForCausalLM", seed=11, **MOE)


def fp8_experts_forward(experts: nn.Module, parts: int):
    """Hugging Face's ``Qwen3MoeExperts.forward`` as nanovllm's FP8 experts compute it on ``parts``
    ranks: each expert's gate / up / down rows in e4m3 with a scale per whole row (down's rows then
    split across ranks), each projection's input rounded to e4m3 per row (down's: each rank's
    slice of ``silu(gate) * up``), each product exact (float64), rounded to the dtype. Per rank,
    HF's loop weights and sums a token's expert outputs (fp32 here: with two experts, the single
    rounding of nanovllm's fp32 sum); the ranks' sums are then added in rank order."""
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    gate_up_fp8, gate_up_scale = quantize_weight_per_channel_ref(gate_up.reshape(-1, hidden))
    gate_up_fp8, gate_up_scale = gate_up_fp8.view(gate_up.shape), gate_up_scale.view(num_experts, two_inter)
    down_fp8, down_scale = quantize_weight_per_channel_ref(down.reshape(-1, inter))
    down_fp8, down_scale = down_fp8.view(down.shape), down_scale.view(num_experts, hidden)

    def product(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
        x_fp8, x_scale = quantize_per_token_group_ref(x, group=x.shape[-1])
        exact = (x_fp8.double() @ w_fp8.double().T) * x_scale.double() * w_scale.double()
        return exact.to(x.dtype)

    def forward(hidden_states, top_k_index, top_k_weights):
        assert top_k_index.shape[1] <= 2  # beyond two experts HF's sum rounds more often
        final = torch.zeros_like(hidden_states)
        size = inter // parts
        for rank in range(parts):
            gate_rows = slice(rank * size, (rank + 1) * size)
            up_rows = slice(inter + rank * size, inter + (rank + 1) * size)
            partial = torch.zeros_like(hidden_states)
            for e in top_k_index.unique().tolist():
                top_k_pos, token_idx = torch.where(top_k_index.t() == e)
                x = hidden_states[token_idx]
                gate = product(x, gate_up_fp8[e, gate_rows], gate_up_scale[e, gate_rows])
                up = product(x, gate_up_fp8[e, up_rows], gate_up_scale[e, up_rows])
                y = product(experts.act_fn(gate) * up, down_fp8[e][:, gate_rows], down_scale[e])
                partial.index_add_(0, token_idx, y * top_k_weights[token_idx, top_k_pos, None])
            final = final + partial
        return final

    return forward


def hf_fp8_moe_model(model_or_dir, tp: int = 1):
    """:func:`hf_fp8_model` with its experts computing what nanovllm's FP8 experts compute (the
    router untouched)."""
    model = hf_fp8_model(model_or_dir, tp)
    patched = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.forward = fp8_experts_forward(experts, tp)
            patched += 1
    assert patched == 2
    return model


def expert_dtypes(model) -> list[tuple[str, torch.dtype]]:
    """Each MoE layer's expert weights', their scales' and its router's dtypes."""
    layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    names = ("experts.w13", "experts.w2", "experts.w13_scale", "experts.w2_scale", "gate.weight")
    return [(name, mlp.get_parameter(name).dtype) for mlp in layers for name in names]


MOE_DTYPES = [
    ("experts.w13", torch.float8_e4m3fn),
    ("experts.w2", torch.float8_e4m3fn),
    ("experts.w13_scale", torch.float32),
    ("experts.w2_scale", torch.float32),
    ("gate.weight", torch.float32),  # the router stays in the model dtype
] * 2


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_moe_greedy_equals_hf_with_the_same_rounding(moe_dir, prompts, tp):
    expected = hf_generate(hf_fp8_moe_model(moe_dir, tp), prompts)
    # the oracle tells quantized experts from unquantized ones on these prompts
    assert expected != hf_generate(hf_fp8_model(moe_dir, tp), prompts)
    with LLM(moe_dir, quantization="fp8", tensor_parallel_size=tp, **OPTIONS) as llm:
        assert llm.apply_model(expert_dtypes) == [MOE_DTYPES] * tp
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        again = llm.generate(prompts, GREEDY, use_tqdm=False)  # prefix-cache hits
        assert [o.outputs[0].token_ids for o in again] == expected


@pytest.mark.parametrize(
    "form, tp",
    [("stacked", 1), ("stacked", 2), ("per-expert", 1)],
    ids=["stacked-tp1", "stacked-tp2", "per-expert-tp1"],
)
def test_a_moe_weight_update_is_quantized_again(moe_dir, prompts, tmp_path, form, tp):
    """``stacked``: a training policy's ``named_parameters()`` (transformers' ``gate_up_proj`` /
    ``down_proj`` of every expert at once); ``per-expert``: a checkpoint's tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    if form == "stacked":
        weights = list(policy.named_parameters())
        assert any(name.endswith("experts.gate_up_proj") for name, _ in weights)
    else:
        policy.save_pretrained(tmp_path)
        weights = list(load_file(f"{tmp_path}/model.safetensors").items())
        assert any(name.endswith("experts.7.down_proj.weight") for name, _ in weights)
    expected = hf_generate(hf_fp8_moe_model(policy, tp), prompts)
    with LLM(moe_dir, quantization="fp8", tensor_parallel_size=tp, **OPTIONS) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert before != expected
        llm.load_weights(weights)
        bad = torch.zeros(8, 64, 64, dtype=torch.int32)
        with pytest.raises(ValueError, match="expected a floating-point tensor"):
            llm.load_weights([("model.layers.0.mlp.experts.gate_up_proj", bad)])
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.apply_model(expert_dtypes) == [MOE_DTYPES] * tp
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_fp8_moe_weights_take_half_the_bytes_of_bf16(moe_dir):
    """The experts' e4m3 values take half the bytes of bf16 ones, plus a float32 scale per row."""

    def expert_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)

    with LLM(moe_dir, **{**OPTIONS, "dtype": "bfloat16"}) as plain:
        bf16 = plain.apply_model(expert_bytes)[0]
    with LLM(moe_dir, quantization="fp8", **{**OPTIONS, "dtype": "bfloat16"}) as llm:
        fp8 = llm.apply_model(expert_bytes)[0]
    experts, hidden, inter = MOE["num_experts"], 64, MOE["moe_intermediate_size"]
    scale_bytes = 2 * 4 * experts * (2 * inter + hidden)  # two MoE layers
    assert fp8 == bf16 // 2 + scale_bytes
    assert fp8 < 0.55 * bf16
