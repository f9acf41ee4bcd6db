"""vLLM's prompt types: plain dicts that ``generate``, ``stream`` and ``chat`` take as they are."""

from typing import TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine's tokenizer."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids (``prompt``, when given, is only reported back)."""

    prompt: str
