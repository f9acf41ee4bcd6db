"""FP8 checkpoints read as stored, against Hugging Face running the stored tensors with the same
rounding: 128 x 128 block scales (Qwen3-*-FP8) and one scale per tensor (AutoFP8)."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.checkpoints import make_random_checkpoint
from tests.conftest import hf_greedy
from tests.end_to_end.fp8_oracle import (
    GREEDY,
    LINEARS,
    OPTIONS,
    assert_close_to_twin,
    assert_greedy_up_to_near_ties,
    checkpoint_twin,
    hf_fp8_model,
    hf_generate,
    write_fp8_block_checkpoint,
    write_fp8_tensor_checkpoint,
)

BLOCK_MODEL = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256
)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_an_fp8_block_checkpoint_loads_as_stored_and_matches_its_dequantized_twin(tmp_path, prompts, tp):
    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=9, **BLOCK_MODEL)
    quantized = write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    twin = checkpoint_twin(source, quantized, tp, blocks=True)
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=tp, **OPTIONS) as llm:
        assert llm.config.quantization == "fp8"
        stored = llm.apply_model(lambda model: model.model.layers[0].self_attn.o_proj.weight.dtype)
        assert stored == [torch.float8_e4m3fn] * tp
        # scales one row per 128 x 128 block where a rank's rows are whole blocks (q, k and v
        # parts of 256, 128 and 128 rows at TP 1; k and v of 64 rows each at TP 2 keep per-row
        # scales), gate and up then side by side
        scale_rows = llm.apply_model(lambda model: [tuple(scales(model, name).shape) for name in PROJECTIONS])
        want = [(4, 1), (1, 2), (4, 1), (1, 2)] if tp == 1 else [(256, 1), (1, 1), (2, 1), (1, 1)]
        assert scale_rows == [want] * tp
        assert_close_to_twin(twin, prompts, llm)


PROJECTIONS = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]


def test_block_scales_stay_float32_in_a_16_bit_model(tmp_path, prompts):
    """A bf16 model's FP8 layers keep their block scales in float32, as the GEMMs take them."""
    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=9, **BLOCK_MODEL)
    write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    with LLM(str(tmp_path / "fp8"), **dict(OPTIONS, dtype="bfloat16")) as llm:
        dtypes = llm.apply_model(lambda model: {scales(model, name).dtype for name in PROJECTIONS})
        assert dtypes == [{torch.float32}]
        out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def scales(model, name: str) -> torch.Tensor:
    """The first layer's ``name`` projection's block scales."""
    return model.model.layers[0].get_submodule(name).weight_scale_inv


MOE_MODEL = dict(
    BLOCK_MODEL,
    moe_intermediate_size=256,  # two 128-row blocks per gate / up; one per rank at TP 2
    num_experts=4,
    num_experts_per_tok=2,  # HF sums a token's two expert outputs as nanovllm does
    norm_topk_prob=True,
    router_aux_loss_coef=0.0,
    num_hidden_layers=3,
    mlp_only_layers=[1],  # a dense layer between two MoE layers
)


def moe_checkpoint(path, seed: int) -> str:
    return make_random_checkpoint(str(path), "Qwen3MoeForCausalLM", seed=seed, **MOE_MODEL)


