"""A decode step's rows as two halves on two CUDA streams, against the whole batch on one (CUDA).

    PYTHONPATH=. python3 benchmarks/bench_two_streams.py [--shape qwen3-0.6b] [--batch 256] [--context 1024]

At the 0.6B shape a 256-row decode step's GEMMs are bound by launch latency (7-10 µs each,
whatever the rows: ``bench_gemm.py``) and its attention by memory bandwidth. Run as two
independent halves on two streams, one half's GEMMs may run while the other's attention streams
K/V, at the cost of reading every weight twice. This probe starts an engine with ``--batch``
sequences of ``--context`` tokens, plans a real decode step, and times CUDA graphs of the model's
forward over its rows: the whole batch on one stream, the two halves one after the other, and
:class:`DecodeHalves` in each of its modes. The halves' hidden states are checked against the
whole batch's first. (On an H100 the best mode gained 2% at the 0.6B's 256 rows of 1,024 tokens
and lost end to end, and lost 10-12% at the 8B's 512-625 rows: ``benchmarks/MEASUREMENTS.md``. The
engine takes a mode with ``NANOVLLM_DECODE_HALVES``, off by default.)
"""

import argparse
import tempfile

import torch

from benchmarks.cuda_graphs import capture, replay_ms
from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import SHAPES, write_config
from nanovllm.execution.decode_halves import MODES, DecodeHalves, rows_of


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    path = tempfile.mkdtemp()
    write_config(path, args.shape)
    llm = LLM(path, load_format="dummy", max_model_len=4096, async_scheduling=False)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=10_000)
    for i in range(args.batch):
        llm.add_request([(i * 7 + j) % 10000 for j in range(args.context)], params)
    sched, runner = llm.scheduler, llm.executor.runner
    while not (step := sched.schedule()).batch.is_decode:  # every prompt's K/V in the cache
        llm.output_processor.process(step, runner.run(step.batch))
    inputs = runner.inputs.build(step.batch)
    inputs.resolve(runner.last_sampled, runner.inputs.slot_table.block_tables.device)  # block tables
    n, half = len(step.batch), len(step.batch) // 2
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")  # the tokens do not change the time
    pos, meta, model = inputs.positions, inputs.meta, runner.model
    out = {}

    def whole():
        out["whole"] = model(ids, pos, meta)

    def serial():
        out["halves"] = torch.cat(
            [model(ids[a:b], pos[a:b], rows_of(meta, a, b)) for a, b in ((0, half), (half, n))]
        )

    def halves(mode: str):
        overlapped = DecodeHalves(model, mode)

        def run():
            out["halves"] = overlapped(ids, pos, meta)

        return run

    with torch.inference_mode():
        graphs, outputs = {}, {}  # each graph's output tensors, which its replays overwrite
        variants = [("whole batch, one stream", whole), ("two halves, one stream", serial)]
        variants += [(f"two halves, {mode}", halves(mode)) for mode in MODES[1:]]
        for name, fn in variants:
            graphs[name] = capture(fn)
            outputs[name] = dict(out)
        for graph in graphs.values():  # captured, not yet run
            graph.replay()
        torch.cuda.synchronize()
        # the halves' GEMMs may take other cuBLAS algorithms than the whole batch's, so bf16 rounds
        # differently over the layers; the streams must not change what the halves compute
        whole_out = outputs["whole batch, one stream"]["whole"].float()
        serial_out = outputs["two halves, one stream"]["halves"].float()
        err = (serial_out - whole_out).abs().max().item()
        if err > 0.1 * whole_out.abs().max().item():
            raise AssertionError(f"the halves differ from the whole batch by {err:.3g}")
        for name in list(graphs)[2:]:
            err = (outputs[name]["halves"].float() - serial_out).abs().max().item()
            if err > 1e-3 * serial_out.abs().max().item():
                raise AssertionError(f"{name}: the halves differ from the halves on one stream by {err:.3g}")
        print(f"{torch.cuda.get_device_name()}, {args.shape}, {n} rows, context ~{args.context}")
        for name, graph in graphs.items():
            print(f"  {name:32s} {replay_ms(graph, args.reps):.3f} ms", flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
