"""Which device and dtype the engine runs in."""

import torch

from nanovllm.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: Config, rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    return torch.device("cuda", rank)


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return DTYPES[config.dtype]
    dtype = getattr(config.hf_config, "dtype", None) or getattr(config.hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    if dtype not in DTYPES.values():
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype
