"""Driving an engine step by step while prompts keep arriving."""

from nanovllm import LLM, SamplingParams
from nanovllm.engine.llm_engine import StepResult
from nanovllm.scheduling import Sequence


def run_with_arrivals(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, every: int = 3
) -> tuple[list[Sequence], list[StepResult]]:
    """Add the next prompt before every ``every``-th step until all are in, then run to the
    end; returns the sequences (in prompt order) and every step's result."""
    pending, seqs, results = list(prompts), [], []
    while pending or not llm.is_finished():
        if pending and len(results) % every == 0:
            seqs.append(llm.add_request(pending.pop(0), params))
        results.append(llm.step())
    return seqs, results


def num_mixed_steps(results: list[StepResult]) -> int:
    return sum(r.num_prefill_tokens > 0 and r.num_decode_tokens > 0 for r in results)
