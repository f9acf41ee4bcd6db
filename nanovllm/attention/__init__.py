"""Attention backends behind one small interface, chosen by name."""

from nanovllm.attention.backend import AttentionBackend, AttentionMetadata, QKTransform

__all__ = ["AttentionBackend", "AttentionMetadata", "QKTransform", "get_attention_backend"]


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (resolved and checked by :class:`~nanovllm.config.Config`)."""
    if name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r}")
