"""Nothing loads silently wrong: the index decides which files are read, every part of a
packed parameter is required, every tensor's shape and dtype are checked, and each error
names the file and tensor (CPU, tiny checkpoints)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanovllm.config import Config
from nanovllm.execution.loader import build_model
from nanovllm.layers.parallel import TPGroup


def copy_checkpoint(src: str, dst) -> dict[str, torch.Tensor]:
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), dst / name)
    return load_file(os.path.join(src, "model.safetensors"))


def build(model_dir, tp: TPGroup = TPGroup()) -> torch.nn.Module:
    config = Config(str(model_dir), device="cpu", tensor_parallel_size=tp.size)
    return build_model(config, tp, torch.device("cpu"))


@pytest.mark.parametrize(
    "part", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]
)
def test_every_part_of_a_packed_parameter_is_required(qwen3_dir, tmp_path, part):
    weights = copy_checkpoint(qwen3_dir, tmp_path)
    name = f"model.layers.1.{part}.weight"
    del weights[name]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"lacks weights for: .*{name.replace('.', '[.]')}"):
        build(tmp_path)


def test_the_index_decides_which_files_are_read(qwen3_dir, tmp_path):
    weights = copy_checkpoint(qwen3_dir, tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00001.safetensors" for name in weights}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # a stale file and a Mistral-style consolidated copy beside the shards are not read
    save_file(
        {"lm_head.weight": torch.zeros_like(weights["lm_head.weight"])}, str(tmp_path / "stale.safetensors")
    )
    save_file({"output.weight": torch.zeros(4, 4)}, str(tmp_path / "consolidated.safetensors"))
    model = build(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, weights["lm_head.weight"], rtol=0, atol=0)


def test_an_index_naming_a_missing_file_is_refused(qwen3_dir, tmp_path):
    weights = copy_checkpoint(qwen3_dir, tmp_path)
    index = {"weight_map": {name: "model-00002-of-00002.safetensors" for name in weights}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        build(tmp_path)


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.embed_tokens.weight", "rows+8"),  # extra vocabulary rows, sliced away before
        ("model.layers.0.self_attn.q_proj.weight", "rows-32"),
        ("model.layers.0.mlp.down_proj.weight", "cols+2"),
        ("model.layers.1.input_layernorm.weight", "rows+1"),
        ("lm_head.weight", "one row"),  # would broadcast into every row
    ],
)
def test_a_tensor_of_the_wrong_shape_is_refused_by_name(qwen3_dir, tmp_path, name, shape, tp_size):
    weights = copy_checkpoint(qwen3_dir, tmp_path)
    t = weights[name]
    if shape == "one row":
        t = t[:1]
    else:
        axis, delta = shape[:4], int(shape[4:])
        dim = 0 if axis == "rows" else 1
        if delta > 0:
            t = torch.cat([t, t.narrow(dim, 0, delta)], dim)
        else:
            t = t.narrow(dim, 0, t.shape[dim] + delta)
    weights[name] = t.contiguous()
    save_file(weights, str(tmp_path / "model.safetensors"))
    for rank in range(tp_size):
        with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{name}' has shape"):
            build(tmp_path, TPGroup(rank, tp_size))


def test_an_integer_tensor_for_a_float_parameter_is_refused(qwen3_dir, tmp_path):
    weights = copy_checkpoint(qwen3_dir, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    weights[name] = weights[name].to(torch.int64)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{name}' has dtype torch.int64"):
        build(tmp_path)


def test_a_file_that_is_not_safetensors_is_named(qwen3_dir, tmp_path):
    copy_checkpoint(qwen3_dir, tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 3])  # a broken download
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        build(tmp_path)
