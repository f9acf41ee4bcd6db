"""Greedy sampling params that use each logits-processing feature, and a check that each one
changes Hugging Face's greedy output."""

from nanovllm import SamplingParams
from tests.end_to_end.hf_oracle import hf_generate

NEW_TOKENS = 24


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


FEATURES = [
    greedy(repetition_penalty=1.3),
    greedy(repetition_penalty=0.7),
    greedy(frequency_penalty=1.5),
    greedy(presence_penalty=2.0, frequency_penalty=-0.5),
    greedy(logit_bias={7: 4.0, 100: 3.0, 200: 3.5}),
    greedy(allowed_token_ids=list(range(50, 500, 7))),
    greedy(repetition_penalty=1.2, presence_penalty=0.5, logit_bias={9: 2.0}),
]


def check_features_matter(model_dir, prompts, params):
    """Each feature changes HF's greedy output, so that a run ignoring it fails."""
    for prompt, p in zip(prompts, params):
        if p != greedy():
            assert hf_generate(model_dir, prompt, p) != hf_generate(model_dir, prompt, greedy()), p
