"""Logits processing against Hugging Face's processors, over simulated runs on CPU.

Slots are taken, prefilled in chunks, decoded and taken over again, the way the scheduler
drives the executor; at every step where a row samples a real token, our processed logits
must equal those of Hugging Face's processors (``RepetitionPenaltyLogitsProcessor``,
``SequenceBiasLogitsProcessor``, ``PrefixConstrainedLogitsProcessor``,
``MinNewTokensLengthLogitsProcessor``, and a plain reference for the OpenAI penalties) run on
the row's full token ids. Tokens are then drawn from our logits and recorded on the "device".
"""

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from nanovllm.execution.logits_processors import LogitsSlots, LogitsTensors, process_logits, record_samples
from nanovllm.execution.upload import upload
from nanovllm.sampling_params import SamplingParams
from nanovllm.scheduling.step import NewSlot
from tests.end_to_end import hf_oracle

VOCAB, EOS, SLOTS, MAX_LEN, CHUNK = 40, (1, 2), 4, 64, 5


def hf_processors(p: SamplingParams, prompt_len: int, eos=EOS) -> LogitsProcessorList:
    """The processors Hugging Face would run for ``p`` (``eos``: the model's EOS ids), in our order."""
    return hf_oracle.hf_processors(p, prompt_len, eos)


@dataclass
class Seq:
    slot: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    computed: int = 0
    sent: bool = False
    processors: LogitsProcessorList = field(init=False)

    def __post_init__(self):
        self.processors = hf_processors(self.params, self.num_prompt_tokens)

    def new_slot(self) -> NewSlot:
        p = self.params  # as the scheduler sends it: the tokens seen so far when they are read
        return NewSlot(
            self.slot, self.num_prompt_tokens, p, list(self.token_ids) if p.needs_token_history else None
        )


def gather(slots: LogitsSlots, batch_slots, context_lens, prompt_lens) -> LogitsTensors | None:
    """The batch's logits processing, as the executor gets it (uploaded, here to the CPU)."""
    lt = slots.gather(np.asarray(batch_slots), np.asarray(context_lens), np.asarray(prompt_lens))
    if lt is not None:
        upload(torch.device("cpu"), lt)
    return lt


class Driver:
    """A minimal scheduler over :class:`LogitsSlots`: chunks of ``CHUNK`` tokens, then decodes."""

    def __init__(self, seed: int = 0):
        self.slots = LogitsSlots(SLOTS, MAX_LEN, EOS, torch.device("cpu"))
        self.gen = torch.Generator().manual_seed(seed)
        self.num_checked = 0

    def step(self, seqs: list[Seq]) -> None:
        for s in seqs:
            if not s.sent:
                self.slots.assign(s.new_slot())
                s.sent = True
        counts = [min(CHUNK, len(s.token_ids) - s.computed) for s in seqs]
        context_lens = np.array([s.computed + n for s, n in zip(seqs, counts)], dtype=np.int64)
        prompt_lens = [s.num_prompt_tokens for s in seqs]
        lt = gather(self.slots, [s.slot for s in seqs], context_lens, prompt_lens)
        logits = torch.randn(len(seqs), VOCAB, generator=self.gen) * 3
        ours = logits if lt is None else process_logits(logits, lt)
        sampled = torch.multinomial(ours.softmax(-1), 1, generator=self.gen).squeeze(1)
        if lt is not None:
            record_samples(lt, sampled)
        for i, (s, length) in enumerate(zip(seqs, context_lens.tolist())):
            s.computed = length
            if length < len(s.token_ids):
                continue  # a prompt chunk: its sample is not a token
            expected = s.processors(torch.tensor([s.token_ids]), logits[i : i + 1].clone())
            torch.testing.assert_close(ours[i : i + 1], expected)
            self.num_checked += 1
            s.token_ids.append(int(sampled[i]))


