"""The Llama-style decoder that Qwen3, Qwen2 and Llama share, with Hugging Face parameter names.

What differs between those architectures (q/k norms, attention biases) comes from the
registry's :class:`~nanovllm.models.registry.Architecture`.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.attention import AttentionBackend, AttentionMetadata, QKTransform
from nanovllm.kernels.moe_router import route, route_ref
from nanovllm.layers.activation import GateUpSwiGLU
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.fp8 import GROUP
from nanovllm.layers.fused_moe import FusedMoE
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from nanovllm.layers.parallel import TPGroup
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.models.registry import Architecture, attention_dims, context_len, moe_settings, rope_settings


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TPGroup,
        backend: AttentionBackend,
        quant: str | None,
    ):
        super().__init__()
        num_heads, num_kv_heads, self.head_dim = attention_dims(config)
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = num_kv_heads // tp.size
        qkv_bias, o_bias = arch.attention_biases(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, qkv_bias, tp, quant
        )
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, o_bias, tp, quant)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend)
        self.has_qk_norm = arch.qk_norm
        if self.has_qk_norm:  # applied, with the rotary embedding, by the attention layer
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        x: torch.Tensor,
        meta: AttentionMetadata,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``cos_sin[positions]``: each token's rotary cos then sin; ``last_tokens``: each row's
        last token, the only rows attended and projected out (default: every token); every
        token's K and V are cached either way."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.has_qk_norm else ()
        o = self.attn(q, k, v, QKTransform(positions, cos_sin, *norm), meta, last_tokens)
        return self.o_proj(o.flatten(1, -1))


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup, quant: str | None):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = GateUpSwiGLU(config.hidden_size, size, tp, quant)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """Hugging Face's ``Qwen3MoeSparseMoeBlock`` and ``MixtralSparseMoeBlock``: a router's
    softmax (fp32) picks each token's top-k experts, their weights renormalised when
    ``norm_topk_prob`` (always for Mixtral). On CUDA one Triton kernel routes, on the CPU its
    torch reference (:mod:`nanovllm.kernels.moe_router`; ties go to the lower expert id)."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup, quant: str | None = None):
        super().__init__()
        num_experts, size, self.renormalise = moe_settings(config)
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, False, tp)
        self.experts = FusedMoE(num_experts, config.hidden_size, size, tp, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, ids = (route if logits.is_cuda else route_ref)(logits, self.top_k, self.renormalise)
        return self.experts(x, weights, ids)


def is_moe_layer(config: PretrainedConfig, index: int) -> bool:
    """As Hugging Face decides: experts unless listed in ``mlp_only_layers``, every
    ``decoder_sparse_step``-th layer."""
    if moe_settings(config)[0] <= 0 or index in getattr(config, "mlp_only_layers", ()):
        return False
    return (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TPGroup,
        backend: AttentionBackend,
        index: int,
        quant: str | None = None,
    ):
        super().__init__()
        self.self_attn = DecoderAttention(config, arch, tp, backend, quant)
        # Hugging Face's attribute name, so that parameter names are the checkpoint's
        moe = is_moe_layer(config, index)
        self.ffn_name = arch.moe_block if moe else "mlp"
        ffn = SparseMoeBlock(config, tp, quant) if moe else DecoderMLP(config, tp, quant)
        setattr(self, self.ffn_name, ffn)
        # FP8 projections take their input rounded to FP8 by the norm before them (per token and
        # 128 features for block scales)
        fp8_input = quant is not None
        group = GROUP if quant == "fp8_block" else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fp8_input, group)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, fp8_input and not moe, group
        )

    def forward(
        self,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        last_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``last_tokens``: each row's last token, the only rows carried past attention (default:
        every token)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, cos_sin, x, meta, last_tokens)
        if last_tokens is not None:
            residual = residual[last_tokens]
        x, residual = self.post_attention_layernorm(x, residual)
        return getattr(self, self.ffn_name)(x), residual


class DecoderModel(nn.Module):
    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TPGroup,
        backend: AttentionBackend,
        quant: str | None = None,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(  # one table for every layer
            attention_dims(config)[2], context_len(config), theta, scaling, config.max_position_embeddings
        )
        self.layers = nn.ModuleList(
            [DecoderLayer(config, arch, tp, backend, i, quant) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_lengths: torch.Tensor | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rope, cos_sin = self.rotary_emb, self.rotary_emb.cos_sin_cache
        if rope.is_dynamic:  # each token's own row, computed once for every layer
            # without lengths every token is a decode, past its prompt: its length is position + 1
            cos_sin = rope.cos_sin_rows(positions, positions + 1 if rope_lengths is None else rope_lengths)
            positions = torch.arange(positions.shape[0], device=positions.device)
        x, residual = self.embed_tokens(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            # the last layer's K and V are all a later step reads of the other rows
            x, residual = layer(positions, cos_sin, x, residual, meta, last_tokens if i == last else None)
        return self.norm(x, residual)[0]


class DecoderForCausalLM(nn.Module):
    """Hidden states from :meth:`forward`, logits (on rank 0) from :meth:`compute_logits`."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        config: PretrainedConfig,
        arch: Architecture,
        tp: TPGroup,
        backend: AttentionBackend,
        quant: str | None = None,
    ):
        super().__init__()
        num_experts = moe_settings(config)[0]
        if num_experts:  # each expert's projections go into the layer's stacked weights
            block, (gate, up, down) = arch.moe_block, arch.expert_names
            # transformers' in-memory layout first (``named_parameters()`` of a training policy):
            # its names hold "up_proj", which the dense gate/up mapping below would catch
            experts = {
                "mlp.experts.gate_up_proj": (f"{block}.experts.w13", (None, 0)),
                "mlp.experts.down_proj": (f"{block}.experts.w2", (None, None)),
            }
            for e in range(num_experts):
                prefix = f"{block}.experts.{e}."
                # an FP8 checkpoint's block or tensor scales, before the names theirs contain
                for suffix in ("weight_scale_inv", "weight_scale"):
                    experts[f"{prefix}{gate}.{suffix}"] = (f"{block}.experts.w13_scale", (e, 0))
                    experts[f"{prefix}{up}.{suffix}"] = (f"{block}.experts.w13_scale", (e, 1))
                    experts[f"{prefix}{down}.{suffix}"] = (f"{block}.experts.w2_scale", (e, None))
                experts[f"{prefix}{gate}.weight"] = (f"{block}.experts.w13", (e, 0))
                experts[f"{prefix}{up}.weight"] = (f"{block}.experts.w13", (e, 1))
                experts[f"{prefix}{down}.weight"] = (f"{block}.experts.w2", (e, None))
            self.packed_modules_mapping = experts | type(self).packed_modules_mapping
        self.model = DecoderModel(config, arch, tp, backend, quant)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def uses_rope_lengths(self) -> bool:
        """Whether :meth:`forward` wants ``rope_lengths`` for prompt tokens (dynamic rope scaling)."""
        return self.model.rotary_emb.is_dynamic

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rope_lengths: torch.Tensor | None = None,
        last_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rope_lengths``: each token's sequence length for dynamic rope scaling, the
        longer of its position + 1 and its prompt (default: position + 1). ``last_tokens``:
        each row's last token (``StepInputs.last_token_index``), whose hidden states alone are
        returned (default: every token's); the others stop at the last layer's attention, once
        their K and V are cached."""
        return self.model(input_ids, positions, meta, rope_lengths, last_tokens)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)
