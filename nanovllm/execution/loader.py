"""Build the model for a config and load Hugging Face safetensors into it through
per-parameter ``weight_loader``s."""

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
            model = model_cls(config.hf_config, config.architecture, tp, backend, config.linear_weights)
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


@dataclass(slots=True)
class WeightTarget:
    """Where one Hugging Face tensor goes: a parameter (by our name), through its loader, and
    for a packed parameter, which part (``shard_id``)."""

    param_name: str
    param: nn.Parameter
    loader: Callable
    shard_id: object = None

    def load(self, tensor: torch.Tensor, param: nn.Parameter | None = None) -> None:
        param = self.param if param is None else param
        if self.shard_id is None:
            self.loader(param, tensor)
        else:
            self.loader(param, tensor, self.shard_id)

    def check(self, tensor: torch.Tensor) -> None:
        """Load ``tensor`` into a meta copy of the parameter: the loader's shape and dtype checks
        run (``ValueError``), nothing is written and no memory is touched."""
        meta = nn.Parameter(torch.empty_like(self.param, device="meta"), requires_grad=False)
        self.load(tensor.to("meta"), meta)


class WeightMap:
    """Hugging Face tensor names to the model's parameters: packed modules (q/k/v, gate/up,
    experts) routed to their fused parameter, a tied head's copy and old rotary buffers ignored."""

    def __init__(self, model: nn.Module):
        self.packed = getattr(model, "packed_modules_mapping", {})
        self.params = dict(model.named_parameters())
        self.tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - set(self.params)

    def target(self, name: str) -> WeightTarget | None:
        """Where ``name`` goes; None for a tensor that carries nothing new (a tied head's copy,
        a rotary buffer). ``KeyError`` when the model has no place for it."""
        for source, (target, shard_id) in self.packed.items():
            if source in name:
                param_name = name.replace(source, target)
                param = self.params.get(param_name)
                if param is None:
                    raise KeyError(name)
                return WeightTarget(param_name, param, param.weight_loader, shard_id)
        param = self.params.get(name)
        if param is None:
            if name in self.tied or name.endswith("rotary_emb.inv_freq"):
                return None
            raise KeyError(name)
        return WeightTarget(name, param, getattr(param, "weight_loader", default_weight_loader))


def load_model(model: nn.Module, path: str) -> None:
    """Copy every tensor of the checkpoint in ``path`` into ``model``, routing packed modules.

    Raises ``FileNotFoundError`` when there are no weights, and ``ValueError``, naming the file
    and tensor, when a tensor has the wrong shape or dtype or no place in the model (a bias or
    norm we do not implement would otherwise be dropped silently), or when a parameter, or a
    part of a packed one, received no weight.
    """
    weights = WeightMap(model)
    loaded: set[str] = set()
    parts: dict[str, set] = {}  # packed parameter -> the parts it received
    unused: list[str] = []
    for file, name, tensor in checkpoint_tensors(path):
        try:
            target = weights.target(name)
        except KeyError:
            unused.append(name)
            continue
        if target is None:
            continue
        _load(file, name, target, tensor)
        loaded.add(target.param_name)
        if target.shard_id is not None:
            parts.setdefault(target.param_name, set()).add(target.shard_id)
    if unused:
        raise ValueError(
            f"checkpoint {path!r} holds tensors this model has no place for: {sorted(unused)[:8]}; "
            "nanovllm does not run a checkpoint it would read only in part"
        )
    expected = {name for name, param in weights.params.items() if not getattr(param, "derived", False)}
    missing = sorted(expected - loaded) + _missing_parts(weights.packed, parts)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for: {missing[:8]}")


Weights = list[tuple[str, torch.Tensor]]


def plan_weight_update(model: nn.Module, weights: Weights) -> list[tuple[str, WeightTarget, torch.Tensor]]:
    """Where each ``(hf_name, tensor)`` of an update goes, every one checked first (its name,
    shape and dtype) without writing: ``ValueError`` naming the bad ones. A tied head's copy is
    skipped, as at start-up."""
    router = WeightMap(model)
    plan, unknown, bad = [], [], []
    for item in weights:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise ValueError(f"weights must be (name, tensor) pairs, got {item!r:.80}")
        name, tensor = item
        try:
            target = router.target(name)
        except KeyError:
            unknown.append(name)
            continue
        if target is None:
            continue
        try:
            target.check(tensor)
        except ValueError as error:
            bad.append(f"{name!r} {error}")
            continue
        plan.append((name, target, tensor))
    if unknown or bad:
        problems = ([f"names the model has no place for: {unknown[:8]}"] if unknown else []) + bad[:8]
        raise ValueError("load_weights wrote nothing: " + "; ".join(problems))
    return plan


def _load(file: str, name: str, target: WeightTarget, tensor: torch.Tensor) -> None:
    try:
        target.load(tensor)
    except ValueError as e:
        raise ValueError(f"{file}: tensor {name!r} {e}") from None


def _missing_parts(packed: dict, parts: dict[str, set]) -> list[str]:
    """The checkpoint tensors a packed parameter did not receive, by their own names (one that
    came whole, in transformers' stacked-experts layout, lacks none)."""
    missing = []
    for param_name, got in parts.items():
        if any(_is_whole_stack(shard_id) for shard_id in got):
            continue
        for source, (target, shard_id) in packed.items():
            if target in param_name and shard_id not in got and not _is_whole_stack(shard_id):
                missing.append(param_name.replace(target, source))
    return missing


def _is_whole_stack(shard_id) -> bool:
    return isinstance(shard_id, tuple) and shard_id[0] is None


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random weights (norms at 1) for benchmarking without a checkpoint."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if "norm" in name or getattr(param, "derived", False):
            param.data.fill_(1.0)
        else:
            gen = torch.Generator(device=param.device).manual_seed(seed + i)
            if param.dtype == torch.float8_e4m3fn:  # no uniform_ in float8: drawn in float32
                param.data.copy_(
                    torch.empty(param.shape, device=param.device).uniform_(-0.05, 0.05, generator=gen)
                )
            else:
                param.data.uniform_(-0.05, 0.05, generator=gen)