CASES = {
    "repetition 1.3": SamplingParams(repetition_penalty=1.3),
    "repetition 0.7": SamplingParams(repetition_penalty=0.7),
    "frequency": SamplingParams(frequency_penalty=0.8),
    "presence": SamplingParams(presence_penalty=-1.5),
    "all penalties": SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=1.0),
    "logit bias": SamplingParams(logit_bias={3: 5.0, 7: -100.0, 39: 2.5}),
    "allowed": SamplingParams(allowed_token_ids=[1, 4, 5, 6, 9, 30]),
    "min_tokens": SamplingParams(min_tokens=6, stop_token_ids=[5, 9]),
    "min_tokens ignore_eos": SamplingParams(min_tokens=6, stop_token_ids=[5], ignore_eos=True),
    "bad words": SamplingParams(  # biased so that the words' prefixes come up
        bad_words_token_ids=[[3, 4], [9], [3, 5, 6]], logit_bias={3: 3.0, 4: 3.0, 5: 3.0, 6: 3.0}
    ),
    "bad words with penalties": SamplingParams(
        bad_words_token_ids=[[3, 4], [4, 3]], logit_bias={3: 3.0, 4: 3.0}, repetition_penalty=1.1
    ),
    "everything": SamplingParams(
        repetition_penalty=1.5,
        frequency_penalty=0.3,
        presence_penalty=0.3,
        logit_bias={1: 4.0, 6: 3.0},
        allowed_token_ids=[1, 2, 6, 8, 10, 12],
        min_tokens=4,
    ),
}


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", CASES)
def test_matches_hf_mixed_with_plain_rows(name):
    # slot 2 uses the feature; slots 0, 1 and 3 are plain and must stay untouched
    driver = Driver()
    plain = SamplingParams()
    seqs = [Seq(r, prompt(r, 3 + 4 * r), 3 + 4 * r, CASES[name] if r == 2 else plain) for r in range(SLOTS)]
    for _ in range(14):
        driver.step(seqs)
    assert driver.num_checked == 4 * 14 - 5  # prompts of 7, 11 and 15 tokens take 2, 3 and 3 steps
    # a new sequence takes slot 2 with other params: it starts with no history of its own
    seqs[2] = Seq(2, prompt(9, 7), 7, CASES["everything" if name != "everything" else "frequency"])
    for _ in range(10):
        driver.step(seqs)


def test_every_slot_different_and_slot_reuse():
    driver = Driver(seed=1)
    names = list(CASES)
    seqs = [Seq(r, prompt(10 + r, 6 + r), 6 + r, CASES[names[r]]) for r in range(SLOTS)]
    for i in range(SLOTS, len(names)):  # each step, one slot is taken by the next case
        for _ in range(6):
            driver.step(seqs)
        slot = i % SLOTS
        seqs[slot] = Seq(slot, prompt(i, 4), 4, CASES[names[i]])
    for _ in range(6):
        driver.step(seqs)


def test_readmitted_sequence_keeps_its_completion():
    # after a preemption the slot is sent the prompt and the tokens generated before: they are
    # recomputed as a prompt, but still count as completion for the penalties and min_tokens
    driver = Driver(seed=2)
    params = SamplingParams(frequency_penalty=1, presence_penalty=0.5, repetition_penalty=1.4, min_tokens=12)
    first = [Seq(0, prompt(3, 8), 8, params)]
    for _ in range(2 + 8):
        driver.step(first)
    tokens = first[0].token_ids
    assert len(tokens) == 8 + 9
    again = [Seq(3, list(tokens), 8, params), Seq(1, prompt(4, 5), 5, SamplingParams())]
    for _ in range(10):
        driver.step(again)
    assert again[0].token_ids[:17] == tokens


def test_unused_features_cost_nothing():
    slots = LogitsSlots(SLOTS, MAX_LEN, EOS, torch.device("cpu"))
    for r in range(SLOTS):
        slots.assign(NewSlot(r, 5, SamplingParams(temperature=0.5, top_k=3, seed=r)))
    assert slots.gather(np.arange(SLOTS), np.full(SLOTS, 5), np.full(SLOTS, 5)) is None
    assert slots.history is None
    # a slot that uses a feature but is not in the batch adds nothing either
    slots.assign(NewSlot(3, 5, SamplingParams(repetition_penalty=1.2), [0] * 5))
    assert slots.gather(np.arange(3), np.full(3, 6), np.full(3, 5)) is None


def test_processing_leaves_the_input_logits_alone():
    slots = LogitsSlots(SLOTS, MAX_LEN, EOS, torch.device("cpu"))
    slots.assign(NewSlot(0, 3, SamplingParams(logit_bias={2: 1.0}, repetition_penalty=2.0), [2, 2, 3]))
    lt = gather(slots, [0], [3], [3])
    logits = torch.ones(1, VOCAB)
    out = process_logits(logits, lt)
    assert torch.equal(logits, torch.ones(1, VOCAB))
    assert out[0, 2] == 1.0 and out[0, 3] == 0.5 and out[0, 4] == 1.0


def test_missing_token_ids_for_a_penalty_slot_is_an_error():
    slots = LogitsSlots(SLOTS, MAX_LEN, EOS, torch.device("cpu"))
    with pytest.raises(ValueError, match="no token ids"):
        slots.assign(NewSlot(0, 3, SamplingParams(presence_penalty=1.0)))


def test_the_token_table_grows_with_the_contexts_and_keeps_its_tokens():
    slots = LogitsSlots(SLOTS, 4096, EOS, torch.device("cpu"))
    tokens = prompt(5, 300)
    slots.assign(NewSlot(1, 300, SamplingParams(frequency_penalty=1.0), tokens))
    process_logits(torch.zeros(1, VOCAB), gather(slots, [1], [300], [300]))  # writes the prompt
    first = slots.history
    assert 301 <= first.shape[1] < 4096  # not max_model_len columns for every slot at once
    lt = gather(slots, [1], [900], [300])  # a context three times longer: the table grows
    assert slots.history.shape[1] >= 901 and lt.history is slots.history
    assert slots.history[1, :300].tolist() == tokens
