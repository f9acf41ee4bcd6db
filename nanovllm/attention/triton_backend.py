"""Our own Triton kernels. Prompts without a cached prefix: the long ones go to cuDNN on Hopper
and later; before Hopper all go to torch's varlen flash attention where it exists."""

import inspect
import logging
from collections.abc import Callable

import torch

from nanovllm.attention import cudnn_prefill
from nanovllm.attention.backend import AttentionBackend, AttentionMetadata, QKTransform
from nanovllm.attention.cudnn_prefill import (
    build_plans,
    cudnn_causal_prefill,
    cudnn_prefill_supported,
    takes_prompts,
)
from nanovllm.kernels.decode_attention import DecodePrologue, paged_decode_attention
from nanovllm.kernels.prefill_attention import paged_prefill_attention
from nanovllm.kernels.qk_norm_rope_store import qk_norm_rope_store

logger = logging.getLogger(__name__)


def _find_varlen_attn():
    """torch's varlen attention if this torch has a causal, GQA-capable one, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" not in params or "scale" not in params:
        return None
    if "is_causal" in params:
        return lambda *args, **kw: varlen_attn(*args, is_causal=True, **kw)
    if "window_size" in params:
        return lambda *args, **kw: varlen_attn(*args, window_size=(-1, 0), **kw)
    return None


class TritonBackend(AttentionBackend):
    name = "triton"
    qk_prologue = staticmethod(qk_norm_rope_store)

    def __init__(self) -> None:
        # for prompts with no cached prefix, chosen at the first prefill on CUDA
        self.plain_prefill_chosen = False
        self.use_cudnn = False
        self.varlen_attn: Callable[..., torch.Tensor] | None = None

    def prefill(
        self, q, k, v, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        if q.is_cuda and not self.plain_prefill_chosen:
            self._choose_plain_prefill(q.device)
        if not meta.has_prefix:
            plain = self._plain_prefill(q, k, v, k_cache.dtype, meta, scale)
            if plain is not None:
                return self.written_to(out, plain)
        return paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            scale,
            meta.max_seqlen_q,
            layout=layout,
            out=out,
        )

    def _plain_prefill(
        self, q, k, v, cache_dtype, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor | None:
        """Prompts with no cached prefix through cuDNN or varlen attention where chosen, from
        the step's own K/V; None leaves them to the paged kernel."""
        if self.use_cudnn and takes_prompts(meta.seqlens_q, q.dtype, cache_dtype):
            try:
                return cudnn_causal_prefill(q, k, v, meta.seqlens_q, scale)
            except RuntimeError as e:  # e.g. a cuDNN without a fused kernel for these heads
                self._give_up_cudnn(e)
        if self.varlen_attn is None or q.dtype == torch.float32:  # (chosen on CUDA only)
            return None
        cu, longest = meta.cu_seqlens_q, meta.max_seqlen_q
        return self.varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, enable_gqa=True)

    def warm_up(self, num_heads, num_kv_heads, head_dim, scale, dtype, k_cache, max_prompt_tokens) -> None:
        if not k_cache.is_cuda:
            return
        if not self.plain_prefill_chosen:
            self._choose_plain_prefill(k_cache.device)
        if self.use_cudnn and takes_prompts((max_prompt_tokens,), dtype, k_cache.dtype):
            try:
                built = build_plans(
                    num_heads, num_kv_heads, head_dim, scale, dtype, k_cache.device, max_prompt_tokens
                )
                logger.info("cuDNN attention: plans built for %d prompt lengths", built)
            except RuntimeError as e:
                self._give_up_cudnn(e)

    def _give_up_cudnn(self, error: RuntimeError) -> None:
        logger.warning("cuDNN attention failed (%s); long prompts use the Triton kernel", error)
        self.use_cudnn = False

    def _choose_plain_prefill(self, device: torch.device) -> None:
        # On Hopper the paged kernel outruns torch's varlen attention (FlashAttention 2: 318
        # against 423 TFLOP/s at 8k tokens on an H100), and cuDNN outruns both on long prompts.
        self.use_cudnn = cudnn_prefill.ENABLED and cudnn_prefill_supported(device)
        if torch.cuda.get_device_capability(device) < (9, 0):
            self.varlen_attn = _find_varlen_attn()
        self.plain_prefill_chosen = True

    def decode(
        self, q, k_cache, v_cache, layout, meta: AttentionMetadata, scale: float, out=None
    ) -> torch.Tensor:
        return self._paged_decode(q, k_cache, v_cache, layout, meta, scale, out=out)

    def prepare_and_decode(
        self, q, k, v, k_cache, v_cache, layout, meta: AttentionMetadata, t: QKTransform, scale: float
    ) -> torch.Tensor:
        norms = (t.q_norm_weight, t.k_norm_weight, t.eps)
        prologue = DecodePrologue(k, v, t.positions, t.cos_sin_cache, *norms, meta.slot_mapping)
        return self._paged_decode(q, k_cache, v_cache, layout, meta, scale, prologue)

    @staticmethod
    def _paged_decode(q, k_cache, v_cache, layout, meta, scale, prologue=None, out=None) -> torch.Tensor:
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            row_order=meta.decode_order,
            layout=layout,
            prologue=prologue,
            out=out,
        )
