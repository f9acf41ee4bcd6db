"""The progress bar's throughput: measured over windows, never from one overlapped step."""

import pytest

from nanovllm.engine.progress import WINDOW_S, ProgressBar


def test_rates_come_from_whole_windows_shared_by_both_kinds_of_work():
    bar = ProgressBar(total=4, enabled=False)
    bar.update(0, 1000, 0, 0.5)  # a prefill step of 1,000 tokens in 0.5 s
    assert bar.rates == {"prefill": 2000, "decode": 0}
    for _ in range(10):  # mixed steps: 40 prompt and 50 generated tokens in 0.1 s each
        bar.update(0, 40, 50, 0.1)
    assert bar.rates["decode"] == pytest.approx(500) and bar.rates["prefill"] == pytest.approx(400)
    bar.update(2, 0, 0, 1e-5)  # a step that only collects rows already finished
    bar.update(0, 0, 0, 1e-5)
    assert bar.rates["decode"] == pytest.approx(500)
    bar.close()


def test_a_run_shorter_than_a_window_still_gets_its_rate():
    bar = ProgressBar(total=1, enabled=False)
    bar.update(0, 30, 0, WINDOW_S / 10)
    bar.update(1, 0, 8, WINDOW_S / 4)
    assert bar.rates == {"prefill": 0.0, "decode": 0.0}
    bar.close()
    seconds = WINDOW_S / 10 + WINDOW_S / 4
    assert bar.rates == {"prefill": pytest.approx(30 / seconds), "decode": pytest.approx(8 / seconds)}
