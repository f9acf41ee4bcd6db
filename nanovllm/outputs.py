"""What ``generate`` returns: vLLM's ``RequestOutput`` and ``CompletionOutput``."""

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank in the distribution (1: the most likely),
    and its text (None without detokenization)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (``n`` of them per request).

    ``finish_reason`` is "stop" (an EOS id, a stop token id or a stop string), "length"
    (``max_tokens`` or ``max_model_len``), "abort" (cancelled, or its constraints left no token
    to sample) or None while it runs; ``stop_reason`` is the stop token id or stop string that
    ended it (None otherwise).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its completions.

    nano-vllm scripts read results as dicts: ``out["text"]`` and ``out["token_ids"]`` give the
    first completion's text and token ids.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    def __getitem__(self, key: str):
        if key in ("text", "token_ids"):
            return getattr(self.outputs[0], key)
        raise KeyError(f"{key!r}: a RequestOutput reads as a dict only for 'text' and 'token_ids'")

    def keys(self) -> tuple[str, ...]:
        return ("text", "token_ids")
