"""Runs the model for a :class:`StepBatch` on one tensor-parallel rank."""

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import SLEEP_TAGS, Config
from nanovllm.execution.cuda_graph import DecodeGraphs
from nanovllm.execution.decode_halves import DecodeHalves
from nanovllm.execution.kv_cache import KVCache
from nanovllm.execution.loader import WeightMap, Weights, build_model, plan_weight_update
from nanovllm.execution.logprobs import LogprobTensors, prompt_logprobs, to_host, token_logprobs
from nanovllm.execution.platform import rank_device
from nanovllm.execution.sampler import Sampler
from nanovllm.execution.sleep import OffloadedWeights
from nanovllm.execution.startup_steps import dummy_batch, prompt_rows, warm_up_lens
from nanovllm.execution.step_inputs import StepInputBuilder, StepInputs
from nanovllm.execution.token_bitmask import BitmaskUpload
from nanovllm.layers.parallel import TPGroup
from nanovllm.scheduling.step import StepBatch, StepOutput


class PendingOutput:
    """A launched step's output (rank 0), copied to the host without blocking the launch.

    A step with rows under a structured-output constraint is sampled only when its token bitmask
    comes (:meth:`sample_with_bitmask`); the others are sampled at launch."""

    def __init__(self, prompt_logprobs: LogprobTensors | None, prompt_lengths: list[int]):
        self.prompt_logprobs = None if prompt_logprobs is None else prompt_logprobs.to_host()
        self.prompt_lengths = prompt_lengths
        """Targets of each of the batch's prompt-logprobs requests."""
        self.sampled: torch.Tensor | None = None
        self.logprobs: LogprobTensors | None = None
        self.event = None
        self.sample_later: Callable[[np.ndarray], None] | None = None
        self.bitmask_upload: BitmaskUpload | None = None

    def sampled_as(self, sampled: torch.Tensor, logprobs: LogprobTensors | None) -> None:
        """The step's samples: their copy to the host starts now."""
        self.sampled = to_host(sampled)
        self.logprobs = None if logprobs is None else logprobs.to_host()
        if sampled.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def bitmask_buffer(self, rows: int) -> np.ndarray:
        if self.bitmask_upload is None:
            raise RuntimeError("this step has no row under a structured-output constraint")
        return self.bitmask_upload.host_rows_view(rows)

    def sample_with_bitmask(self, bitmask: np.ndarray) -> None:
        if self.sample_later is None:
            raise RuntimeError("this step has no row under a structured-output constraint, or is sampled")
        sample, self.sample_later = self.sample_later, None
        sample(bitmask)

    def result(self) -> StepOutput:
        if self.sampled is None:
            raise RuntimeError("the step awaits its token bitmask (sample_with_bitmask)")
        if self.event is not None:
            self.event.synchronize()
        output = StepOutput(self.sampled.tolist())
        if self.logprobs is not None:
            output.logprobs = self.logprobs.tolist()
        if self.prompt_logprobs is not None:
            entries, start = self.prompt_logprobs.tolist(), 0
            output.prompt_logprobs = []
            for n in self.prompt_lengths:
                output.prompt_logprobs.append(entries[start : start + n])
                start += n
        return output


