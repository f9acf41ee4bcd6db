"""Requests as the engine tracks them: the prompts vLLM accepts, and ``n`` completions each,
whose text is detokenized as tokens arrive."""

from concurrent.futures import Future
from dataclasses import dataclass, replace

from nanovllm.engine.detokenizer import IncrementalDetokenizer, find_stop
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling import Sequence, TokenLogprobs

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
    if set(map(type, value)) - {int}:  # (a third of the time of testing each id in Python)
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


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of ``words``, as vLLM reads them: each word as it stands at the start
    of a text and, where that tokenizes differently (not merely longer), after a space."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


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


def _logprob_entry(token_id: int, lp: TokenLogprobs, k: int, tokenizer) -> dict[int, Logprob]:
    """vLLM's ``{token id: Logprob}`` of the top ``k`` and of the token chosen."""

    def text(token: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token])

    entry = {
        token: Logprob(value, rank, text(token))
        for rank, (token, value) in enumerate(zip(lp.top_ids[:k], lp.top_logprobs[:k]), start=1)
    }
    entry[token_id] = Logprob(lp.logprob, lp.rank, text(token_id))
    return entry


class Completion:
    """One of a request's ``n`` completions: its sequence, and the text and log-probabilities
    gathered for it as its tokens arrive."""

    __slots__ = ("request", "index", "seq", "detokenizer", "text", "logprobs", "cumulative_logprob")

    def __init__(self, request: "Request", index: int, seq: Sequence) -> None:
        self.request, self.index, self.seq = request, index, seq
        self.detokenizer: IncrementalDetokenizer | None = None
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0

    def add_logprobs(self, token_id: int, lp: TokenLogprobs) -> None:
        """Record the log-probabilities of the newest token."""
        request = self.request
        self.logprobs.append(_logprob_entry(token_id, lp, request.params.logprobs, request.tokenizer))
        self.cumulative_logprob += lp.logprob

    def follow_text(self, ends: bool, stop_terminated: bool = False) -> str | None:
        """Detokenize the new tokens; returns the stop string the text now contains (the text is
        cut there), if any. The text of a completion that ``ends`` with them is decoded whole,
        so it ends the same as :meth:`decode_whole` would (a trailing partial character included).
        ``stop_terminated``: the newest token is the EOS or stop token id that ends it."""
        seq, request = self.seq, self.request
        if request.tokenizer is None:
            return None
        params = request.params
        if self.detokenizer is None:
            self.detokenizer = IncrementalDetokenizer(request.tokenizer, **request.decode_options)
        detok = self.detokenizer
        token_ids = self._text_token_ids(stop_terminated)
        new = detok.add(token_ids[len(detok.token_ids) :])
        hit = None
        if new and params.stop and seq.num_completion_tokens > params.min_tokens:  # vLLM's rule
            hit = find_stop(detok.text, len(new), params.stop)
        if hit is not None:
            start, stop = hit
            self.text = detok.text[: start + len(stop) if params.include_stop_str_in_output else start]
            return stop
        self.text = self.decode_whole(stop_terminated) if ends else detok.text
        return None

    def _text_token_ids(self, stop_terminated: bool) -> list[int]:
        """The tokens the text shows: as vLLM, all but an EOS or stop token id that ended the
        completion, unless ``include_stop_str_in_output`` (its id stays in ``token_ids``)."""
        token_ids = self.seq.completion_token_ids
        if stop_terminated and not self.request.params.include_stop_str_in_output:
            return token_ids[:-1]
        return token_ids

    def decode_whole(self, stop_terminated: bool) -> str:
        request = self.request
        return request.tokenizer.decode(self._text_token_ids(stop_terminated), **request.decode_options)

    def output(self) -> CompletionOutput:
        seq, logprobs = self.seq, self.logprobs
        cumulative = self.cumulative_logprob if logprobs is not None else None
        return CompletionOutput(
            self.index, self.text, seq.completion_token_ids, cumulative, logprobs, seq.finish_reason,
            seq.stop_reason,
        )  # fmt: skip


class Request:
    """One prompt and its ``n`` completions.

    ``follows_text``: its completions are detokenized step by step (to stream them, or to find
    stop strings); otherwise their text is decoded once, at the end (:meth:`decode_all`).
    """

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "tokenizer", "follows_text",
                 "completions", "prompt_logprobs", "grammar")  # fmt: skip

    def __init__(self, request_id: str, prompt: PromptInput, token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], tokenizer, stream: bool,
                 grammar: Future | None = None) -> None:  # fmt: skip
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt.text, token_ids
        self.params = params
        self.grammar = grammar
        """The compiled grammar of its structured-output constraint (a future), if any."""
        self.tokenizer = tokenizer if params.detokenize else None
        self.follows_text = stream or bool(params.stop)
        self.completions = [Completion(self, i, seq) for i, seq in enumerate(seqs)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        if params.prompt_logprobs is not None:  # none for the first prompt token, as in vLLM
            self.prompt_logprobs = [None] * len(token_ids)

    @property
    def decode_options(self) -> dict:
        params = self.params
        return {
            "skip_special_tokens": params.skip_special_tokens,
            "spaces_between_special_tokens": params.spaces_between_special_tokens,
        }

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.completions]

    def add_prompt_logprobs(self, first: int, target_ids: list[int], entries: list[TokenLogprobs]) -> None:
        """Record the log-probabilities of prompt tokens ``first, first + 1, ...`` (once each:
        a preempted prompt is computed again)."""
        k = self.params.prompt_logprobs
        for index, token_id, lp in zip(range(first, first + len(entries)), target_ids, entries):
            if self.prompt_logprobs[index] is None:
                self.prompt_logprobs[index] = _logprob_entry(token_id, lp, k, self.tokenizer)

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def decode_all(self) -> None:
        """The whole text of every completion at once (when nothing followed it step by step)."""
        if self.tokenizer is not None:
            for completion in self.completions:
                seq = completion.seq  # ended by EOS or a stop token id: "stop" without a string
                stop_terminated = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
                completion.text = completion.decode_whole(stop_terminated)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [c.output() for c in self.completions],
            self.finished,
            self.prompt_logprobs,
            num_cached_tokens=self.completions[0].seq.num_cached_tokens,
        )