def expert_layout(model) -> list[tuple]:
    """The first MoE layer's expert weights' dtype, their scales' shapes and the router's dtype."""
    mlp = model.model.layers[0].mlp
    experts = mlp.experts
    return [
        experts.w13.dtype,
        tuple(experts.w13_scale.shape),
        tuple(experts.w2_scale.shape),
        mlp.gate.weight.dtype,
    ]


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "per-tensor"])
def test_an_fp8_checkpoint_of_a_moe_model_loads_as_stored_and_matches_its_twin(tmp_path, prompts, tp, blocks):
    source = moe_checkpoint(tmp_path / "source", seed=12)
    write = write_fp8_block_checkpoint if blocks else write_fp8_tensor_checkpoint
    quantized = write(source, str(tmp_path / "fp8"))
    assert "model.layers.2.mlp.experts.3.down_proj.weight" in quantized
    twin = checkpoint_twin(source, quantized, tp, blocks)
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=tp, **OPTIONS) as llm:
        if blocks:  # scales per row and 128 input features
            layout = [torch.float8_e4m3fn, (4, 512 // tp, 1), (4, 128, 2 // tp), torch.float32]
        else:  # each tensor's scale given to its rows
            layout = [torch.float8_e4m3fn, (4, 512 // tp), (4, 128), torch.float32]
        assert llm.apply_model(expert_layout) == [layout] * tp  # the router in the model dtype
        # a flipped e4m3 value moves a MoE model further (through the router, and the expert
        # outputs are larger), and the K/V it leaves carries the difference to later positions:
        # the layer's exact computation is tested in tests/kernels/test_fused_moe_fp8.py
        assert_close_to_twin(twin, prompts, llm, max_gap=0.5, close=0.6, agree=0.9)


@pytest.mark.parametrize(
    "form, tp", [("per-expert", 1), ("stacked", 2)], ids=["per-expert-tp1", "stacked-tp2"]
)
def test_an_fp8_block_moe_model_takes_model_dtype_updates(tmp_path, prompts, form, tp):
    """A model-dtype update (a checkpoint's per-expert tensors, or a training policy's
    ``named_parameters()`` with transformers' stacked experts) is quantized by blocks as the
    checkpoint writer quantizes it: the engine then equals one loaded from the updated FP8
    checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = moe_checkpoint(tmp_path / "source", seed=12)
    write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    updated = moe_checkpoint(tmp_path / "new", seed=13)
    write_fp8_block_checkpoint(updated, str(tmp_path / "new_fp8"))
    with LLM(str(tmp_path / "new_fp8"), tensor_parallel_size=tp, **OPTIONS) as reference:
        expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
    if form == "stacked":
        weights = list(AutoModelForCausalLM.from_pretrained(updated, dtype=torch.float32).named_parameters())
        assert any(name.endswith("experts.gate_up_proj") for name, _ in weights)
    else:
        weights = list(load_file(f"{updated}/model.safetensors").items())
    with LLM(str(tmp_path / "fp8"), tensor_parallel_size=tp, **OPTIONS) as llm:
        llm.load_weights(weights)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_an_fp8_block_moe_checkpoint_split_off_its_blocks_is_refused(tmp_path):
    moe = dict(MOE_MODEL, moe_intermediate_size=128)  # 64 rows a rank at TP 2: half a block
    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3MoeForCausalLM", seed=12, **moe)
    write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match="multiple of 128"):
        LLM(str(tmp_path / "fp8"), tensor_parallel_size=2, **OPTIONS)
    with LLM(str(tmp_path / "fp8"), **OPTIONS) as llm:  # whole blocks on one rank
        assert llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


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


@pytest.mark.parametrize("tp, scale_shape", [(1, ()), (2, ()), (1, (1,))], ids=["tp1", "tp2", "tp1-shape1"])
def test_a_per_tensor_fp8_checkpoint_loads_as_stored_and_equals_hf_rounding_the_same(
    tmp_path, prompts, tp, scale_shape
):
    """q, k and v (and gate and up) keep their own tensors' scales inside the packed layers."""
    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=0)
    quantized = write_fp8_tensor_checkpoint(source, str(tmp_path / "fp8"), scale_shape)
    scales = {name.rsplit(".", 2)[-2]: s.item() for name, (_, s) in quantized.items() if ".layers.0." in name}
    assert len(set(scales.values())) == len(LINEARS)  # every part its own scale
    expected = hf_generate(checkpoint_twin(source, quantized, tp, blocks=False), prompts)
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


def test_a_per_tensor_fp8_moe_model_takes_model_dtype_updates(tmp_path, prompts):
    """An update in the model dtype is quantized per row, as ``quantization="fp8"`` quantizes at
    load: the engine then equals one loaded from the update with ``quantization="fp8"``."""
    from safetensors.torch import load_file

    source = moe_checkpoint(tmp_path / "source", seed=12)
    write_fp8_tensor_checkpoint(source, str(tmp_path / "fp8"))
    updated = moe_checkpoint(tmp_path / "new", seed=13)
    with LLM(updated, quantization="fp8", **OPTIONS) as reference:
        expected = [o.outputs[0].token_ids for o in reference.generate(prompts, GREEDY, use_tqdm=False)]
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_cuda_bf16_block_checkpoint_choices_are_the_twins_up_to_near_ties(tmp_path, prompts, eager):
    """On CUDA the block-scaled products run on fp8 tensor cores (cuBLAS's block-scaled product for
    the 242-row prefill, the Triton block GEMM for decode rows), in bf16: greedy choices against
    the twin up to near ties (:func:`assert_greedy_up_to_near_ties`), as the per-channel test."""
    from transformers import AutoModelForCausalLM

    source = make_random_checkpoint(str(tmp_path / "source"), "Qwen3ForCausalLM", seed=9, **BLOCK_MODEL)
    quantized = write_fp8_block_checkpoint(source, str(tmp_path / "fp8"))
    twin = checkpoint_twin(source, quantized, 1, blocks=True)
    twin_bf16 = checkpoint_twin(source, quantized, 1, blocks=True).to(torch.bfloat16)
    plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    options = dict(OPTIONS, device="cuda", dtype="bfloat16", enforce_eager=eager)
    with LLM(str(tmp_path / "fp8"), **options) as llm:
        completions = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_greedy_up_to_near_ties(twin, plain, twin_bf16, prompts, completions)
