"""The progress bar of ``generate``: finished requests, and live prefill / decode throughput."""

from tqdm.auto import tqdm

WINDOW_S = 0.5


class ProgressBar:
    """Counts finished requests; shows prompt (prefill) and generated (decode) tokens per
    second, each over the same window of at least ``WINDOW_S`` of steps. A step may do both
    kinds of work, and with async scheduling one step's own time says little: it overlaps
    the next."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not enabled)
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = 0.0
        self.rates = {"prefill": 0.0, "decode": 0.0}

    def update(
        self, num_finished: int, num_prefill_tokens: int, num_decode_tokens: int, seconds: float
    ) -> None:
        self.tokens["prefill"] += num_prefill_tokens
        self.tokens["decode"] += num_decode_tokens
        self.seconds += seconds
        if self.seconds >= WINDOW_S:
            self._measure()
        self.bar.set_postfix(self._postfix(), refresh=False)
        self.bar.update(num_finished)

    def _measure(self) -> None:
        for kind, tokens in self.tokens.items():
            self.rates[kind] = tokens / self.seconds
            self.tokens[kind] = 0
        self.seconds = 0.0

    def _postfix(self) -> dict[str, str]:
        return {kind: f"{rate:.0f}tok/s" for kind, rate in self.rates.items()}

    def close(self) -> None:
        if self.seconds and not any(self.rates.values()):  # a run shorter than one window
            self._measure()
        self.bar.set_postfix(self._postfix(), refresh=False)
        self.bar.close()
