"""Requests as the engine tracks them: the prompts vLLM accepts, ``n`` sequences each, and
their outputs (text detokenized as tokens arrive, stop strings)."""

from dataclasses import dataclass, replace

from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import Sequence

_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
_U64 = 2**64 - 1
_SEED_STRIDE = 0x9E3779B97F4A7C15  # an odd 64-bit constant: sample i's seed is seed ^ i * this


@dataclass(slots=True)
class PromptInput:
    text: str | None
    token_ids: list[int] | None


def _token_ids(i: int, value) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"prompt {i}: token ids must be a list of ints, got {type(value).__name__}")
    bad = [t for t in value if not isinstance(t, int) or isinstance(t, bool)]
    if bad:
        raise TypeError(f"prompt {i}: token ids must be ints, got {bad[0]!r}")
    return list(value)


def parse_prompt(i: int, prompt) -> PromptInput:
    """One prompt in any form vLLM takes: a string, a list of token ids, ``{"prompt": str}``
    or ``{"prompt_token_ids": [...]}``. Anything else raises naming the prompt's index."""
    if isinstance(prompt, str):
        return PromptInput(prompt, None)
    if isinstance(prompt, dict):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            keys = sorted(map(str, unknown))
            raise ValueError(f"prompt {i}: unknown keys {keys}; use 'prompt' or 'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            token_ids = _token_ids(i, prompt["prompt_token_ids"])
            return PromptInput(text if isinstance(text, str) else None, token_ids)
        if isinstance(prompt.get("prompt"), str):
            return PromptInput(prompt["prompt"], None)
        raise TypeError(f"prompt {i}: 'prompt' must be a string, got {type(prompt.get('prompt')).__name__}")
    if isinstance(prompt, (list, tuple)):
        return PromptInput(None, _token_ids(i, prompt))
    raise TypeError(
        f"prompt {i}: expected a string, a list of token ids or a dict with 'prompt' or "
        f"'prompt_token_ids', got {type(prompt).__name__}"
    )


def parse_prompts(prompts) -> list[PromptInput]:
    """A single prompt or a list of them (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, dict)):
        return [parse_prompt(0, prompts)]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__} "
            "(convert arrays and tensors with .tolist(), generators with list())"
        )
    if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [PromptInput(None, list(prompts))]
    return [parse_prompt(i, p) for i, p in enumerate(prompts)]


def sample_params(params: SamplingParams, index: int, max_model_len: int) -> SamplingParams:
    """The parameters of completion ``index``: its own seed (``n`` seeded samples must differ)
    and an explicit ``max_tokens``."""
    changes = {}
    if params.max_tokens is None:
        changes["max_tokens"] = max_model_len
    if params.seed is not None and index:
        changes["seed"] = (params.seed ^ (index * _SEED_STRIDE)) & _U64
    if params.prompt_logprobs is not None and index:  # the first sample computes them
        changes["prompt_logprobs"] = None
    return replace(params, **changes) if changes else params


def _logprob_entry(token_id: int, row: tuple[float, list[int], list[float]], k: int) -> dict[int, float]:
    """``{token id: log-probability}`` of a row's top ``k`` and of the token it chose."""
    logprob, ids, values = row
    entry = dict(zip(ids[:k], values[:k]))
    entry[token_id] = logprob
    return entry


class Request:
    """One prompt's ``n`` sequences, and the text of each as it is generated."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "seqs", "tokenizer", "detokenizers",
                 "texts", "num_emitted", "logprobs", "cumulative_logprobs", "prompt_logprobs")  # fmt: skip

    def __init__(self, request_id: str, prompt: PromptInput, token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], tokenizer) -> None:  # fmt: skip
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt.text, token_ids
        self.params, self.seqs = params, seqs
        self.tokenizer = tokenizer if params.detokenize else None
        self.detokenizers: list[IncrementalDetokenizer] | None = None
        self.texts = [""] * len(seqs)
        self.num_emitted = [0] * len(seqs)
        """Completion tokens of each sequence already followed by :meth:`update_text`."""
        wants_logprobs = params.logprobs is not None
        self.logprobs: list[list[dict[int, float]]] | None = [[] for _ in seqs] if wants_logprobs else None
        self.cumulative_logprobs = [0.0] * len(seqs)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        if params.prompt_logprobs is not None:  # none for the first prompt token, as in vLLM
            self.prompt_logprobs = [None] * len(token_ids)

    def add_prompt_logprobs(
        self, first: int, target_ids: list[int], rows: list[tuple[float, list[int], list[float]]]
    ) -> None:
        """Record the log-probabilities of prompt tokens ``first, first + 1, ...`` (once each:
        a preempted prompt is computed again)."""
        k = self.params.prompt_logprobs
        for index, token_id, row in zip(range(first, first + len(rows)), target_ids, rows):
            if self.prompt_logprobs[index] is None:
                self.prompt_logprobs[index] = _logprob_entry(token_id, row, k)

    def add_logprobs(self, index: int, token_id: int, row: tuple[float, list[int], list[float]]) -> None:
        """Record the log-probabilities of sequence ``index``'s newest token (once)."""
        entries = self.logprobs[index]
        if len(entries) < self.seqs[index].num_completion_tokens:
            entries.append(_logprob_entry(token_id, row, self.params.logprobs))
            self.cumulative_logprobs[index] += row[0]

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def update_text(self, index: int) -> str | None:
        """Detokenize sequence ``index``'s new tokens; returns the stop string its text now
        contains (the text is cut there), if any. A finished sequence's text is decoded whole,
        so it ends the same as :meth:`decode_all` would (a trailing partial character included)."""
        seq = self.seqs[index]
        self.num_emitted[index] = seq.num_completion_tokens
        if self.tokenizer is None:
            return None
        if self.detokenizers is None:
            self.detokenizers = [IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens)
                                 for _ in self.seqs]  # fmt: skip
        detok = self.detokenizers[index]
        new = detok.add(seq.completion_token_ids[len(detok.token_ids) :])
        hit = find_stop(detok.text, len(new), self.params.stop) if new and self.params.stop else None
        if hit is not None:
            start, stop = hit
            end = start + len(stop) if self.params.include_stop_str_in_output else start
            self.texts[index] = detok.text[:end]
            return stop
        self.texts[index] = self._whole_text(seq) if seq.is_finished else detok.text
        return None

    def _whole_text(self, seq: Sequence) -> str:
        skip = self.params.skip_special_tokens
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=skip)

    def decode_all(self) -> None:
        """The whole text of every completion at once (when nothing followed it step by step)."""
        if self.tokenizer is not None:
            self.texts = [self._whole_text(seq) for seq in self.seqs]

    def output(self) -> RequestOutput:
        completions = []
        for i, seq in enumerate(self.seqs):
            logprobs = self.logprobs[i] if self.logprobs is not None else None
            cumulative = self.cumulative_logprobs[i] if logprobs is not None else None
            completions.append(
                CompletionOutput(
                    i, self.texts[i], seq.completion_token_ids, cumulative, logprobs,
                    seq.finish_reason, seq.stop_reason,
                )
            )  # fmt: skip
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            completions,
            self.finished,
            self.prompt_logprobs,
            num_cached_tokens=self.seqs[0].num_cached_tokens,
        )
