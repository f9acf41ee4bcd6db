"""The orchestration layer: prompts in, completions out, in prompt order."""

import atexit
import os
import time
from collections import deque
from dataclasses import dataclass, fields

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.engine.batch import StepBatch
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import SampledTokens
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tp_executor import TPExecutor
from nanovllm.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class InFlightStep:
    seqs: list[Sequence]
    is_prefill: bool
    num_tokens: int
    tokens: SampledTokens


class LLMEngine:
    """Owns the scheduler, the executor and the tokenizer; see :meth:`generate`.

    Bad input (a bad prompt or sampling parameter anywhere in a call) makes the whole
    ``generate`` call raise ``ValueError`` before any work starts; the engine stays usable.
    """

    def __init__(self, model: str, **kwargs):
        known = {f.name for f in fields(Config) if f.init}
        unknown = set(kwargs) - known
        if unknown:
            raise ValueError(f"unknown LLM options {sorted(unknown)}; known: {sorted(known - {'model'})}")
        self.config = config = Config(os.path.expanduser(model), **kwargs)
        self.executor = None
        self.tokenizer = None
        if any(os.path.exists(os.path.join(config.model, f)) for f in TOKENIZER_FILES):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model, use_fast=True)
        self.executor = TPExecutor(config)
        atexit.register(self.exit)
        self.num_kvcache_blocks = self.executor.runner.num_kvcache_blocks
        self.vocab_size = config.hf_config.vocab_size
        self.in_flight: deque[InFlightStep] = deque()
        # planning a step while the previous one runs needs that step's tokens on this rank
        self.plan_ahead = config.async_scheduling and config.tensor_parallel_size == 1
        self.scheduler = Scheduler(
            BlockManager(self.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.eos_token_ids,
        )

    def exit(self) -> None:
        """Stop workers and free the KV cache, CUDA graphs and shared memory. Idempotent."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        atexit.unregister(self.exit)

    def _to_token_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model!r} has no tokenizer files: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of int token ids")
        return list(prompt)

    def _validate(self, i: int, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"prompt {i} is empty")
        if len(token_ids) > self.config.max_model_len:
            raise ValueError(
                f"prompt {i} has {len(token_ids)} tokens, more than max_model_len={self.config.max_model_len}"
            )
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        token_ids = self._to_token_ids(prompt)
        self._validate(0, token_ids)
        seq = Sequence(token_ids, sampling_params)
        self.scheduler.add(seq)
        return seq

    def _launch(self, seqs: list[Sequence], is_prefill: bool, batch: StepBatch) -> None:
        num_tokens = sum(s.num_scheduled_tokens for s in seqs) if is_prefill else -len(seqs)
        tokens = self.executor.call("launch", batch)
        self.in_flight.append(InFlightStep(seqs, is_prefill, num_tokens, tokens))

    def step(self) -> tuple[list[Sequence], int]:
        """Run one step; returns the finished sequences and the tokens it processed
        (positive: prefill tokens, negative: decode sequences).

        With ``async_scheduling``, a decode step is followed at once by the next one, planned
        before the first one's tokens are back, so host work overlaps device work.
        """
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        if not self.in_flight:
            seqs, is_prefill = self.scheduler.schedule()
            self._launch(seqs, is_prefill, StepBatch.from_sequences(seqs, is_prefill))
        last = self.in_flight[-1]
        if self.plan_ahead and len(self.in_flight) == 1 and not last.is_prefill:
            seqs = self.scheduler.schedule_ahead(last.seqs)
            if seqs:
                self._launch(seqs, False, StepBatch.ahead_of(seqs, last.seqs))
        step = self.in_flight.popleft()
        finished = self.scheduler.postprocess(step.seqs, step.tokens.tolist(), step.is_prefill)
        return finished, step.num_tokens

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.in_flight

    def _abort_all(self) -> None:
        self.in_flight.clear()
        for queue in (self.scheduler.running, self.scheduler.waiting):
            while queue:
                self.scheduler.block_manager.free(queue.pop())

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict]:
        """Complete every prompt; returns ``[{"text", "token_ids"}]`` (completion only), in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        if not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError("sampling_params must be SamplingParams or a list of them")
        token_ids = [self._to_token_ids(p) for p in prompts]
        for i, ids in enumerate(token_ids):
            self._validate(i, ids)
        seqs = [Sequence(ids, sp) for ids, sp in zip(token_ids, sampling_params)]
        for seq in seqs:
            self.scheduler.add(seq)
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while not self.is_finished():
                start = time.perf_counter()
                finished, num_tokens = self.step()
                elapsed = time.perf_counter() - start
                if num_tokens > 0:
                    prefill_tps = num_tokens / elapsed
                else:
                    decode_tps = -num_tokens / elapsed
                bar.set_postfix(
                    prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False
                )
                bar.update(len(finished))
        except BaseException:
            self._abort_all()
            raise
        finally:
            bar.close()
        return [
            {"text": self._decode(seq.completion_token_ids), "token_ids": seq.completion_token_ids}
            for seq in seqs
        ]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
