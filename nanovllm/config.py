"""The engine's one typed configuration."""

import os
from dataclasses import dataclass, field

from transformers import AutoConfig, PretrainedConfig

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "torch")


@dataclass
class Config:
    """Everything ``LLM(model, **kwargs)`` accepts; validated on construction."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    kv_cache_memory_gb: float | None = None
    """KV-cache size in GiB; the default is 2 GiB on CPU and the free share of
    ``gpu_memory_utilization`` on GPU."""
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    async_scheduling: bool = True
    """Plan each decode step while the previous one runs on the device; with tensor
    parallelism steps run one after another."""
    load_format: str = "auto"
    """"auto" loads ``*.safetensors``; "dummy" fills weights with random values."""
    seed: int = 0
    hf_config: PretrainedConfig = field(init=False, repr=False)
    eos_token_ids: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model folder {self.model!r} does not exist")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"{self.model!r} has no config.json: not a Hugging Face model folder")
        self.hf_config = AutoConfig.from_pretrained(self.model)
        archs = getattr(self.hf_config, "architectures", None) or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(f"unsupported architecture {archs}; supported: {SUPPORTED_ARCHITECTURES}")
        self._check_choices()
        self._check_numbers()
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()

    def _check_choices(self) -> None:
        for name, value, choices in (
            ("dtype", self.dtype, DTYPES),
            ("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
            ("load_format", self.load_format, ("auto", "dummy")),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

    def _check_numbers(self) -> None:
        cfg, tp = self.hf_config, self.tensor_parallel_size
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bs = self.kvcache_block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"kvcache_block_size must be a power of two, got {bs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        if cfg.num_attention_heads % tp or num_kv_heads % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide the attention heads "
                f"({cfg.num_attention_heads}) and KV heads ({num_kv_heads})"
            )

    def _eos_ids(self) -> list[int]:
        ids: list[int] = []
        sources = [getattr(self.hf_config, "eos_token_id", None)]
        try:
            from transformers import GenerationConfig

            sources.append(GenerationConfig.from_pretrained(self.model).eos_token_id)
        except OSError:
            pass
        for eos in sources:
            for i in eos if isinstance(eos, (list, tuple)) else [eos]:
                if i is not None and i not in ids:
                    ids.append(int(i))
        return ids
