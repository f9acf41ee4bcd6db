"""Every architecture the engine serves, in one table: its model class and what sets it apart.

Pure data (model classes are imported only when a model is built), so the configuration can
check a checkpoint before anything heavy is loaded.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanovllm.layers.rope_scaling import SCALING_TYPES, dynamic_factor, scaling_type

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class Architecture:
    """One Hugging Face ``architectures`` entry and how our model class must be set up for it."""

    name: str
    model_type: str
    model_class: str
    """``"module:Class"`` of the model that serves it."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before the rotary embedding (Qwen3)."""
    qkv_bias: bool | None = None
    """Bias on the q/k/v projections; None: the config's ``attention_bias``."""
    o_bias: bool | None = None
    """Bias on the output projection; None: the config's ``attention_bias``."""
    moe_block: str = "mlp"
    """The decoder layer's attribute holding a mixture-of-experts block (its weights' prefix)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Each expert's gate, up and down projections, as the checkpoint names them."""

    def load_model_class(self) -> type:
        module, name = self.model_class.split(":")
        return getattr(importlib.import_module(module), name)

    def attention_biases(self, config: PretrainedConfig) -> tuple[bool, bool]:
        """(q/k/v bias, output-projection bias) for this checkpoint."""
        default = bool(getattr(config, "attention_bias", False))
        return (
            default if self.qkv_bias is None else self.qkv_bias,
            default if self.o_bias is None else self.o_bias,
        )


_DECODER = "nanovllm.models.decoder:DecoderForCausalLM"
ARCHITECTURES = {
    arch.name: arch
    for arch in (
        Architecture("Qwen3ForCausalLM", "qwen3", _DECODER, qk_norm=True),
        Architecture("Qwen2ForCausalLM", "qwen2", _DECODER, qkv_bias=True, o_bias=False),
        Architecture("LlamaForCausalLM", "llama", _DECODER),
        Architecture("MistralForCausalLM", "mistral", _DECODER),
        Architecture("Qwen3MoeForCausalLM", "qwen3_moe", _DECODER, qk_norm=True),
        Architecture(
            "MixtralForCausalLM",
            "mixtral",
            _DECODER,
            moe_block="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        ),
    )
}


def attention_dims(config: PretrainedConfig) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim) of a checkpoint, before tensor parallelism."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, num_kv_heads, head_dim


def rope_settings(config: PretrainedConfig) -> tuple[float, dict]:
    """(rope theta, rope scaling parameters) wherever this transformers version keeps them."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))), scaling


def moe_settings(config: PretrainedConfig) -> tuple[int, int, bool]:
    """(experts, each expert's intermediate size, whether top-k weights are renormalised) as
    Qwen3-MoE and Mixtral configs spell them; 0 experts for a dense model."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    size = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return experts, size, getattr(config, "norm_topk_prob", True)


def rope_type(config: PretrainedConfig) -> str:
    return scaling_type(rope_settings(config)[1])


def context_len(config: PretrainedConfig) -> int:
    """Positions the checkpoint is made for: ``max_position_embeddings``, times the factor
    for linear rope scaling, whose configs keep the length before scaling, and for dynamic
    scaling, which stretches that length (as vLLM counts it)."""
    _, scaling = rope_settings(config)
    kind = scaling_type(scaling)
    factor = 1.0
    if kind == "linear":
        factor = scaling.get("factor", 1.0)
    elif kind == "dynamic":
        factor = dynamic_factor(scaling)
    return int(config.max_position_embeddings * factor)


def max_shared_prompt_len(config: PretrainedConfig) -> int | None:
    """The longest prompt whose KV may be shared through the prefix cache (None: any).

    Dynamic rope scaling rotates every token of a prompt longer than
    ``max_position_embeddings`` by the prompt's length, so its keys hold for no other prompt.
    """
    return config.max_position_embeddings if rope_type(config) == "dynamic" else None


def resolve_architecture(config: PretrainedConfig) -> Architecture:
    """The registry entry for a checkpoint's config; ``ValueError`` for an architecture we do
    not serve, or for any feature of it that we do not implement (named, never run wrong)."""
    names = getattr(config, "architectures", None) or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {names}; supported: {sorted(ARCHITECTURES)}")
    _refuse_unimplemented(config, arch)
    return arch


def _refuse_unimplemented(config: PretrainedConfig, arch: Architecture) -> None:
    def refuse(feature: str) -> None:
        raise ValueError(f"{arch.name} checkpoint sets {feature}, which nanovllm does not implement")

    _, scaling = rope_settings(config)
    if scaling_type(scaling) not in SCALING_TYPES:
        refuse(f"rope scaling {scaling_type(scaling)!r} (implemented: {', '.join(SCALING_TYPES)})")
    partial = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        refuse(f"partial_rotary_factor={partial} (rotary embeddings on part of each head)")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        refuse(f"hidden_act={act!r} (only 'silu' is implemented)")
    if getattr(config, "mlp_bias", False):
        refuse("mlp_bias=True")
    if getattr(config, "use_sliding_window", False):
        refuse("use_sliding_window=True (sliding-window attention)")
    if arch.model_type in ("mistral", "mixtral") and getattr(config, "sliding_window", None) is not None:
        refuse(f"sliding_window={config.sliding_window} (sliding-window attention)")
    if getattr(config, "quantization_config", None) and fp8_checkpoint_layout(config) is None:
        refuse(
            f"quantization_config {config.quantization_config!r} (FP8 with dynamic activation scales "
            "is implemented: weight_block_size [128, 128] or one scale per tensor, every decoder "
            "linear quantized)"
        )


def fp8_checkpoint_layout(config: PretrainedConfig) -> str | None:
    """How an FP8 checkpoint (``quant_method: fp8``, activations scaled on the fly) stores its
    linear weights: "fp8_block", e4m3 with 128 x 128 block scales (``weight_scale_inv``), as
    Qwen3-*-FP8 and DeepSeek do; "fp8_tensor", e4m3 with one scale per tensor
    (``weight_scale``), as AutoFP8's dynamic checkpoints do (only the LM head left unquantized);
    None for anything else."""
    quant = getattr(config, "quantization_config", None)
    if not isinstance(quant, dict):
        quant = getattr(quant, "to_dict", lambda: None)()
    if not isinstance(quant, dict):
        return None
    if quant.get("quant_method") != "fp8" or quant.get("activation_scheme", "dynamic") != "dynamic":
        return None
    if any(name != "lm_head" for name in quant.get("ignored_layers") or ()):
        return None
    block = quant.get("weight_block_size")
    if block is None:
        return "fp8_tensor"
    return "fp8_block" if list(block) == [128, 128] else None
