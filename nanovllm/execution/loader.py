"""Build the model for a config and load Hugging Face safetensors into it through
per-parameter ``weight_loader``s."""

import os
from glob import glob

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.attention import get_attention_backend
from nanovllm.config import Config
from nanovllm.execution.platform import torch_dtype
from nanovllm.layers.parallel import TPGroup


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
    param.data.copy_(loaded)


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of ``path/*.safetensors`` into ``model``, routing packed modules.

    Raises ``FileNotFoundError`` when there are no weights, and ``ValueError`` when a
    parameter of the model received no weight or a tensor of the checkpoint has no place in
    the model (a bias or norm we do not implement would otherwise be dropped silently).
    """
    files = sorted(glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r}")
    packed = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(params)
    loaded: set[str] = set()
    unused: list[str] = []
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                for source, (target, shard_id) in packed.items():
                    if source in name:
                        param_name = name.replace(source, target)
                        param = params.get(param_name)
                        if param is None:
                            unused.append(name)
                        else:
                            param.weight_loader(param, f.get_tensor(name), shard_id)
                            loaded.add(param_name)
                        break
                else:
                    param = params.get(name)
                    if param is None:
                        # a tied head's copy, or the rotary buffers of old checkpoints, carry nothing new
                        if name not in tied and not name.endswith("rotary_emb.inv_freq"):
                            unused.append(name)
                        continue
                    getattr(param, "weight_loader", default_weight_loader)(param, f.get_tensor(name))
                    loaded.add(name)
    if unused:
        raise ValueError(
            f"checkpoint {path!r} holds tensors this model has no place for: {sorted(unused)[:8]}; "
            "nanovllm does not run a checkpoint it would read only in part"
        )
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {sorted(missing)[:8]}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random weights (norms at 1) for benchmarking without a checkpoint."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + i)
            param.data.uniform_(-0.05, 0.05, generator=gen)
