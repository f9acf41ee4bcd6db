"""benchmarks/trace_gaps.py on a hand-made Chrome trace."""

import json
import subprocess
import sys

from benchmarks.trace_gaps import device_ops, find_gaps


def event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


TRACE = {
    "traceEvents": [
        event("a", 0, 10),
        event("b", 5, 7),  # overlaps a (a programmatic dependent): 0-12 busy
        event("inside b", 6, 1),
        event("copy", 15, 5, "gpu_memcpy"),  # 3 µs after b
        event("c", 20, 5),  # touches the copy: no gap
        event("launch c", 19, 30, "cuda_runtime"),  # a host event: not the device's
        event("fill", 30, 1, "gpu_memset"),  # 5 µs after c
        event("b", 34, 1),
        event("copy", 38, 2, "gpu_memcpy"),  # b -> copy again: 3 µs more
        {"ph": "i", "name": "marker", "ts": 3},
    ]
}


def test_gaps_are_the_stretches_with_no_device_operation() -> None:
    ops = device_ops(TRACE)
    assert [op.name for op in ops] == ["a", "b", "inside b", "copy", "c", "fill", "b", "copy"]
    gaps = find_gaps(ops)
    assert gaps.span_us == 40
    assert gaps.busy_us == 12 + 10 + 1 + 1 + 2
    assert gaps.idle_by_pair == {("b", "copy"): (3 + 3, 2), ("c", "fill"): (5, 1), ("fill", "b"): (3, 1)}
    assert find_gaps([]).busy_us == 0


def test_the_command_line_prints_the_largest_gaps_first(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_gaps", str(path), "--top", "2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "span 0.040 ms, busy 0.026 ms, idle 0.014 ms"
    assert [line.split()[-3:] for line in out[2:]] == [["b", "->", "copy"], ["c", "->", "fill"]]
