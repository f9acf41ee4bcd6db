"""Build the model for a config and load Hugging Face safetensors into it through
per-parameter ``weight_loader``s."""

import json
import os
from collections.abc import Iterator
from glob import glob

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nanovllm.attention import get_attention_backend
from nanovllm.config import Config
from nanovllm.execution.platform import torch_dtype
from nanovllm.layers.parallel import TPGroup, copy_weight

INDEX_FILE = "model.safetensors.index.json"


def build_model(config: Config, tp: TPGroup, device: torch.device) -> nn.Module:
    """The registry's model class for ``config``, on ``device`` in the config's dtype, with
    the checkpoint's weights (or random ones for ``load_format="dummy"``)."""
    model_cls = config.architecture.load_model_class()
    backend = get_attention_backend(config.attention_backend)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(config.dtype))
    try:
        with torch.device(device):
            model = model_cls(config.hf_config, config.architecture, tp, backend)
    finally:
        torch.set_default_dtype(default_dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_model(model, config.model)
    return model


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_weight(param.data, loaded)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: those its index names, else every one in it."""
    index = os.path.join(path, INDEX_FILE)
    if not os.path.isfile(index):
        files = sorted(glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
        return files
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index} is not a safetensors index (a 'weight_map' of tensor -> file): {e}") from e
    files = [os.path.join(path, name) for name in names]
    missing = [name for name, file in zip(names, files) if not os.path.isfile(file)]
    if missing:
        raise FileNotFoundError(f"{index} names weight files that are not in {path!r}: {missing[:4]}")
    return files


def checkpoint_tensors(path: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(file, tensor name, tensor)`` of every tensor of the checkpoint, one file at a time."""
    for file in checkpoint_files(path):
        try:
            with safe_open(file, "pt", "cpu") as f:
                for name in f.keys():
                    yield file, name, f.get_tensor(name)
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from e


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint in ``path`` into ``model``, routing packed modules.

    Raises ``FileNotFoundError`` when there are no weights, and ``ValueError``, naming the file
    and tensor, when a tensor has the wrong shape or dtype or no place in the model (a bias or
    norm we do not implement would otherwise be dropped silently), or when a parameter, or a
    part of a packed one, received no weight.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[str] = set()
    parts: dict[str, set] = {}  # packed parameter -> the parts it received
    unused: list[str] = []
    for file, name, tensor in checkpoint_tensors(path):
        for source, (target, shard_id) in packed.items():
            if source in name:
                param_name = name.replace(source, target)
                param = params.get(param_name)
                if param is None:
                    unused.append(name)
                else:
                    _load(file, name, param.weight_loader, param, tensor, shard_id)
                    loaded.add(param_name)
                    parts.setdefault(param_name, set()).add(shard_id)
                break
        else:
            param = params.get(name)
            if param is None:
                # a tied head's copy, or the rotary buffers of old checkpoints, carry nothing new
                if name not in tied and not name.endswith("rotary_emb.inv_freq"):
                    unused.append(name)
                continue
            _load(file, name, getattr(param, "weight_loader", default_weight_loader), param, tensor)
            loaded.add(name)
    if unused:
        raise ValueError(
            f"checkpoint {path!r} holds tensors this model has no place for: {sorted(unused)[:8]}; "
            "nanovllm does not run a checkpoint it would read only in part"
        )
    missing = sorted(set(params) - loaded) + _missing_parts(packed, parts)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {missing[:8]}")


def _load(file: str, name: str, weight_loader, *args) -> None:
    try:
        weight_loader(*args)
    except ValueError as e:
        raise ValueError(f"{file}: tensor {name!r} {e}") from None


def _missing_parts(packed: dict, parts: dict[str, set]) -> list[str]:
    """The checkpoint tensors a packed parameter did not receive, by their own names."""
    missing = []
    for param_name, got in parts.items():
        for source, (target, shard_id) in packed.items():
            if target in param_name and shard_id not in got:
                missing.append(param_name.replace(target, source))
    return missing


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random weights (norms at 1) for benchmarking without a checkpoint."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + i)
            param.data.uniform_(-0.05, 0.05, generator=gen)
