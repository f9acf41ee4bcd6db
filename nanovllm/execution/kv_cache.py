"""The paged KV cache of one rank: how many blocks fit, the tensor, and each layer's views."""

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.execution.platform import torch_dtype
from nanovllm.kernels.kv_layout import KVLayout
from nanovllm.layers.attention import Attention
from nanovllm.layers.parallel import TPGroup

_HEADROOM_BYTES = 2**28  # left free for the allocator's fragmentation and NCCL buffers


class KVCache:
    """One tensor ``[2, layers, blocks, block_size, kv_heads, head_dim]`` holding the K and V
    of every attention layer of ``model``, each layer bound to its own views and to the
    cache's :attr:`layout` (:class:`~nanovllm.kernels.kv_layout.KVLayout`: a float8 V's view
    is token-major).

    The tensor never moves while the cache lives, so CUDA graphs captured against it stay
    valid; :meth:`release` unbinds the layers and frees it.
    """

    def __init__(self, model: nn.Module, num_blocks: int, config: Config, device: torch.device):
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = self.layers[0]
        self.num_blocks = num_blocks
        self.tensor = torch.zeros(
            2,
            len(self.layers),
            num_blocks,
            config.kvcache_block_size,
            first.num_kv_heads,
            first.head_dim,
            dtype=torch_dtype(config.kv_cache_dtype),
            device=device,
        )
        if self.tensor[:, :, :1].numel() * self.tensor.element_size() != config.kv_block_bytes:
            raise RuntimeError("the model's attention layers disagree with the config's KV block size")
        self.layout = KVLayout.for_dtype(self.tensor.dtype)
        for i, attn in enumerate(self.layers):
            attn.k_cache = self.tensor[0, i]
            attn.v_cache = self.layout.v_view(self.tensor[1, i])
            attn.kv_layout = self.layout

    @staticmethod
    def num_blocks_to_allocate(
        config: Config, device: torch.device, tp: TPGroup, measure_peak_bytes: Callable[[], int]
    ) -> int:
        """The block count: as the options fix it, or what the GPU has left under
        ``gpu_memory_utilization`` after the peak of a full-budget step (measured by
        ``measure_peak_bytes``); the least over all ranks. Whether it holds a sequence of
        ``max_model_len`` is :meth:`Config.fit_max_model_len`'s to say."""
        num_blocks = config.fixed_num_kvcache_blocks
        if num_blocks is None:
            peak = measure_peak_bytes()
            free, total = torch.cuda.mem_get_info(device)
            # count only this process's memory, and never more than is free now
            num_blocks = config.kv_blocks_for(
                min(total * config.gpu_memory_utilization - peak, free - _HEADROOM_BYTES)
            )
        num_blocks = tp.min_over_ranks(num_blocks, device)
        if num_blocks < 1:  # no tensor to allocate: raise now, with the message a too-short cache gets
            config.fit_max_model_len(num_blocks)
        return num_blocks

    def release(self) -> None:
        for attn in self.layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self.tensor = None
