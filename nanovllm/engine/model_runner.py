"""Runs the model for a :class:`StepBatch`: batch tensors, attention metadata, sampling."""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention import AttentionMetadata, get_attention_backend
from nanovllm.config import Config
from nanovllm.engine.batch import StepBatch
from nanovllm.engine.cuda_graph import DecodeGraphs
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
        if self.device.type == "cuda" and not config.enforce_eager:
            compile_elementwise_ops(self.model)
            compile_elementwise_ops(self.sampler)
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
        max_len = min(self.config.max_model_len, max(budget // 2, 1))  # >= 2 rows for the sampler
        lens = [max_len] * (budget // max_len) + ([budget % max_len] if budget % max_len else [])
        logits = self._dummy_prefill(lens[: self.config.max_num_seqs], has_prefix=False)
        if logits is not None:
            for rows in (logits[:1], logits):  # one row and many: both shapes get compiled
                self.sampler(rows, SamplingTensors(torch.ones(rows.shape[0], device=self.device)))
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
    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _upload(self, int64_parts: list[np.ndarray], int32_parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Copy many small host arrays with two transfers; returns device views, in order."""
        out = []
        for parts, dtype in ((int64_parts, np.int64), (int32_parts, np.int32)):
            flat = self._to_device(
                np.concatenate([np.ravel(p) for p in parts]).astype(dtype, copy=False), None
            )
            offset = 0
            for p in parts:
                out.append(flat[offset : offset + p.size].view(p.shape))
                offset += p.size
        return out

    def _block_table_array(self, batch: StepBatch) -> np.ndarray:
        width = max(len(blocks) for blocks in batch.block_tables)
        table = np.zeros((len(batch.block_tables), width), dtype=np.int32)
        for i, blocks in enumerate(batch.block_tables):
            table[i, : len(blocks)] = blocks
        return table

    def prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Batch tensors, attention metadata and per-row temperatures, in one upload."""
        bs = self.block_size
        q_lens = np.fromiter((len(t) for t in batch.token_ids), dtype=np.int64, count=len(batch.token_ids))
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        context_lens = starts + q_lens
        table = self._block_table_array(batch)
        seq_index = np.repeat(np.arange(len(q_lens)), q_lens)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)])
        positions = np.arange(int(cu_q[-1])) - np.repeat(cu_q[:-1], q_lens) + starts[seq_index]
        slots = table[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(
            (t for tokens in batch.token_ids for t in tokens), dtype=np.int64, count=len(slots)
        )
        cu_k = np.concatenate([[0], np.cumsum(context_lens)]) if batch.is_prefill else np.empty(0, np.int64)
        # float32 temperatures travel bit-cast in the int32 transfer
        temps = np.asarray(batch.temperatures, dtype=np.float32).view(np.int32)
        ids_d, pos_d, slots_d, ctx_d, cu_q_d, cu_k_d, table_d, temps_d = self._upload(
            [input_ids, positions, slots], [context_lens, cu_q, cu_k, table, temps]
        )
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=slots_d,
            context_lens=ctx_d,
            block_tables=table_d,
            cu_seqlens_q=cu_q_d if batch.is_prefill else None,
            cu_seqlens_k=cu_k_d if batch.is_prefill else None,
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(context_lens.max()),
            has_prefix=bool(starts.any()),
        )
        return ids_d, pos_d, meta, temps_d.view(torch.float32)

    def _sampling_tensors(self, batch: StepBatch, temperatures: torch.Tensor) -> SamplingTensors:
        st = SamplingTensors(temperatures)
        st.all_greedy = not any(batch.temperatures)
        if any(k > 0 for k in batch.top_ks):
            st.top_ks = self._to_device(batch.top_ks, torch.int64)
        if any(p < 1 for p in batch.top_ps):
            st.top_ps = self._to_device(batch.top_ps, torch.float32)
        if any(p > 0 for p in batch.min_ps):
            st.min_ps = self._to_device(batch.min_ps, torch.float32)
        if any(s is not None for s in batch.seeds):
            st.seeds, st.steps = batch.seeds, batch.steps
        return st

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> "SampledTokens | None":
        """Enqueue one step on the device; rank 0 gets a handle on the sampled tokens."""
        input_ids, positions, meta, temperatures = self.prepare(batch)
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
        self.last_sampled = self.sampler(logits, self._sampling_tensors(batch, temperatures))
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
