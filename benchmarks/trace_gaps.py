"""Where the GPU waits between operations, read from a Chrome trace (torch.profiler's export).

    PYTHONPATH=. python3 benchmarks/trace_gaps.py TRACE.json [--top 15]

``profile_decode_step.py --chrome-trace PATH`` writes such a trace of the engine's own step loop.
Takes the device's operations (kernels, copies, fills), merges their time ranges (kernels that
overlap, as programmatic dependents do, count once) and prints the span, the busy time, the idle
time, and the idle time summed by the pair of operations on either side of each gap, largest
first: which launches leave the GPU waiting, e.g. the eager copies and sampling kernels around
a decode step's CUDA graph.
"""

import argparse
import json
from collections import defaultdict
from typing import NamedTuple

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_NAME_CHARS = 48


class DeviceOp(NamedTuple):
    start_us: float
    end_us: float
    name: str


class Gaps(NamedTuple):
    span_us: float
    busy_us: float
    idle_by_pair: dict[tuple[str, str], tuple[float, int]]
    """(operation before, operation after) -> (idle µs summed, gaps)."""


def device_ops(trace: dict) -> list[DeviceOp]:
    """The trace's device operations, by start time."""
    ops = [
        DeviceOp(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", "?"))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    return sorted(ops)


def find_gaps(ops: list[DeviceOp]) -> Gaps:
    """Busy time of the union of ``ops``' ranges, and each stretch with none of them running,
    named by the operation that ended last before it and the one that starts it."""
    if not ops:
        return Gaps(0.0, 0.0, {})
    idle: defaultdict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    busy, (start, end, last) = 0.0, ops[0]
    for op in ops[1:]:
        if op.start_us > end:
            busy += end - start
            entry = idle[(_short(last), _short(op.name))]
            entry[0] += op.start_us - end
            entry[1] += 1
            start, end, last = op
        elif op.end_us >= end:
            end, last = op.end_us, op.name
    busy += end - start
    span = max(op.end_us for op in ops) - ops[0].start_us
    return Gaps(span, busy, {pair: (us, int(n)) for pair, (us, n) in idle.items()})


def _short(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Chrome trace file (torch.profiler's export_chrome_trace)")
    parser.add_argument("--top", type=int, default=15, help="pairs of operations to list")
    args = parser.parse_args()
    with open(args.trace) as f:
        gaps = find_gaps(device_ops(json.load(f)))
    idle = gaps.span_us - gaps.busy_us
    print(f"span {gaps.span_us / 1e3:.3f} ms, busy {gaps.busy_us / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms")
    print(f"{'idle (us)':>10s} {'gaps':>5s}  before -> after")
    pairs = sorted(gaps.idle_by_pair.items(), key=lambda item: -item[1][0])
    for (before, after), (us, n) in pairs[: args.top]:
        print(f"{us:10.1f} {n:5d}  {before} -> {after}")


if __name__ == "__main__":
    main()