class ModelRunner:
    """The model, its KV cache, step inputs, sampler and decode graphs of one rank.

    Rank 0 returns sampled token ids; other ranks return None. With async scheduling rank 0
    broadcasts its samples, so that every rank can feed them to a step planned ahead. A step
    with rows under a structured-output constraint is sampled when its bitmask comes, before
    the next launch (the other ranks wait for the broadcast meanwhile).
    """

    def __init__(self, config: Config, rank: int, store: dist.Store | None = None):
        self.config = config
        self.device = rank_device(config, rank)
        self.startup_seconds: dict[str, float] = {}
        """Where this rank's start-up went: "device" (joining the process group, the CUDA
        context), "load" (building the model and reading its weights), "buffers" (the step
        inputs' pinned and device buffers, the sampler's), "profile" (a full-budget prefill
        sizing the KV cache), "kv_cache" (allocating it), "warm_up" (the eager step shapes,
        compiling kernels) and "graphs" (capturing decode graphs); phases that do not run (CPU,
        ``enforce_eager``) are absent."""
        self.tp = TPGroup(rank, config.tensor_parallel_size)
        with self._phase("device"):
            if self.tp.size > 1:
                # a collective that waits longer than this on a stopped or hung peer fails
                dist.init_process_group(
                    "nccl" if self.device.type == "cuda" else "gloo",
                    store=store,
                    world_size=self.tp.size,
                    rank=rank,
                    timeout=timedelta(seconds=config.worker_timeout_s),
                )
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                torch.cuda.init()
        with self._phase("load"):
            self.model = build_model(config, self.tp, self.device)
        with self._phase("buffers"):
            # the engine's seed makes unseeded sampling repeat, engine after engine (as vLLM's)
            self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
            self.inputs = StepInputBuilder(
                config, self.device, self.model.uses_rope_lengths, samples=self.tp.rank == 0
            )
            self.bitmasks = BitmaskUpload(self.device, config.max_num_seqs, config.hf_config.vocab_size)
            self.last_sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
            """The latest step's samples (-1 markers as token 0), where the next step's inputs
            (and the decode graphs) read them."""
        self.unsampled: PendingOutput | None = None
        """A launched step still waiting for its token bitmask."""
        self.graphs: DecodeGraphs | None = None
        self.halves: DecodeHalves | None = None
        self.kv_cache: KVCache | None = None
        with self._phase("profile"):
            num_blocks = KVCache.num_blocks_to_allocate(
                config, self.device, self.tp, self._profile_peak_bytes
            )
        with self._phase("kv_cache"):
            self.kv_cache = KVCache(self.model, num_blocks, config, self.device)
        self.uses_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.kv_cache.layers[0].backend.supports_cuda_graphs
        )
        """Whether decode steps replay CUDA graphs (captured again after sleep mode)."""
        self.offloaded: OffloadedWeights | None = None
        """The weights while :meth:`sleep` has them out of device memory."""
        if self.device.type == "cuda":
            with self._phase("warm_up"):
                self._warm_up()
            if self.uses_graphs:
                with self._phase("graphs"):
                    self.graphs = self._capture_decode_graphs()

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.startup_seconds[name] = time.perf_counter() - start

    @property
    def asleep(self) -> set[str]:
        """What :meth:`sleep` freed (of :data:`SLEEP_TAGS`) and :meth:`wake_up` has not restored."""
        freed = {"weights"} if self.offloaded is not None else set()
        cache_freed = self.kv_cache is not None and self.kv_cache.tensor is None  # (None: closed)
        return freed | ({"kv_cache"} if cache_freed else set())

    @property
    def num_kvcache_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # --- start-up --------------------------------------------------------------------------
    def _profile_peak_bytes(self) -> int:
        """Peak memory of a prefill at the full token budget, run against a one-block cache."""
        placeholder = KVCache(self.model, 1, self.config, self.device)
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            lens = prompt_rows(self.config.max_num_batched_tokens, self.config)
            self.run(dummy_batch(lens, self.config.kvcache_block_size))
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated(self.device)
        finally:
            placeholder.release()

    def _warm_up(self) -> None:
        """The steps of :func:`warm_up_lens`, each sampled (so the sampler compiles too), then
        the attention backend's own start-up work (cuDNN's plans, where it takes prompts)."""
        for lens, prefix in warm_up_lens(self.config):
            self.run(dummy_batch(lens, self.config.kvcache_block_size, prefix))
        longest = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        self.kv_cache.layers[0].warm_up(longest, getattr(torch, self.config.dtype))  # layers alike
        torch.cuda.synchronize()

    def _capture_decode_graphs(self, capture: bool = True) -> DecodeGraphs:
        """The decode graphs; ``capture=False``: their forward passes run eagerly (tests on CPU).
        Large sizes run as two halves where the environment asks (:class:`DecodeHalves`)."""
        block_size, n = self.config.kvcache_block_size, self.config.max_num_seqs
        self.halves = DecodeHalves.from_environment(self.model, self.tp.size)
        self.inputs.build(dummy_batch([1] * n, block_size))  # every slot's table and sampling, once

        def prepare(bs: int) -> Callable[[], torch.Tensor]:
            example = self.inputs.build(dummy_batch([1] * bs, block_size, new_slots=False), pad_to=bs)
            return functools.partial(self.forward, example)

        return DecodeGraphs(prepare, n, capture)

    # --- one step ----------------------------------------------------------------------------
    def forward(self, inputs: StepInputs, last_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The model's hidden states for a step's uploaded inputs (of each row's last token only,
        given ``last_tokens``: ``inputs.last_token_index``): all a decode graph holds."""
        input_ids = inputs.resolve(self.last_sampled, self.inputs.slot_table.block_tables.device)
        if self.halves is not None and (inputs.padded_rows or 0) >= self.halves.min_rows:
            return self.halves(input_ids, inputs.positions, inputs.meta, inputs.rope_lengths)
        return self.model(input_ids, inputs.positions, inputs.meta, inputs.rope_lengths, last_tokens)

    @torch.inference_mode()
    def launch(self, batch: StepBatch) -> PendingOutput | None:
        """Enqueue one step on the device; rank 0 gets a handle on its output."""
        pad_to = self.graphs.padded_size(len(batch)) if self.graphs is not None and batch.is_decode else None
        inputs = self.inputs.build(batch, pad_to=pad_to)
        if inputs.padded_rows is not None:
            hidden = self.graphs.replay(inputs.padded_rows)[: len(batch)]
        elif batch.is_decode or batch.prompt_logprobs:
            hidden = self.forward(inputs)
        else:  # each row's last token only: the others' work ends with their last K and V
            hidden = self.forward(inputs, inputs.last_token_index)
        prompt_lp = None
        if batch.prompt_logprobs:  # before keeping only each row's last token
            requests = batch.prompt_logprobs
            prompt_lp = prompt_logprobs(hidden, batch.num_tokens, requests, self.model.compute_logits)
            if not batch.is_decode:
                hidden = hidden[inputs.last_token_index]
        logits = self.model.compute_logits(hidden)
        if self.tp.rank != 0:
            if self.tp.size > 1 and self.config.async_scheduling:  # rank 0's samples, for a step ahead
                dist.broadcast(self.last_sampled[: len(batch)], src=0)
            return None
        prompt_lengths = [len(r.target_ids) for r in batch.prompt_logprobs]
        pending = PendingOutput(prompt_lp, prompt_lengths)
        if batch.structured_rows:
            rows = batch.structured_rows
            pending.sample_later = functools.partial(self._sample, pending, logits, inputs, rows)
            pending.bitmask_upload = self.bitmasks
            self.unsampled = pending
        else:
            self._sample(pending, logits, inputs)
        return pending

    @torch.inference_mode()
    def _sample(
        self,
        pending: PendingOutput,
        logits: torch.Tensor,
        inputs: StepInputs,
        structured_rows: list[int] | None = None,
        bitmask: np.ndarray | None = None,
    ) -> None:
        """Rank 0: sample (rows ``structured_rows`` under ``bitmask``), hand the samples to
        ``pending`` and, with async scheduling over several ranks, to every rank."""
        if structured_rows:
            self.bitmasks.apply(logits, structured_rows, bitmask)
        sampled = self.sampler(logits, inputs.sampling)  # leaves the (masked) logits as they are
        logprobs = None
        if inputs.max_logprobs is not None:
            logprobs = token_logprobs(logits, sampled, inputs.max_logprobs)
        # a step planned ahead embeds these: a row without a token (a negative marker, its
        # sequence ends) feeds token 0 instead
        last_sampled = torch.clamp(sampled, min=0, out=self.last_sampled[: sampled.shape[0]])
        if self.tp.size > 1 and self.config.async_scheduling:
            dist.broadcast(last_sampled, src=0)
        pending.sampled_as(sampled, logprobs)
        self.unsampled = None

    @torch.inference_mode()
    def load_weights(self, weights: Weights) -> list[str]:
        """One rank alone: check every ``(hf_name, tensor)``, then copy each in place (the
        parameters keep their storage, so CUDA graphs stay valid). Returns the names loaded."""
        plan = plan_weight_update(self.model, weights)
        for _, target, tensor in plan:
            target.load(tensor)
        return [name for name, _, _ in plan]

    @torch.inference_mode()
    def broadcast_weights(self, entries: list[tuple[str, tuple, torch.dtype]], tensors=None) -> None:
        """Every rank at once: each tensor of an update (checked on rank 0, which holds
        ``tensors``), broadcast from rank 0 one at a time, loaded into this rank's shard."""
        router = WeightMap(self.model)
        for i, (name, shape, dtype) in enumerate(entries):
            if self.tp.rank == 0:
                tensor = tensors[i].detach().to(self.device).contiguous()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(tensor, src=0)
            target = router.target(name)
            if target is not None:
                target.load(tensor)

    # --- sleep mode --------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free this rank's device memory (``LLM.sleep``): the decode graphs, the KV cache
        (its contents are lost) and the weights, copied to CPU memory first at level 1 and
        dropped at level 2 (buffers are kept: no checkpoint holds them). A part asleep stays so."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if "kv_cache" not in self.asleep:
            self.kv_cache.release()
        if "weights" not in self.asleep:
            self.offloaded = OffloadedWeights(self.model, self.device, keep_parameters=level == 1)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed, all of it or the parts ``tags`` names: "weights"
        (new device memory, holding the saved values after level 1) and "kv_cache" (as many
        blocks as before, zeroed); the decode graphs are captured again once both are back."""
        tags = SLEEP_TAGS if tags is None else tags
        unknown = set(tags) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} are unknown: the tags are {list(SLEEP_TAGS)}")
        if "weights" in tags and "weights" in self.asleep:
            self.offloaded.restore()
            self.offloaded = None
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.kv_cache = KVCache(self.model, self.kv_cache.num_blocks, self.config, self.device)
        if not self.asleep and self.uses_graphs and self.graphs is None:
            self.graphs = self._capture_decode_graphs()

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        """``func`` on this rank's model (``LLM.apply_model``)."""
        return func(self.model)

    def run(self, batch: StepBatch) -> StepOutput | None:
        """One step, waiting for its output (rank 0) — what TP workers and tools call."""
        pending = self.launch(batch)
        return pending.result() if pending is not None else None

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if self.kv_cache is not None:
            self.kv_cache.release()
            self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self.tp.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
