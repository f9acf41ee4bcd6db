"""FP8 checkpoints read as stored, against Hugging Face running the stored tensors with the same
rounding: 128 x 128 block scales (Qwen3-*-FP8) and one scale per tensor (AutoFP8)."""

import pytest
import torch
from torch import nn

from nanovllm import LLM, SamplingParams
from tests.checkpoints import make_random_checkpoint
from tests.conftest import hf_greedy
from tests.end_to_end.fp8_oracle import (
    GREEDY,
    LINEARS,
    OPTIONS,
    ROW_PARALLEL,
    block_forward,
    hf_fp8_model,
    hf_generate,
    scaled_fp8_forward,
    write_fp8_block_checkpoint,
    write_fp8_tensor_checkpoint,
)

BLOCK_MODEL = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256
)


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
            module.forward = scaled_fp8_forward(*quantized[name + ".weight"], module.bias, parts)
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
