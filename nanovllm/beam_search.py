"""vLLM's beam search results: the beams of a prompt, and how they are ranked."""

from dataclasses import dataclass, field

from nanovllm.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (prompt, then completion), each new token's log-probabilities, and
    their sum."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """vLLM's ranking: the summed log-probability over the length (an ending EOS not counted),
    raised to ``length_penalty``."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / length**length_penalty
