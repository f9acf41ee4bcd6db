"""The paged KV cache's layout: where a token's key and value lie in a layer's caches.

Every kernel sees a layer's caches as ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
token's slot is ``block_id * block_size + offset``; a slot of -1 means "do not store"
(padding). K is stored in that order. V is too (:attr:`KVLayout.DIM_MAJOR`), or token-major
(:attr:`KVLayout.V_TOKEN_MAJOR`): ``[num_blocks, num_kv_heads, head_dim, block_size]`` in memory,
so that attention's P.V reads its second operand along the reduction (token) axis. An 8-bit V
needs that: shared memory cannot hand out 8-bit operands transposed, so a dim-major float8 V
is read from it a byte at a time.

Attention reads a token-major V by whole tiles, slots past a context included (masking along
the tokens would cut the loads to single elements), and gives those slots zero weight; a NaN
or an infinity there would survive that. So a token-major V holds finite values only: the
store writes a NaN as 0 and clamps to the cache dtype's range (the cache starts zeroed).

The cache picks the layout for its dtype and hands it, with each layer's views, to the layer,
which passes it on to the kernels: they read the layout they are given, and only check that
the V cache's strides agree with it.
"""

import enum

import torch


class KVLayout(enum.Enum):
    """How a layer's K and V caches lie in memory (module docstring); K is always dim-major."""

    DIM_MAJOR = "dim_major"
    V_TOKEN_MAJOR = "v_token_major"

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> "KVLayout":
        """The layout the engine stores a cache of ``dtype`` in: V token-major when 8-bit."""
        return cls.V_TOKEN_MAJOR if dtype.itemsize == 1 else cls.DIM_MAJOR

    @property
    def v_token_major(self) -> bool:
        """Whether V lies ``[blocks, heads, dim, tokens]`` in memory."""
        return self is KVLayout.V_TOKEN_MAJOR

    def v_view(self, storage: torch.Tensor) -> torch.Tensor:
        """``storage`` (contiguous, ``[num_blocks, block_size, num_kv_heads, head_dim]``
        elements) read as a V cache of this layout: same shape; token-major, ``[blocks, heads,
        dim, tokens]`` in memory."""
        if not self.v_token_major:
            return storage
        num_blocks, block_size, num_kv_heads, head_dim = storage.shape
        return storage.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)

    def check(self, v_cache: torch.Tensor) -> None:
        """``ValueError`` unless ``v_cache``'s strides are this layout's: a unit stride in
        head_dim (dim-major), or as :meth:`v_view` lays it out (token-major)."""
        if self.v_token_major:
            agrees = v_cache.stride(1) == 1 and v_cache.stride(3) == v_cache.shape[1]
        else:
            agrees = v_cache.stride(3) == 1
        if not agrees:
            raise ValueError(f"v_cache with strides {v_cache.stride()} is not laid out {self.value}")
