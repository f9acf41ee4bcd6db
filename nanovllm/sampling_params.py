"""User-facing sampling parameters, vLLM's ``SamplingParams`` with nano-vllm's positional order."""

import math
from dataclasses import KW_ONLY, dataclass, field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FLOAT_FIELDS = (
    "temperature",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "top_p",
    "min_p",
)


def _token_id_list(name: str, value) -> list[int]:
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of int token ids, got {value!r}")
    ids = list(value)
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError(f"{name} must hold int token ids >= 0, got {ids!r}")
    return ids


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured-output constraint: the completion follows exactly one of

    - ``json``: a JSON schema (a dict or a JSON string);
    - ``regex``: a regular expression the whole completion matches;
    - ``choice``: a list of strings, the completion being one of them;
    - ``grammar``: an EBNF grammar as xgrammar reads it (GBNF-style, rule ``root``);
    - ``json_object=True``: any JSON object.

    ``disable_any_whitespace``: JSON without whitespace between its tokens (compact);
    ``whitespace_pattern``: a regular expression the whitespace between JSON tokens matches
    instead of any run of spaces, tabs and newlines. Objects take no properties beyond those
    their schema names unless it says ``additionalProperties`` (so ``disable_additional_properties``
    is what always holds). ``structural_tag`` is not supported.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            got = f"got {kinds}" if kinds else "got none"
            raise ValueError(f"StructuredOutputsParams takes exactly one of {list(_CONSTRAINT_KINDS)}, {got}")
        if self.structural_tag is not None:
            raise ValueError("structural_tag is not supported: use json, regex, choice or grammar")
        if not isinstance(self.json, (str, dict, type(None))):
            raise ValueError(
                f"json must be a JSON schema as a dict or a string, got {type(self.json).__name__}"
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {choice!r}")
            if not all(isinstance(c, str) and c for c in choice):
                raise ValueError(f"choice must hold non-empty strings, got {choice!r}")
            self.choice = list(choice)
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"json_object must be True (or left out), got {self.json_object!r}")
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise ValueError("whitespace_pattern applies to JSON (json or json_object) only")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) is not None)


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's completions.

    Positional, as in nano-vllm: ``temperature`` (0 = greedy), ``max_tokens`` (None: up to
    ``max_model_len``), ``ignore_eos``. Every other field is keyword-only, with vLLM's name
    and meaning:

    - ``n``: completions per prompt, each its own stream, sharing the prompt's KV blocks.
    - ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]): subtracted from the logit of
      every token already generated, once / once per occurrence.
    - ``repetition_penalty`` (> 0, 1 = off): divides positive and multiplies negative logits
      of every token in the prompt or the completion, as Hugging Face's processor does.
    - ``top_k`` (0 or -1 = off), ``top_p`` (1 = off), ``min_p`` (0 = off).
    - ``seed``: makes a request's samples reproducible whatever else runs in the batch.
    - ``stop``: strings that end a completion when its detokenized text contains one; the
      text is cut before it unless ``include_stop_str_in_output``.
    - ``stop_token_ids``: token ids that end a completion (kept in its token ids).
    - ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
    - ``logprobs``: the top-k log-probabilities of each generated token, plus the chosen one.
    - ``prompt_logprobs``: the same for every prompt token after the first.
    - ``logit_bias``: ``{token_id: bias}`` added to the logits before sampling.
    - ``allowed_token_ids``: only these tokens can be sampled.
    - ``bad_words``: no completion contains one of these words' tokens (a word's last token is
      held back where the tokens before it end the completion so far), with or without a
      leading space; the engine tokenizes them into ``bad_words_token_ids``.
    - ``skip_special_tokens``: leave special tokens out of the text;
      ``spaces_between_special_tokens``: put spaces between special tokens in it (tokenizers that
      do so); ``detokenize=False`` leaves the text empty (token ids only).
    - ``truncate_prompt_tokens``: keep only the prompt's last ``k`` tokens (-1: as many as
      ``max_model_len`` leaves room for).
    - ``structured_outputs``: a :class:`StructuredOutputsParams` constraint the completion
      follows (JSON schema, regex, choice, grammar); it ends ("stop") at EOS once the constraint
      is complete, or as soon as nothing else may follow.
    """

    temperature: float = 1.0
    max_tokens: int | None = 64
    ignore_eos: bool = False
    _: KW_ONLY
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_lists()

    def _check_numbers(self) -> None:
        for name in _FLOAT_FIELDS:  # a string would fail later in a comparison, naming nothing
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, -1 or None, got {k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")

    def _check_lists(self) -> None:
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif hasattr(stop, "__iter__") and not isinstance(stop, (bytes, dict)):
            stop = list(stop)
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = stop
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
            self.bad_words = list(words)
        if self.bad_words_token_ids is not None:
            if isinstance(self.bad_words_token_ids, (str, bytes)) or not all(
                ids for ids in self.bad_words_token_ids
            ):
                raise ValueError(
                    f"bad_words_token_ids must be non-empty token id lists, got {self.bad_words_token_ids!r}"
                )
            self.bad_words_token_ids = [
                _token_id_list("bad_words_token_ids", ids) for ids in self.bad_words_token_ids
            ]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict {{token_id: bias}}, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                token = int(token) if isinstance(token, str) and token.isdigit() else token
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not _is_int(token) or token < 0 or not number or not math.isfinite(value):
                    raise ValueError(
                        f"logit_bias maps int token ids to finite floats, got {token!r}: {value!r}"
                    )
                bias[token] = float(value)
            self.logit_bias = bias

    @property
    def penalizes_repeats(self) -> bool:
        """Whether a penalty depends on the tokens seen so far (so the executor needs them)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def needs_token_history(self) -> bool:
        """Whether processing the logits reads the tokens seen so far (so the executor needs them)."""
        return self.penalizes_repeats or any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    @property
    def token_ids_in_params(self) -> list[int]:
        """Every token id these parameters name, for the engine to check against the vocabulary."""
        bad = [t for ids in self.bad_words_token_ids or () for t in ids]
        return self.stop_token_ids + (self.allowed_token_ids or []) + list(self.logit_bias or ()) + bad


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: ``beam_width`` beams, ``max_tokens`` new tokens at most; a beam ends at EOS unless
    ``ignore_eos``; beams are ranked by ``cum_logprob / len(tokens) ** length_penalty``
    (``tokens``: prompt and completion, as vLLM counts). ``include_stop_str_in_output`` is
    accepted for vLLM's signature: beams have no stop strings."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
