"""Where ``LLM()`` spends its start-up, below the runner's phases: the functions that take the time.

    PYTHONPATH=. python3 benchmarks/profile_startup.py [--shape qwen3-8b] [--top 40] [--engines 2]

Builds ``--engines`` engines one after another in this process, each on random weights of
``--shape`` as ``bench.py`` builds them, the first under nothing, the last under ``cProfile``
(a later engine is the "second start": imports done, kernel caches warm). Prints each start-up
with the runner's phases and "other" (the engine around the runner), then the profiled start's
functions by cumulative time and by own time. The profiler adds its own overhead to Python-heavy
parts (tens of percent), not to time spent waiting on the device or in C++.
On CPU it runs too (a dry run: no profile, warm-up or graph phases there).
"""

import argparse
import cProfile
import pstats
import tempfile
import time

from benchmarks.engines import startup_line
from nanovllm import LLM
from nanovllm.demo_models import SHAPES, write_config


def start(path: str, profiler: cProfile.Profile | None) -> LLM:
    began = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    llm = LLM(path, load_format="dummy", max_model_len=4096)
    if profiler is not None:
        profiler.disable()
    print(f"start-up {startup_line(time.perf_counter() - began, llm, 2)}", flush=True)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--engines", type=int, default=2, help="engines built; the last is profiled")
    parser.add_argument("--top", type=int, default=40, help="functions listed")
    args = parser.parse_args()
    if args.engines < 1:
        parser.error("--engines must be at least 1")
    path = tempfile.mkdtemp()
    write_config(path, args.shape)
    profiler = cProfile.Profile()
    for i in range(args.engines):
        last = i == args.engines - 1
        llm = start(path, profiler if last else None)
        llm.exit()
        del llm
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
