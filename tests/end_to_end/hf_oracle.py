"""Hugging Face transformers as the reference: greedy ``generate`` with our logits processors,
log-probabilities, logits, and an attention that reads K and V as a float8 cache stores them."""

import functools

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from nanovllm.sampling_params import SamplingParams


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties, token by token: completion tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        completion = input_ids[0, self.prompt_len :].tolist()
        for t in set(completion):
            scores[0, t] -= self.frequency * completion.count(t) + self.presence
        return scores


class CompletionOnly(LogitsProcessor):
    """A processor shown the completion's tokens only (vLLM's bad words ignore the prompt)."""

    def __init__(self, prompt_len: int, processor: LogitsProcessor):
        self.prompt_len, self.processor = prompt_len, processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.processor(input_ids[:, self.prompt_len :], scores)


def hf_processors(p: SamplingParams, prompt_len: int, eos) -> LogitsProcessorList:
    """The processors Hugging Face would run for ``p`` (``eos``: the model's EOS ids), in our order."""
    procs = LogitsProcessorList()
    if p.allowed_token_ids:
        procs.append(PrefixConstrainedLogitsProcessor(lambda _b, _ids: p.allowed_token_ids, 1))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()]))
    if p.min_tokens:
        stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, stop))
    if p.bad_words_token_ids:
        bad = NoBadWordsLogitsProcessor(p.bad_words_token_ids, eos_token_id=None)
        procs.append(CompletionOnly(prompt_len, bad))
    if p.repetition_penalty != 1:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.frequency_penalty or p.presence_penalty:
        procs.append(PresenceFrequencyPenalty(prompt_len, p.frequency_penalty, p.presence_penalty))
    return procs


@functools.cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model_dir: str, prompt: list[int], p: SamplingParams, eos: tuple[int, ...] = ()) -> list[int]:
    """Greedy completion from transformers with ``p``'s processors; stops at a stop token id,
    or at ``eos`` unless ``p.ignore_eos``."""
    from transformers import GenerationConfig

    stop = [*([] if p.ignore_eos else eos), *p.stop_token_ids]
    config = GenerationConfig(
        max_new_tokens=p.max_tokens, do_sample=False, eos_token_id=stop or None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf_model(model_dir).generate(
            torch.tensor([prompt]),
            generation_config=config,
            logits_processor=hf_processors(p, len(prompt), eos),
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """``[len(completion), vocab]``: log-softmax of the logits that predicted each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def check_prompt_logprobs(hf_model, prompt: list[int], got: list, k: int) -> None:
    """vLLM's layout: None for the first token, then ``{token: Logprob}`` with the top ``k``,
    ranks counted in the whole vocabulary (1: the most likely)."""
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(got) == len(prompt) and got[0] is None
    for t in range(1, len(prompt)):
        top = want[t - 1].topk(k)
        assert set(got[t]) == set(top.indices.tolist()) | {prompt[t]}
        values = torch.tensor([got[t][i].logprob for i in top.indices.tolist()] + [got[t][prompt[t]].logprob])
        expected = torch.cat([top.values, want[t - 1, prompt[t] : prompt[t] + 1]])
        torch.testing.assert_close(values, expected, atol=1e-4, rtol=0)
        assert got[t][prompt[t]].rank == int((want[t - 1] > want[t - 1, prompt[t]]).sum()) + 1


def hf_logits(model_dir: str, prompt: list[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    with torch.no_grad():
        return model(torch.tensor([prompt], device=device)).logits[0].float().cpu()


def float8_kv_attention(module, query, key, value, *args, **kwargs):
    """HF's SDPA attention over K and V rounded to float8 e4m3 (saturating), as an fp8 cache
    stores them: the oracle of an fp8 KV cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    largest = torch.finfo(torch.float8_e4m3fn).max

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.clamp(-largest, largest).to(torch.float8_e4m3fn).to(t.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), *args, **kwargs)
