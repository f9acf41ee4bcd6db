"""The orchestration layer: prompts in, completions out, in prompt order."""

import functools
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import count

from nanovllm.beam_search import BeamSearchOutput
from nanovllm.config import Config
from nanovllm.engine.beam_search import beam_search
from nanovllm.engine.controls import EngineControls
from nanovllm.engine.executor import Executor, PendingOutput
from nanovllm.engine.output_processor import OutputProcessor, StepResult
from nanovllm.engine.progress import ProgressBar
from nanovllm.engine.requests import PromptInput, Request, parse_prompts, sample_params, tokenize_bad_words
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import BeamSearchParams, SamplingParams
from nanovllm.scheduling import BlockManager, ScheduledStep, Scheduler, Sequence


@dataclass(slots=True)
class InFlightStep:
    step: ScheduledStep
    output: PendingOutput


class LLMEngine(EngineControls):
    """Turns prompts into sequences and runs the step loop on the executor it is handed.

    Bad input (a bad prompt or sampling parameter anywhere in a call) makes the whole
    ``generate`` call raise ``ValueError`` before any work starts; the engine stays usable.
    One call runs at a time: a ``generate``, ``stream`` or ``chat`` that starts while another
    runs (in another thread, or a stream still being read) raises ``RuntimeError`` at once.
    Whatever ends a call early (an error, Ctrl-C, a stream closed or dropped) leaves the engine
    idle, every KV block free.
    """

    def __init__(self, config: Config, executor: Executor, tokenizer=None):
        self.config = config
        self.executor: Executor | None = executor
        self.tokenizer = tokenizer
        self.vocab_size = config.hf_config.vocab_size
        self.num_kvcache_blocks = executor.num_kvcache_blocks
        self.scheduler = Scheduler(
            BlockManager(
                self.num_kvcache_blocks,
                config.kvcache_block_size,
                config.enable_prefix_caching,
                config.max_shared_prompt_len,
            ),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.mixed_steps,
        )
        self.structured_outputs = StructuredOutputs(
            tokenizer,
            self.vocab_size,
            config.eos_token_ids,
            compact_json=config.structured_outputs_config["disable_any_whitespace"],
        )
        self.output_processor = OutputProcessor(
            self.scheduler, config.eos_token_ids, config.max_model_len, self.structured_outputs
        )
        self.in_flight: deque[InFlightStep] = deque()
        self.seq_ids = count()
        self.request_ids = count()
        self.async_scheduling = config.async_scheduling and executor.supports_async_scheduling
        self.busy = threading.Lock()
        """Held while a call runs its requests."""
        self.asleep: set[str] = set()
        """What :meth:`sleep` freed (of ``config.SLEEP_TAGS``) and :meth:`wake_up` has not restored."""

    def get_tokenizer(self):
        """The model folder's Hugging Face tokenizer (None when it has no tokenizer files)."""
        return self.tokenizer

    def exit(self) -> None:
        """Stop workers and free the KV cache, CUDA graphs and shared memory. Idempotent."""
        if self.executor is not None:
            self.executor.close()
            self.executor = None
        self.structured_outputs.close()

    def _to_token_ids(self, prompt: PromptInput) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model!r} has no tokenizer files: pass prompts as token ids")
        return self.tokenizer.encode(prompt.text)

    def _validate(self, i: int, token_ids: list[int], params: SamplingParams) -> None:
        max_model_len, vocab_size = self.config.max_model_len, self.vocab_size
        if not token_ids:
            raise ValueError(f"prompt {i} is empty")
        if len(token_ids) >= max_model_len:
            raise ValueError(
                f"prompt {i} has {len(token_ids)} tokens: with a token to generate, more than "
                f"max_model_len={max_model_len}"
            )
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        where = f"sampling params of prompt {i}"
        bad = [t for t in params.token_ids_in_params if t >= vocab_size]
        if bad:
            raise ValueError(f"{where} name token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"{where}: {name}={k} is more than the vocabulary's {vocab_size} tokens")
        if params.allowed_token_ids and params.min_tokens:
            held = set(params.stop_token_ids) | (
                set() if params.ignore_eos else set(self.config.eos_token_ids)
            )
            if held.issuperset(params.allowed_token_ids):
                raise ValueError(
                    f"{where} leave no token to sample: every allowed token is an EOS or stop token id, "
                    f"which min_tokens={params.min_tokens} holds back"
                )

    def _new_request(self, i: int, prompt: PromptInput, params: SamplingParams, stream: bool) -> Request:
        """Prompt ``i`` as a checked request with its ``n`` sequences, not yet queued."""
        token_ids = self._to_token_ids(prompt)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError(f"prompt {i}: bad_words need a tokenizer; pass bad_words_token_ids")
            ids = tokenize_bad_words(self.tokenizer, params.bad_words) + (params.bad_words_token_ids or [])
            params = replace(params, bad_words=None, bad_words_token_ids=ids)
        if params.truncate_prompt_tokens is not None:
            k = params.truncate_prompt_tokens
            token_ids = token_ids[-(self.config.max_model_len - 1 if k == -1 else k) :]
        self._validate(i, token_ids, params)
        grammar = None
        if params.structured_outputs is not None:
            try:
                grammar = self.structured_outputs.compile(params.structured_outputs)
            except ValueError as error:
                raise ValueError(f"prompt {i}: structured_outputs: {error}") from None
        samples = [sample_params(params, k, self.config.max_model_len) for k in range(params.n)]
        request_id = str(next(self.request_ids))
        seqs = [Sequence(next(self.seq_ids), token_ids, p, request_id) for p in samples]
        for seq in seqs[1:]:
            seq.prompt_source = seqs[0]
        return Request(request_id, prompt, token_ids, params, seqs, self.tokenizer, stream, grammar)

    def add_requests(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None,
        stream: bool = False,
    ) -> list[Request]:
        """Check every prompt and its parameters, then queue them all (or none), for
        :meth:`step` to run. ``stream``: their text is followed step by step."""
        requests = self._new_requests(prompts, sampling_params, stream)
        self._queue(requests)
        return requests

    def _new_requests(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None, stream: bool
    ) -> list[Request]:
        """Every prompt as a checked request, none queued."""
        inputs = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(inputs)
        if len(sampling_params) != len(inputs):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(inputs)} prompts")
        if not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise ValueError("sampling_params must be SamplingParams or a list of them")
        return [self._new_request(i, p, sp, stream) for i, (p, sp) in enumerate(zip(inputs, sampling_params))]

    def _queue(self, requests: list[Request]) -> None:
        for request in requests:
            for seq in request.seqs:
                self.scheduler.add(seq)
                if request.grammar is not None:
                    self.structured_outputs.track(seq.seq_id, request.grammar)
            self.output_processor.track(request)

    def add_request(self, prompt, sampling_params: SamplingParams) -> Sequence:
        """Queue one prompt of one completion; returns its sequence (tools drive ``step``)."""
        return self.add_requests([prompt], sampling_params)[0].seqs[0]

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
            self._check_awake("step")
            self._launch(self.scheduler.schedule())
            self._sample_under_constraints(self.in_flight[0])
        last = self.in_flight[-1].step
        if self.async_scheduling and len(self.in_flight) == 1:
            ahead = self.scheduler.schedule_ahead(last)
            if ahead is not None:
                self._launch(ahead)
        done = self.in_flight.popleft()
        result = self.output_processor.process(done.step, done.output.result())
        if self.in_flight:  # its rows' constraints now know every token before it
            self._sample_under_constraints(self.in_flight[0])
        return result

    def _sample_under_constraints(self, launched: InFlightStep) -> None:
        """Hand a launched step with rows under a structured-output constraint its token
        bitmask, filled from their grammars (which must have taken every earlier token)."""
        rows = launched.step.batch.structured_rows
        if rows:
            bitmask = self.structured_outputs.bitmask(
                launched.step, launched.output.bitmask_buffer(len(rows))
            )
            launched.output.sample_with_bitmask(bitmask)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and not self.in_flight

    def abort_all(self) -> None:
        """Drop every request and step in flight; their blocks return to the cache."""
        self.in_flight.clear()
        self.scheduler.abort_all()
        self.structured_outputs.matchers.clear()
        if self.executor is not None and self.executor.recover():
            self.scheduler.forget_cached_prefixes()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Complete every prompt; returns one :class:`RequestOutput` per prompt, in order.

        ``prompts``: a string, a list of token ids, ``{"prompt": ...}`` or
        ``{"prompt_token_ids": [...]}`` (vLLM's ``TextPrompt`` / ``TokensPrompt``), or a list of
        any of these. ``lora_request``: None (LoRA adapters are not implemented).
        """
        requests = self._prepare(prompts, sampling_params, stream=False, lora_request=lora_request)
        for _ in self._run(requests, use_tqdm, stream=False):
            pass
        return [request.output() for request in requests]

    def stream(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request=None,
    ) -> Iterator[RequestOutput]:
        """Like :meth:`generate`, but yields a request's output (its text and tokens so far,
        ``finished`` on the last one) each time a step adds to it. Bad input raises here; the
        requests are queued when the iterator is first read. Closing the iterator early
        (``break``, ``close()``, dropping it) cancels the requests left and frees their blocks."""
        requests = self._prepare(prompts, sampling_params, stream=True, lora_request=lora_request)
        return self._run(requests, use_tqdm, stream=True)

    def beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool = False, lora_request=None
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: each prompt's ``beam_width`` best beams (tokens: prompt, then
        completion; text: their decoding), best first. One ``generate`` of one token a step
        over every live beam; the prefix cache holds what beams share."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LoRA adapters are not implemented")
        self._check_awake("beam_search")
        token_ids = [self._to_token_ids(p) for p in parse_prompts(prompts)]
        one_step = functools.partial(self.generate, use_tqdm=False)
        outputs = beam_search(one_step, token_ids, params, self.config.eos_token_ids)
        if self.tokenizer is not None:
            for output in outputs:
                for beam in output.sequences:
                    beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=True)
        return outputs

    def _prepare(self, prompts, sampling_params, stream: bool, lora_request) -> list[Request]:
        if self.executor is None:
            raise RuntimeError("this engine has been shut down")
        self._check_awake("stream" if stream else "generate")
        if lora_request is not None:
            raise ValueError("lora_request is not supported: LoRA adapters are not implemented")
        return self._new_requests(prompts, sampling_params, stream)

    def _run(self, requests: list[Request], use_tqdm: bool, stream: bool) -> Iterator[RequestOutput]:
        """Queue ``requests`` and run steps until every queued sequence ends, holding the engine."""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(
                "this engine is already running a call (a generate in another thread, or a stream "
                "not yet read to the end or closed): one call at a time"
            )
        try:
            if not self.is_finished():
                raise RuntimeError(
                    "requests queued with add_request are still running: step() them to the end"
                )
            yield from self._serve(requests, use_tqdm, stream)
        finally:
            self.busy.release()

    def _serve(self, requests: list[Request], use_tqdm: bool, stream: bool) -> Iterator[RequestOutput]:
        bar = ProgressBar(sum(len(r.completions) for r in requests), enabled=use_tqdm)
        try:
            self._queue(requests)
            while not self.is_finished():
                start = time.perf_counter()
                r = self.step()
                seconds = time.perf_counter() - start
                bar.update(len(r.finished), r.num_prefill_tokens, r.num_decode_tokens, seconds)
                if stream:
                    for request in r.changed:
                        yield request.output()
        except BaseException:  # an error, Ctrl-C, or a consumer closing the stream
            self.abort_all()
            raise
        finally:
            bar.close()
            self.output_processor.followed.clear()
        for request in requests:
            if not request.follows_text:
                request.decode_all()
