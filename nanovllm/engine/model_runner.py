"""Runs the model for a :class:`StepBatch`: batch tensors, attention metadata, sampling."""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention import AttentionMetadata, get_attention_backend
from nanovllm.config import Config
from nanovllm.engine.batch import StepBatch
from nanovllm.engine.cuda_graph import DecodeGraphs
from nanovllm.engine.step_inputs import StepInputBuilder
from nanovllm.layers.attention import Attention
from nanovllm.layers.parallel import TPGroup
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.models import MODEL_REGISTRY
from nanovllm.utils.compile import compile_elementwise_ops
from nanovllm.utils.device import resolve_device, resolve_dtype
from nanovllm.utils.loader import init_dummy_weights, load_model


class SampledTokens:
    """A step's sampled token ids, copied to the host without blocking the launch."""

    def __init__(self, tokens: torch.Tensor):
        self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class ModelRunner:
    """One per TP rank. Rank 0 returns sampled token ids; other ranks return None."""

    def __init__(self, config: Config, rank: int, dist_init_method: str | None = None):
        self.config = config
        self.block_size = config.kvcache_block_size
        self.device = resolve_device(config, rank)
        self.dtype = resolve_dtype(config, self.device)
        self.tp = TPGroup(rank, config.tensor_parallel_size)
        if self.tp.size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            # a generous timeout turns a dead peer into an error instead of a hang
            dist.init_process_group(
                backend,
                init_method=dist_init_method,
                world_size=self.tp.size,
                rank=rank,
                timeout=timedelta(minutes=5),
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.attn_backend = get_attention_backend(config.attention_backend, self.device, self.block_size)
        hf_config = config.hf_config
        model_cls = MODEL_REGISTRY[next(a for a in hf_config.architectures if a in MODEL_REGISTRY)]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_cls(hf_config, self.tp, self.attn_backend)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler()
        self.inputs = StepInputBuilder(self.device, self.block_size)
        if self.device.type == "cuda" and not config.enforce_eager:
            compile_elementwise_ops(self.model)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_kvcache_blocks = self.allocate_kv_cache()
        self.graphs = None
        self.last_sampled: torch.Tensor | None = None
        if self.device.type == "cuda" and not config.enforce_eager and self.attn_backend.supports_cuda_graphs:
            self.graphs = DecodeGraphs(self, config.max_num_seqs, self.max_blocks_per_seq)

    @property
    def max_blocks_per_seq(self) -> int:
        return (self.config.max_model_len + self.block_size - 1) // self.block_size

    # --- KV cache -------------------------------------------------------------------------
    def _block_bytes(self) -> int:
        layer = self.attn_layers[0]
        per_token = 2 * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return len(self.attn_layers) * self.block_size * per_token

    def _dummy_prefill(self, lens: list[int], has_prefix: bool) -> torch.Tensor | None:
        """A prefill of zeros against whatever cache is set; every table entry is block 0."""
        n = sum(lens)
        cu = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=self.device),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(
                len(lens), self.max_blocks_per_seq, dtype=torch.int32, device=self.device
            ),
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max(lens),
            max_seqlen_k=max(lens),
            has_prefix=has_prefix,
        )
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(length, device=self.device) for length in lens])
        hidden = self.model(ids, positions, meta)
        return self.model.compute_logits(hidden[cu[1:].long() - 1])

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Peak memory of a prefill at the full token budget, run against a one-block cache.

        It also compiles, before the first request, what that request would otherwise wait
        for: the prefill kernels (with and without a cached prefix) and the sampler.
        """
        layer = self.attn_layers[0]
        dummy = torch.zeros(
            2, 1, self.block_size, layer.num_kv_heads, layer.head_dim, dtype=self.dtype, device=self.device
        )
        for attn in self.attn_layers:
            attn.k_cache, attn.v_cache = dummy[0], dummy[1]
        self._dummy_prefill([16, 16], has_prefix=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        budget = self.config.max_num_batched_tokens
        max_len = min(self.config.max_model_len, budget)
        lens = [max_len] * (budget // max_len) + ([budget % max_len] if budget % max_len else [])
        logits = self._dummy_prefill(lens[: self.config.max_num_seqs], has_prefix=False)
        if logits is not None:
            self.sampler(logits, SamplingTensors(torch.ones(logits.shape[0], device=self.device)))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(self.device)

    def allocate_kv_cache(self) -> int:
        config = self.config
        block_bytes = self._block_bytes()
        if config.num_kvcache_blocks > 0:
            num_blocks = config.num_kvcache_blocks
        else:
            if config.kv_cache_memory_gb is not None:
                budget = config.kv_cache_memory_gb * 2**30
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                peak = self._profile_peak_bytes()
                # count only this process's memory, and never more than is free now
                budget = min(total * config.gpu_memory_utilization - peak, free - 2**28)
            else:
                budget = 2 * 2**30
            num_blocks = int(budget // block_bytes)
            # more blocks than every sequence at full length can use would only waste memory
            num_blocks = min(num_blocks, config.max_num_seqs * self.max_blocks_per_seq)
        if self.tp.size > 1:  # ranks may measure slightly different budgets; agree on the least
            t = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            num_blocks = int(t.item())
        if num_blocks * self.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0) * self.block_size} tokens, less than one sequence "
                f"of max_model_len={config.max_model_len}: raise gpu_memory_utilization / "
                f"kv_cache_memory_gb / num_kvcache_blocks, or lower max_model_len"
            )
        layer = self.attn_layers[0]
        self.kv_cache = torch.zeros(
            2,
            len(self.attn_layers),
            num_blocks,
            self.block_size,
            layer.num_kv_heads,
            layer.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        return num_blocks

    # --- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> "SampledTokens | None":
        """Enqueue one step on the device; rank 0 gets a handle on the sampled tokens."""
        inputs = self.inputs.build(batch, with_sampling=self.tp.rank == 0)
        input_ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
        if batch.tokens_from_previous:
            input_ids = self.last_sampled[input_ids]
        if (
            not batch.is_prefill
            and self.graphs is not None
            and len(batch.token_ids) <= self.graphs.max_batch_size
        ):
            hidden = self.graphs.replay(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
            if batch.is_prefill:
                hidden = hidden[meta.cu_seqlens_q[1:].long() - 1]
        logits = self.model.compute_logits(hidden)
        if self.tp.rank != 0:
            return None
        self.last_sampled = self.sampler(logits, inputs.sampling)
        return SampledTokens(self.last_sampled)

    def run(self, batch: StepBatch) -> list[int] | None:
        """One step, waiting for its tokens (rank 0) — what TP workers and tools call."""
        handle = self.launch(batch)
        return handle.tolist() if handle is not None else None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        for attn in self.attn_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
