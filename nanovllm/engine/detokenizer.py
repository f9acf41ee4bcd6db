"""A completion's text, built token by token, and where a stop string first appears in it."""


class IncrementalDetokenizer:
    """Appends the text each new token adds.

    Decoding a token alone loses what a tokenizer merges across tokens (byte-level pieces of
    one character, leading spaces), so the text of a short window of recent tokens is decoded
    and the part past the already-emitted tokens is kept; a window ending in an incomplete
    character ("\\ufffd") waits for the next token.
    """

    __slots__ = ("tokenizer", "options", "token_ids", "text", "prefix", "read")

    def __init__(self, tokenizer, **decode_options):
        """``decode_options``: the tokenizer's ``decode`` keywords (``skip_special_tokens`` ...)."""
        self.tokenizer = tokenizer
        self.options = decode_options
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix = 0  # the window starts here; tokens before ``read`` are already in ``text``
        self.read = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self.options)

    def add(self, token_ids: list[int]) -> str:
        """Take the completion's new tokens; returns the text they added (maybe none yet)."""
        added = []
        for token_id in token_ids:
            self.token_ids.append(token_id)
            before = self._decode(self.token_ids[self.prefix : self.read])
            window = self._decode(self.token_ids[self.prefix :])
            if len(window) > len(before) and not window.endswith("\ufffd"):
                added.append(window[len(before) :])
                self.prefix, self.read = self.read, len(self.token_ids)
        new_text = "".join(added)
        self.text += new_text
        return new_text


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``num_new_chars`` characters of
    ``text`` (an earlier one would have been found before), as (start index, string)."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if start >= 0 and (best is None or start < best[0]):
            best = (start, stop)
    return best
