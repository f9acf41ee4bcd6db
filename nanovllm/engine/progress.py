"""The progress bar of ``generate``: finished requests, and live prefill / decode throughput."""

from tqdm.auto import tqdm

WINDOW_S = 0.5


class ProgressBar:
    """Counts finished requests; shows tokens per second of prefill and of decode, each
    measured over at least ``WINDOW_S`` of the steps that did that work (with async
    scheduling one step's own time says little: it overlaps the next)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = tqdm(total=total, desc="Generating", dynamic_ncols=True, disable=not enabled)
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self.rates = {"prefill": 0.0, "decode": 0.0}

    def update(
        self, num_finished: int, num_prefill_tokens: int, num_decode_tokens: int, seconds: float
    ) -> None:
        kind, tokens = (
            ("prefill", num_prefill_tokens) if num_prefill_tokens else ("decode", num_decode_tokens)
        )
        self.tokens[kind] += tokens
        self.seconds[kind] += seconds
        if self.seconds[kind] >= WINDOW_S:
            self._measure(kind)
        self.bar.set_postfix(self._postfix(), refresh=False)
        self.bar.update(num_finished)

    def _measure(self, kind: str) -> None:
        self.rates[kind] = self.tokens[kind] / self.seconds[kind]
        self.tokens[kind], self.seconds[kind] = 0, 0.0

    def _postfix(self) -> dict[str, str]:
        return {kind: f"{rate:.0f}tok/s" for kind, rate in self.rates.items()}

    def close(self) -> None:
        for kind in self.rates:  # a run shorter than one window still gets its rate
            if not self.rates[kind] and self.seconds[kind]:
                self._measure(kind)
        self.bar.set_postfix(self._postfix(), refresh=False)
        self.bar.close()
