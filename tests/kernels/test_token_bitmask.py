"""The token bitmask kernel vs its torch reference (interpreter on CPU, compiled on CUDA), and
the reference vs a per-token loop over xgrammar's layout."""

import pytest
import torch

from nanovllm.kernels import token_bitmask as kb
from tests.interpreter import DEVICE

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_bitmask(num_rows: int, num_words: int, gen: torch.Generator) -> torch.Tensor:
    """Random int32 words, with all-zero, all-one, bit-31-only and all-but-bit-31 words mixed in."""
    words = torch.randint(-(2**31), 2**31, (num_rows, num_words), generator=gen).to(torch.int32)
    special = torch.tensor([0, -1, -(2**31), 2**31 - 1], dtype=torch.int32)
    pick = torch.randint(0, 8, (num_rows, num_words), generator=gen)  # half the words stay random
    return torch.where(pick < 4, special[pick.clamp(max=3)], words)


def check_against_reference(total_rows, vocab, rows, num_words, dtype, device, seed=0):
    """Rows ``rows`` of a strided view of ``[total_rows, vocab]`` logits: kernel == reference,
    and every other row untouched."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(total_rows, vocab + 7, generator=gen).to(dtype).to(device)
    logits = wide[:, 3 : 3 + vocab]  # a row stride of vocab + 7
    bitmask = random_bitmask(len(rows), num_words, gen).to(device)
    rows = torch.tensor(rows, dtype=torch.int64, device=device)
    want = wide.clone()
    kb.apply_token_bitmask_ref(want[:, 3 : 3 + vocab], bitmask, rows)
    before = wide.clone()
    kb.apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(wide, want)
    changed = (wide != before).any(dim=1).cpu()
    assert set(changed.nonzero().flatten().tolist()) <= set(rows.tolist())
    assert changed.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [31, 1000, 4096 + 33])
def test_kernel_matches_reference(dtype, vocab):
    num_words = (vocab + 31) // 32
    check_against_reference(9, vocab, [7, 2, 5, 0], num_words, dtype, DEVICE, seed=vocab)


def test_kernel_matches_reference_at_a_full_vocabulary():
    check_against_reference(5, 151936, [3, 1], 151936 // 32, torch.bfloat16, DEVICE)


@pytest.mark.parametrize("num_words", [0, 10, 40])  # 1000 tokens take 32 words
def test_bitmask_shorter_or_longer_than_the_vocabulary(num_words):
    check_against_reference(4, 1000, [2, 0, 3], num_words, torch.float32, DEVICE, seed=num_words)


def test_int32_rows_and_no_rows():
    logits = torch.randn(4, 100, device=DEVICE)
    bitmask = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    bitmask[0, 0], bitmask[1, 3] = 1, -(2**31)  # token 0 in row 3; token 127 (past the vocab) in row 1
    want = logits.clone()
    want[3, 1:] = want[1, :] = float("-inf")
    kb.apply_token_bitmask_(logits, bitmask, torch.tensor([3, 1], dtype=torch.int32, device=DEVICE))
    assert torch.equal(logits, want)
    empty = torch.zeros(0, 4, dtype=torch.int32, device=DEVICE)
    kb.apply_token_bitmask_(logits, empty, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    kb.apply_token_bitmask_ref(logits, empty, torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, want)


def test_bad_inputs():
    bitmask = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        kb.apply_token_bitmask_(torch.zeros(8, 4, device=DEVICE).t(), bitmask, rows)
    with pytest.raises(ValueError, match="int32"):
        kb.apply_token_bitmask_(torch.zeros(2, 4, device=DEVICE), bitmask.long(), rows)
    with pytest.raises(ValueError, match="one row per entry"):
        kb.apply_token_bitmask_(torch.zeros(2, 4, device=DEVICE), bitmask, rows.repeat(2))


@pytest.mark.parametrize("vocab", [31, 70, 100])
def test_reference_is_a_per_token_loop(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    num_words = 3  # 96 tokens: short of 100, past 31 and 70
    bitmask = random_bitmask(3, num_words, gen)
    rows = [4, 0, 2]
    want = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF if t // 32 < num_words else 0
            if not (word >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    kb.apply_token_bitmask_ref(logits, bitmask, torch.tensor(rows))
    assert torch.equal(logits, want)
    assert (want[[1, 3]] > float("-inf")).all()


def test_dispatch_takes_the_reference_off_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(kb, "apply_token_bitmask_ref", lambda *args: calls.append("ref"))
    monkeypatch.setattr(kb, "apply_token_bitmask_", lambda *args: calls.append("triton"))
    args = torch.zeros(1, 32, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    kb.apply_token_bitmask_dispatch_(torch.zeros(2, 32), *args)
    assert calls == ["ref"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_kernel_matches_reference_on_cuda(dtype):
    rows = torch.randperm(256, generator=torch.Generator().manual_seed(1))[:200].tolist()
    check_against_reference(256, 151936, rows, 151936 // 32, dtype, "cuda")
    few = torch.randperm(64, generator=torch.Generator().manual_seed(2))[:50].tolist()
    check_against_reference(64, 151665, few, 4740, dtype, "cuda")  # vocab past the bitmask


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_upload_filled_in_place_or_copied(device):
    """``BitmaskUpload.apply`` masks the same rows whether the bitmask was written into its own
    (pinned, on CUDA) buffer or comes as a separate array, step after step."""
    import numpy as np

    from nanovllm.execution.token_bitmask import BitmaskUpload

    vocab, rows = 1000, [3, 0, 5]
    upload = BitmaskUpload(torch.device(device), max_rows=8, vocab_size=vocab)
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        bitmask = random_bitmask(len(rows), upload.num_words, gen)
        logits = torch.randn(8, vocab, generator=gen)
        want = logits.clone()
        kb.apply_token_bitmask_ref(want, bitmask, torch.tensor(rows))
        if step % 2:
            got = logits.to(device)
            upload.apply(got, rows, bitmask.numpy().copy())
        else:
            view = upload.host_rows_view(len(rows))
            view[:] = bitmask.numpy()
            got = logits.to(device)
            upload.apply(got, rows, view)
        assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="at most 8"):
        upload.host_rows_view(9)
    with pytest.raises(ValueError, match="int32"):
        upload.apply(logits, rows, np.zeros((3, upload.num_words), dtype=np.int64))
