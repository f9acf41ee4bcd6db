"""An interrupt at any point of scheduling loses no KV block and no slot.

Every call into the block manager (and the scheduler's own state changes) is a point where a
Ctrl-C can land, before or after the call's effect; after it the engine aborts, and every
block and row must be back and the next workload must run correctly.
"""

import random

import pytest

from nanovllm.scheduling.block_manager import BlockManager
from nanovllm.scheduling.scheduler import Scheduler
from tests.scheduling.harness import VOCAB, Harness

POINTS = [
    (BlockManager, "_take_free_block"),
    (BlockManager, "allocate"),
    (BlockManager, "make_room"),
    (BlockManager, "make_room_for_all"),
    (BlockManager, "commit_computed"),
    (BlockManager, "free"),
    (Scheduler, "_preempt"),
    (Scheduler, "finish"),
    (Scheduler, "update_from_output"),
    (Scheduler, "schedule_ahead"),
    (Scheduler, "_prompt_chunks"),
]


class Interrupt(BaseException):
    pass


def interrupt_at(monkeypatch, cls, name: str, nth: int, after: bool) -> None:
    """Raise on the ``nth`` call of ``cls.name``, before or after it has done its work."""
    original, calls = getattr(cls, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth and not after:
            raise Interrupt
        out = original(*args, **kwargs)
        if calls[0] == nth and after:
            raise Interrupt
        return out

    monkeypatch.setattr(cls, name, wrapper)


def workload(h: Harness, rng: random.Random, n: int) -> None:
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    for _ in range(n):
        prompt = shared[: rng.randrange(0, 13)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 14))]
        h.add(prompt, max_tokens=rng.randrange(1, 12))


@pytest.mark.parametrize("mixed", [False, True], ids=["split", "mixed"])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("cls, name", POINTS, ids=[n for _, n in POINTS])
def test_interrupt_at_each_point_loses_nothing(monkeypatch, cls, name, after, mixed):
    interrupted = 0
    for nth in (1, 2, 3, 5, 8, 13, 21):
        with monkeypatch.context() as m:
            h = Harness(
                num_blocks=10,
                block_size=4,
                max_num_seqs=4,
                max_num_batched_tokens=12,
                max_model_len=36,
                mixed=mixed,
            )
            rng = random.Random(nth)
            workload(h, rng, 8)
            interrupt_at(m, cls, name, nth, after)
            try:
                h.run_async() if nth % 2 else h.run()
            except Interrupt:
                interrupted += 1
                h.sched.abort_all()
        assert h.bm.num_free_blocks == 10 and all(b.ref_count == 0 for b in h.bm.blocks)
        assert sorted(h.sched.free_slots) == [0, 1, 2, 3] and h.sched.is_finished()
        h.seqs, h.finished, h.row_tables = [], [], {}
        workload(h, rng, 6)
        h.run()
        h.check_done()
    assert interrupted > 0, f"no interrupt landed in {name}"
