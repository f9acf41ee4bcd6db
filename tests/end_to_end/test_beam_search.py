"""vLLM's beam search against Hugging Face's (``generate(num_beams=...)``), on a tiny checkpoint
on CPU: the same beams in the same order, each beam's log-probability HF's."""

import pytest
import torch

from nanovllm import LLM, BeamSearchParams, TokensPrompt
from tests.end_to_end.hf_oracle import hf_logprobs, hf_model


@pytest.fixture(scope="module")
def llm(qwen3_dir):
    engine = LLM(qwen3_dir, device="cpu", dtype="float32", kvcache_block_size=16)
    yield engine
    engine.exit()


@pytest.mark.parametrize("width", [1, 3])
def test_beams_match_hf(llm, qwen3_dir, prompts, width):
    steps, batch = 6, prompts[1:4]
    outs = llm.beam_search(
        [TokensPrompt(prompt_token_ids=p) for p in batch], BeamSearchParams(width, steps, ignore_eos=True)
    )
    model = hf_model(qwen3_dir)
    for prompt, out in zip(batch, outs):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                max_new_tokens=steps, eos_token_id=None, pad_token_id=0, length_penalty=1.0,
            )  # fmt: skip
        assert [beam.tokens[len(prompt) :] for beam in out.sequences] == [
            s[len(prompt) :].tolist() for s in hf
        ]
        for beam in out.sequences:
            completion = beam.tokens[len(prompt) :]
            want = hf_logprobs(model, prompt, completion)[torch.arange(steps), completion].sum().item()
            assert beam.cum_logprob == pytest.approx(want, abs=1e-4)
            assert len(beam.logprobs) == steps and beam.finish_reason == "length"
            assert beam.text == llm.tokenizer.decode(beam.tokens, skip_special_tokens=True)
    assert llm.scheduler.block_manager.num_free_blocks == llm.num_kvcache_blocks


def test_a_beam_ends_at_eos(llm):
    """A beam that reaches EOS ends there ("stop"); the others run to max_tokens ("length")."""
    eos = llm.config.eos_token_ids[0]
    out = llm.beam_search([[eos] * 3], BeamSearchParams(beam_width=4, max_tokens=5))[0]
    assert len(out.sequences) == 4
    for beam in out.sequences:
        completion = beam.tokens[3:]
        assert eos not in completion[:-1]  # nothing after an EOS
        assert beam.finish_reason == ("stop" if completion[-1] == eos else "length")


def test_bad_beam_search_params():
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
