"""The safetensors loader: packed modules, tied heads, tensor-parallel shards, missing weights."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.execution.loader import build_model, init_dummy_weights
from nanovllm.layers.parallel import TPGroup


def build(model_dir: str, tp: TPGroup = TPGroup(), **options) -> torch.nn.Module:
    config = Config(model_dir, device="cpu", tensor_parallel_size=tp.size, **options)
    return build_model(config, tp, torch.device("cpu"))


def test_packed_modules_hold_the_checkpoint_tensors(qwen3_dir):
    weights = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    model = build(qwen3_dir)
    attn = model.model.layers[1].self_attn
    p = "model.layers.1."
    expected_qkv = torch.cat([weights[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    gate, up = weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]
    expected_gate_up = torch.stack([gate, up], dim=1).flatten(0, 1)  # rows interleaved
    torch.testing.assert_close(
        model.model.layers[1].mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0
    )
    torch.testing.assert_close(model.lm_head.weight, weights["lm_head.weight"], rtol=0, atol=0)


def test_tied_head_shares_the_embedding(qwen2_dir):
    model = build(qwen2_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    weights = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    torch.testing.assert_close(
        model.model.layers[0].self_attn.qkv_proj.bias[:64],
        weights["model.layers.0.self_attn.q_proj.bias"],
        rtol=0,
        atol=0,
    )


def test_tensor_parallel_shards_split_heads_and_vocab(qwen3_dir):
    weights = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    p = "model.layers.0."
    for rank in range(2):
        model = build(qwen3_dir, TPGroup(rank, 2))
        attn = model.model.layers[0].self_attn
        q = weights[p + "self_attn.q_proj.weight"].chunk(2)[rank]
        k = weights[p + "self_attn.k_proj.weight"].chunk(2)[rank]
        v = weights[p + "self_attn.v_proj.weight"].chunk(2)[rank]
        torch.testing.assert_close(attn.qkv_proj.weight, torch.cat([q, k, v]), rtol=0, atol=0)
        o = weights[p + "self_attn.o_proj.weight"].chunk(2, dim=1)[rank]
        torch.testing.assert_close(attn.o_proj.weight, o, rtol=0, atol=0)
        emb = weights["model.embed_tokens.weight"].chunk(2)[rank]
        torch.testing.assert_close(model.model.embed_tokens.weight, emb, rtol=0, atol=0)


def test_missing_tensor_is_reported(qwen3_dir, tmp_path):
    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    weights = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj"):
        build(str(tmp_path))


def test_dummy_weights_fill_every_parameter(qwen3_dir):
    model = build(qwen3_dir, load_format="dummy")
    for param in model.parameters():
        param.data.fill_(float("nan"))
    init_dummy_weights(model)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        assert param.abs().max() <= (1.0 if "norm" in name else 0.05), name


@pytest.mark.parametrize(
    "extra",
    ["model.layers.0.mlp.gate_proj.bias", "model.layers.1.self_attn.o_proj.bias", "model.extra_norm.weight"],
)
def test_a_tensor_the_model_has_no_place_for_is_refused_by_name(qwen3_dir, tmp_path, extra):
    for name in os.listdir(qwen3_dir):
        shutil.copy(os.path.join(qwen3_dir, name), tmp_path / name)
    weights = load_file(os.path.join(qwen3_dir, "model.safetensors"))
    weights[extra] = torch.ones(8)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=extra.replace(".", r"\.")):
        build(str(tmp_path))


def test_rotary_buffers_and_a_tied_head_copy_are_accepted(qwen2_dir, tmp_path):
    for name in os.listdir(qwen2_dir):
        shutil.copy(os.path.join(qwen2_dir, name), tmp_path / name)
    weights = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(tmp_path / "model.safetensors"))
    model = build(str(tmp_path))
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"], rtol=0, atol=0)
