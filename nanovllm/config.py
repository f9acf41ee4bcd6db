"""The engine's one typed configuration, validated whole before any worker starts. No torch:
what the machine offers comes in as a :class:`Platform` (probed on the execution side)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from nanovllm import engine_args
from nanovllm.models.registry import (
    Architecture,
    attention_dims,
    context_len,
    fp8_checkpoint_layout,
    max_shared_prompt_len,
    moe_settings,
    resolve_architecture,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger("nanovllm")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Model dtypes by name, and the bytes of one element."""
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
"""vLLM's other names for them (torch dtypes are taken by name too)."""
REQUIRED_HF_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
"""config.json fields that transformers would otherwise fill with a default the weights may
not fit."""
KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""8-bit KV cache dtypes (float8 e4m3) by name."""
ATTENTION_BACKENDS = ("flash_attn", "triton", "torch")
SLEEP_TAGS = ("weights", "kv_cache")
"""What sleep mode frees on every rank, and what ``wake_up(tags)`` names."""
CPU_KV_CACHE_BYTES = 2 * 2**30


def read_hf_config(model: str) -> PretrainedConfig:
    """The folder's Hugging Face config; ``ValueError`` naming the file when transformers cannot
    read it or it lacks a field the model's shape needs."""
    from transformers import AutoConfig

    path = os.path.join(model, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
        hf_config = AutoConfig.from_pretrained(model)
    except Exception as e:  # transformers fails on a bad field in its own ways (AttributeError, ...)
        raise ValueError(f"{path} cannot be read: {type(e).__name__}: {e}") from e
    missing = [name for name in REQUIRED_HF_FIELDS if name not in raw]
    if missing:
        raise ValueError(f"{path} lacks {missing}: transformers would fill them with defaults")
    return hf_config


@dataclass(frozen=True)
class Platform:
    """The GPUs this machine offers, as far as the configuration needs to know them."""

    gpu_capabilities: tuple[tuple[int, int], ...] = ()
    """The compute capability of each visible CUDA device, by index."""


CPU_ONLY = Platform()


@dataclass(frozen=True)
class Config:
    """Everything ``LLM(model, **options)`` accepts, checked on construction.

    "auto" values are resolved here, against ``platform`` (a machine without GPUs unless
    told): after construction ``device`` is "cpu" or "cuda:N" (the device of rank 0; rank r
    uses N + r), ``dtype`` a key of :data:`DTYPE_BYTES` and ``attention_backend`` one of
    :data:`ATTENTION_BACKENDS`.
    """

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 1024
    """Running sequences at most (vLLM's default on large GPUs). Bigger decode steps pay: the
    8B bench ran 2% faster with 1,024 rows in 128-token blocks than with 768 in 256-token ones."""
    max_model_len: int | None = None
    """Prompt and completion tokens of a sequence at most; None: the model's context, lowered
    (with a warning) to what the KV cache holds. A given value is capped by the model's context."""
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int | None = None
    """Tokens per KV block, a power of two; by default 256 for flash-attn (its minimum) and
    128 otherwise: smaller blocks leave less of the cache in partly filled blocks, so 1,024
    requests of the 8B bench decode without preemption."""
    num_kvcache_blocks: int = -1
    kv_cache_memory_gb: float | None = None
    """KV-cache size in GiB; the default is 2 GiB on CPU and the free share of
    ``gpu_memory_utilization`` on GPU."""
    kv_cache_memory_bytes: int | None = None
    """The same in bytes (vLLM's name); set one of the two."""
    dtype: str = "auto"
    quantization: str | None = None
    """"fp8": the linear layers' weights quantized to float8 e4m3 as they load (one scale per
    output channel), their inputs per token, and so are a mixture-of-experts model's experts (the
    router stays in ``dtype``); embeddings, norms and the LM head stay in ``dtype``."""
    kv_cache_dtype: str = "auto"
    """"auto" stores K/V in ``dtype``; "fp8" (or "fp8_e4m3") in float8 e4m3 with a scale of
    1.0, as vLLM's default: half the bytes to read per decoded token, twice the tokens cached."""
    device: str = "auto"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    mixed_steps: bool = True
    """Let prompt chunks share a step with the running decodes under the token budget, so
    decodes never stop for a prompt; off, prompt work runs in steps of its own, first."""
    async_scheduling: bool = True
    """Plan each step while the previous one runs on the device (with tensor parallelism,
    rank 0 then broadcasts each step's sampled tokens to the other ranks)."""
    worker_timeout_s: float = 60.0
    """How long rank 0 waits on a tensor-parallel worker (to read a step, or inside a step's
    collectives) before it reports the worker stopped or hung; long enough for a first compile."""
    load_format: str = "auto"
    """"auto" loads ``*.safetensors``; "dummy" fills weights with random values."""
    seed: int = 0
    """Seeds unseeded sampling, so that an engine with the same options repeats its tokens for
    the same calls, and the random weights of ``load_format="dummy"``."""
    tokenizer: str | None = None
    """The tokenizer's folder (default: the model's)."""
    tokenizer_mode: str = "auto"
    """"auto": the fast tokenizer where there is one; "slow": the Python one."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts are token ids, completions have no text."""
    enable_sleep_mode: bool = False
    """Allow ``LLM.sleep`` and ``wake_up``: free the weights' and KV cache's device memory
    between calls (an RL trainer's engine beside its training), then get them back."""
    structured_outputs_config: dict | None = None
    """vLLM's engine-wide structured-output settings (a dict, or vLLM's config object):
    ``backend`` "auto" or "xgrammar" (the one here); ``disable_any_whitespace`` makes every
    request's JSON compact; ``disable_additional_properties`` always holds here. Reasoning
    parsers are not implemented."""
    platform: Platform = field(default=CPU_ONLY, repr=False, compare=False)
    hf_config: PretrainedConfig = field(init=False, repr=False, compare=False)
    architecture: Architecture = field(init=False, repr=False)
    eos_token_ids: tuple[int, ...] = field(init=False, default=())
    max_model_len_given: bool = field(init=False, default=False, repr=False, compare=False)

    @classmethod
    def from_options(cls, model: str, platform: Platform, **options) -> Config:
        """``Config(model, **options)`` on ``platform``; vLLM's argument names are read as
        :mod:`~nanovllm.engine_args` says, and an option we do not know is a clear error."""
        options = engine_args.to_options(options)
        known = {f.name for f in fields(cls) if f.init} - {"model", "platform"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown LLM options {sorted(unknown)}; known: {sorted(known)}")
        return cls(os.path.expanduser(model), platform=platform, **options)

    def __post_init__(self) -> None:
        def resolve(name: str, value) -> None:
            object.__setattr__(self, name, value)

        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model folder {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"{self.model!r} has no config.json: not a Hugging Face model folder")
        resolve("hf_config", read_hf_config(self.model))
        resolve("architecture", resolve_architecture(self.hf_config))
        self._check_numbers()
        resolve("max_model_len_given", self.max_model_len is not None)
        context = context_len(self.hf_config)
        resolve("max_model_len", context if self.max_model_len is None else min(self.max_model_len, context))
        resolve("device", self._resolve_device())
        resolve("dtype", self._resolve_dtype())
        resolve("attention_backend", self._resolve_attention_backend())
        if self.kvcache_block_size is None:
            resolve("kvcache_block_size", 256 if self.attention_backend == "flash_attn" else 128)
        resolve("kv_cache_dtype", self._resolve_kv_cache_dtype())
        self._check_quantization()
        resolve("structured_outputs_config", self._resolve_structured_outputs_config())
        resolve("eos_token_ids", self._eos_ids())
        fixed = self.fixed_num_kvcache_blocks
        if fixed is not None:
            resolve("max_model_len", self._fitted_max_model_len(fixed))

    # --- derived values ------------------------------------------------------------------
    @property
    def kv_cache_dtype_bytes(self) -> int:
        return 1 if self.kv_cache_dtype in KV_CACHE_DTYPES else DTYPE_BYTES[self.kv_cache_dtype]

    @property
    def max_shared_prompt_len(self) -> int | None:
        """Prompts longer than this neither take nor give prefix-cache hits (None: no limit)."""
        return max_shared_prompt_len(self.hf_config)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.kvcache_block_size)

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block over every layer, on one tensor-parallel rank."""
        _, num_kv_heads, head_dim = attention_dims(self.hf_config)
        per_token = 2 * num_kv_heads // self.tensor_parallel_size * head_dim * self.kv_cache_dtype_bytes
        return self.hf_config.num_hidden_layers * self.kvcache_block_size * per_token

    def kv_blocks_for(self, num_bytes: float) -> int:
        """KV blocks that fit in ``num_bytes``, never more than every sequence at full length uses."""
        return min(int(num_bytes // self.kv_block_bytes), self.max_num_seqs * self.max_blocks_per_seq)

    @property
    def fixed_num_kvcache_blocks(self) -> int | None:
        """The KV block count when the options fix it; None when it comes from profiling the GPU."""
        if self.num_kvcache_blocks > 0:
            return self.num_kvcache_blocks
        if self.kv_cache_memory_gb is not None:
            return self.kv_blocks_for(self.kv_cache_memory_gb * 2**30)
        if self.kv_cache_memory_bytes is not None:
            return self.kv_blocks_for(self.kv_cache_memory_bytes)
        if self.device == "cpu":
            return self.kv_blocks_for(CPU_KV_CACHE_BYTES)
        return None

    def fit_max_model_len(self, num_blocks: int) -> Config:
        """This configuration for a KV cache of ``num_blocks`` (see :meth:`_fitted_max_model_len`)."""
        fitted = self._fitted_max_model_len(num_blocks)
        return self if fitted == self.max_model_len else replace(self, max_model_len=fitted)

    def _fitted_max_model_len(self, num_blocks: int) -> int:
        """``max_model_len`` when ``num_blocks`` hold a sequence of it; else, for the model's
        context taken by default, what they hold (with a warning); else ``ValueError``."""
        capacity = max(num_blocks, 0) * self.kvcache_block_size
        if capacity >= self.max_model_len:
            return self.max_model_len
        how = "raise gpu_memory_utilization / kv_cache_memory_gb / num_kvcache_blocks"
        if self.max_model_len_given or not capacity:
            raise ValueError(
                f"the KV cache holds {capacity} tokens, less than one sequence of "
                f"max_model_len={self.max_model_len}: {how}, or lower max_model_len"
            )
        logger.warning(
            "nanovllm: max_model_len is %d, not the model's %d: the KV cache holds %d tokens (%s)",
            capacity, self.max_model_len, capacity, how,
        )  # fmt: skip
        return capacity

    # --- checks and resolution ---------------------------------------------------------------
    def _check_numbers(self) -> None:
        tp = self.tensor_parallel_size
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bs = self.kvcache_block_size
        if bs is not None and (not isinstance(bs, int) or bs < 1 or bs & (bs - 1)):
            raise ValueError(f"kvcache_block_size must be a power of two, got {bs}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("kv_cache_memory_gb and kv_cache_memory_bytes size the same cache: set one")
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(f"tokenizer_mode must be 'auto' or 'slow', got {self.tokenizer_mode!r}")
        if self.tokenizer is not None and not os.path.isdir(os.path.expanduser(self.tokenizer)):
            raise FileNotFoundError(f"tokenizer folder {self.tokenizer!r} does not exist")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        num_heads, num_kv_heads, _ = attention_dims(self.hf_config)
        if num_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the attention heads "
                f"({num_heads}) and KV heads ({num_kv_heads})"
            )

    def _resolve_device(self) -> str:
        device, count = self.device, len(self.platform.gpu_capabilities)
        if device == "auto":
            device = "cuda" if count else "cpu"
        if device == "cpu":
            return device
        index = device.removeprefix("cuda").removeprefix(":")
        if not device.startswith("cuda") or not (index == "" or index.isdigit()):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not count:
            raise ValueError(f"device={self.device!r} was asked for but CUDA is not available")
        first = int(index or 0)
        if first + self.tensor_parallel_size > count:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} from cuda:{first} needs "
                f"{first + self.tensor_parallel_size} GPUs; this machine has {count}"
            )
        return f"cuda:{first}"

    def _resolve_dtype(self) -> str:
        if self.dtype != "auto":
            name = self.dtype if isinstance(self.dtype, str) else str(self.dtype).removeprefix("torch.")
            name = DTYPE_ALIASES.get(name, name)
            if name not in DTYPE_BYTES:
                choices = sorted([*DTYPE_BYTES, *DTYPE_ALIASES])
                raise ValueError(f"dtype must be 'auto' or one of {choices}, got {self.dtype!r}")
            return name
        dtype = getattr(self.hf_config, "dtype", None) or getattr(self.hf_config, "torch_dtype", None)
        name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        if name in DTYPE_BYTES:
            return name
        return "bfloat16" if self.device != "cpu" else "float32"

    def _resolve_attention_backend(self) -> str:
        name, cuda, bs = self.attention_backend, self.device != "cpu", self.kvcache_block_size
        flash_attn_installed = importlib.util.find_spec("flash_attn") is not None
        if name == "auto":
            if not cuda:
                return "torch"
            return "flash_attn" if flash_attn_installed and (bs is None or bs % 256 == 0) else "triton"
        if name not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be 'auto' or one of {ATTENTION_BACKENDS}, got {name!r}")
        if name == "flash_attn":
            if not cuda or not flash_attn_installed:
                raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package")
            if bs is not None and bs % 256:
                raise ValueError(f"flash-attn needs kvcache_block_size to be a multiple of 256, got {bs}")
        if name == "triton" and bs is not None and bs < 16:
            raise ValueError(f"the Triton backend needs kvcache_block_size >= 16, got {bs}")
        if name == "triton" and not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs CUDA (on CPU: 'torch', or the Triton interpreter, "
                "TRITON_INTERPRET=1, for kernel development)"
            )
        return name

    @property
    def linear_weights(self) -> str | None:
        """How the decoder's linear layers hold their weights: None (``dtype``), "fp8" (quantized
        as they load), "fp8_block" or "fp8_tensor" (an FP8 checkpoint's, as stored: see
        :func:`~nanovllm.models.registry.fp8_checkpoint_layout`)."""
        return fp8_checkpoint_layout(self.hf_config) or self.quantization

    def _resolve_structured_outputs_config(self) -> dict:
        given = self.structured_outputs_config
        if given is None:
            given = {}
        elif not isinstance(given, dict):  # vLLM's StructuredOutputsConfig, or any object alike
            given = {k: v for k, v in vars(given).items() if not k.startswith("_")}
        settings = dict(backend="auto", disable_any_whitespace=False, disable_additional_properties=False)
        reasoning = ("reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")
        unknown = set(given) - set(settings) - set(reasoning)
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {sorted(unknown)}")
        if given.get("backend", "auto") not in ("auto", "xgrammar"):
            raise ValueError(
                f"structured_outputs_config backend={given['backend']!r} is not supported: xgrammar is the "
                "backend here ('auto' or 'xgrammar')"
            )
        if any(given.get(name) for name in reasoning):
            raise ValueError("structured_outputs_config: reasoning parsers are not implemented")
        settings.update({k: v for k, v in given.items() if k in settings})
        return settings

    def _check_quantization(self) -> None:
        if self.quantization is None and fp8_checkpoint_layout(self.hf_config):
            object.__setattr__(self, "quantization", "fp8")  # vLLM reads it from the checkpoint too
        if self.quantization not in (None, "fp8"):
            raise ValueError(
                f"quantization={self.quantization!r} is not supported: None or 'fp8' (weights quantized "
                "to float8 as they load); for another format, load the bf16/fp16 checkpoint"
            )
        experts, expert_size, _ = moe_settings(self.hf_config)
        share = expert_size // self.tensor_parallel_size
        if self.linear_weights == "fp8_block" and experts and self.tensor_parallel_size > 1 and share % 128:
            raise ValueError(
                f"an FP8 checkpoint's experts (128 x 128 blocks) need each rank's share of "
                f"moe_intermediate_size={expert_size} to be a multiple of 128; with "
                f"tensor_parallel_size={self.tensor_parallel_size} it is {share}"
            )

    def _resolve_kv_cache_dtype(self) -> str:
        """``dtype`` for "auto", else "fp8" (checked against the backend and the GPU)."""
        name = self.kv_cache_dtype
        if name in ("auto", self.dtype):  # (a resolved config is built again in each worker)
            return self.dtype
        if name not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be 'auto' or one of {sorted(KV_CACHE_DTYPES)}, got {name!r}"
            )
        if self.attention_backend == "flash_attn":
            raise ValueError("kv_cache_dtype='fp8' needs the triton or torch attention backend")
        index = int(self.device.removeprefix("cuda:")) if self.device != "cpu" else None
        if index is not None and self.platform.gpu_capabilities[index] < (8, 9):
            raise ValueError("kv_cache_dtype='fp8' needs a GPU with float8 support (compute capability 8.9+)")
        return "fp8"

    def _eos_ids(self) -> tuple[int, ...]:
        from transformers import GenerationConfig

        ids: list[int] = []
        sources = [getattr(self.hf_config, "eos_token_id", None)]
        try:
            sources.append(GenerationConfig.from_pretrained(self.model).eos_token_id)
        except OSError:
            pass
        for eos in sources:
            for i in eos if isinstance(eos, (list, tuple)) else [eos]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        return tuple(ids)
