"""The orchestration layer: prompts in, completions out, in prompt order."""

import time
from collections import deque
from dataclasses import dataclass
from itertools import count

from nanovllm.config import Config
from nanovllm.engine.executor import Executor, SampledTokens
from nanovllm.engine.progress import ProgressBar
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import BlockManager, ScheduledStep, Scheduler, Sequence


@dataclass(slots=True)
class InFlightStep:
    step: ScheduledStep
    tokens: SampledTokens


@dataclass(slots=True)
class StepResult:
    """What one :meth:`LLMEngine.step` did."""

    finished: list[Sequence]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class LLMEngine:
    """Turns prompts into sequences and runs the step loop on the executor it is handed.

    Bad input (a bad prompt or sampling parameter anywhere in a call) makes the whole
    ``generate`` call raise ``ValueError`` before any work starts; the engine stays usable.
    """

    def __init__(self, config: Config, executor: Executor, tokenizer=None):
        self.config = config
        self.executor: Executor | None = executor
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.num_kvcache_blocks = executor.num_kvcache_blocks
        self.scheduler = Scheduler(
            BlockManager(self.num_kvcache_blocks, config.kvcache_block_size, config.enable_prefix_caching),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            list(config.eos_token_ids),
            config.mixed_steps,
        )
        self.in_flight: deque[InFlightStep] = deque()
        self.seq_ids = count()
        self.async_scheduling = config.async_scheduling and executor.supports_async_scheduling

    def exit(self) -> None:
        """Stop workers and free the KV cache, CUDA graphs and shared memory. Idempotent."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None

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

    def _new_sequence(self, i: int, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        """Prompt ``i`` as a checked sequence, not yet queued."""
        token_ids = self._to_token_ids(prompt)
        self._validate(i, token_ids)
        return Sequence(next(self.seq_ids), token_ids, sampling_params)

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> Sequence:
        seq = self._new_sequence(0, prompt, sampling_params)
        self.scheduler.add(seq)
        return seq

    def _launch(self, step: ScheduledStep) -> None:
        self.in_flight.append(InFlightStep(step, self.executor.launch(step.batch)))

    def step(self) -> StepResult:
        """Run one step: plan and launch it, then collect its tokens.

        With ``async_scheduling``, a step is followed at once by the next one, planned before
        the first one's tokens are back, so host work overlaps device work.
        """
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        if not self.in_flight:
            self._launch(self.scheduler.schedule())
        last = self.in_flight[-1].step
        if self.async_scheduling and len(self.in_flight) == 1:
            ahead = self.scheduler.schedule_ahead(last)
            if ahead is not None:
                self._launch(ahead)
        done = self.in_flight.popleft()
        step, batch = done.step, done.step.batch
        d = batch.num_decode_rows
        num_prefill, num_decode = sum(batch.num_tokens[d:]), 0
        for seq, start in zip(step.seqs[:d], batch.start_positions[:d]):
            if start < seq.num_prompt_tokens:
                num_prefill += 1  # the last token of a prompt
            elif not seq.is_finished:  # else a planned-ahead row of a sequence that just ended
                num_decode += 1
        finished = self.scheduler.postprocess(step, done.tokens.tolist())
        return StepResult(finished, num_prefill, num_decode)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.in_flight

    def abort_all(self) -> None:
        """Drop every request and step in flight; their blocks return to the cache."""
        self.in_flight.clear()
        self.scheduler.abort_all()
        if self.executor is not None and self.executor.recover():
            self.scheduler.block_manager.forget_cached()

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
        seqs = [self._new_sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, sampling_params))]
        for seq in seqs:  # queued only once every prompt passed its checks
            self.scheduler.add(seq)
        bar = ProgressBar(len(seqs), enabled=use_tqdm)
        try:
            while not self.is_finished():
                start = time.perf_counter()
                r = self.step()
                bar.update(
                    len(r.finished), r.num_prefill_tokens, r.num_decode_tokens, time.perf_counter() - start
                )
        except BaseException:
            self.abort_all()
            raise
        finally:
            bar.close()
        return [
            {"text": self._decode(seq.completion_token_ids), "token_ids": seq.completion_token_ids}
            for seq in seqs
        ]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer else ""
