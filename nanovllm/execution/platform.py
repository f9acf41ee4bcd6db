"""What the configuration needs from torch: the machine's GPUs, dtypes by name, and the
device of each tensor-parallel rank."""

import torch

from nanovllm.config import Config, Platform

_TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def probe_platform() -> Platform:
    """The visible CUDA devices, for :class:`Config` to resolve "auto" options against."""
    if not torch.cuda.is_available():
        return Platform()
    count = torch.cuda.device_count()
    return Platform(tuple(torch.cuda.get_device_capability(i) for i in range(count)))


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ``dtype`` or ``kv_cache_dtype`` name."""
    return _TORCH_DTYPES[name]


def rank_device(config: Config, rank: int) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(config.device.removeprefix("cuda:")) + rank)
