"""vLLM's beam search on the engine's own batching: each step asks every live beam for its
``2 * beam_width`` most likely next tokens in one ``generate`` call (beams share their prompt's
and their common prefix's KV blocks through the prefix cache), then keeps the best."""

from collections.abc import Callable

from nanovllm.beam_search import BeamSearchOutput, BeamSearchSequence, beam_score
from nanovllm.sampling_params import BeamSearchParams, SamplingParams


def beam_search(
    generate: Callable[[list[list[int]], SamplingParams], list],
    prompts: list[list[int]],
    params: BeamSearchParams,
    eos_token_ids: tuple[int, ...],
) -> list[BeamSearchOutput]:
    """``generate(token id prompts, sampling params)`` runs one batch of one-token steps."""
    width = params.beam_width
    step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=2 * width, ignore_eos=True)

    def best(beams: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        return sorted(beams, key=lambda b: beam_score(b, eos_token_ids, params.length_penalty), reverse=True)

    live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [beam for group in live for beam in group]
        if not beams:
            break
        steps = iter(generate([beam.tokens for beam in beams], step))
        for i, group in enumerate(live):
            candidates = []
            for beam in group:
                entry = next(steps).outputs[0].logprobs[0]
                for token, logprob in entry.items():
                    grown = BeamSearchSequence(
                        beam.tokens + [token], beam.logprobs + [entry], beam.cum_logprob + logprob.logprob
                    )
                    if token in eos_token_ids and not params.ignore_eos:
                        grown.finish_reason = "stop"
                        done[i].append(grown)
                    else:
                        candidates.append(grown)
            live[i] = best(candidates)[:width]
    results = []
    for group, finished in zip(live, done):
        for beam in group:
            beam.finish_reason = "length"
        results.append(BeamSearchOutput(best(finished + group)[:width]))
    return results
