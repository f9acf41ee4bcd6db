"""Decode graphs in halves for a test: the setting made, and the batch sizes run in halves recorded."""

from nanovllm.execution.decode_halves import DecodeHalves


def record_halves(monkeypatch, mode: str, min_rows: int) -> list[int]:
    """Sets ``NANOVLLM_DECODE_HALVES`` to ``mode`` from ``min_rows`` rows; the list returned gets
    the rows of every call the halves take."""
    monkeypatch.setenv("NANOVLLM_DECODE_HALVES", mode)
    monkeypatch.setenv("NANOVLLM_DECODE_HALVES_MIN_ROWS", str(min_rows))
    sizes, call = [], DecodeHalves.__call__

    def recorded(self, input_ids, *args):
        sizes.append(len(input_ids))
        return call(self, input_ids, *args)

    monkeypatch.setattr(DecodeHalves, "__call__", recorded)
    return sizes
