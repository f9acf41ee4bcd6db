"""A decode step's rows as two halves on two CUDA streams, against the whole batch on one (CUDA).

    PYTHONPATH=. python3 benchmarks/bench_two_streams.py [--shape qwen3-0.6b] [--batch 256] [--context 1024]

At the 0.6B shape a 256-row decode step's GEMMs are bound by launch latency (7-10 µs each,
whatever the rows: ``bench_gemm.py``) and its attention by memory bandwidth. Run as two
independent halves on two streams, one half's GEMMs may run while the other's attention streams
K/V, at the cost of reading every weight twice. This probe starts an engine with ``--batch``
sequences of ``--context`` tokens, plans a real decode step, and times CUDA graphs of the model's
forward over its rows: the whole batch on one stream, the two halves one after the other, and
:class:`DecodeHalves` in each of its modes. The halves' hidden states are checked against the
whole batch's first. (On an H100 the best mode gained 2% at 256 rows of 1,024 tokens and lost
end to end, so the engine runs the whole batch: ``benchmarks/MEASUREMENTS.md``.)
"""

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import fields, replace

import torch

from benchmarks.cuda_graphs import capture, replay_ms
from nanovllm import LLM, SamplingParams
from nanovllm.attention import AttentionMetadata
from nanovllm.demo_models import SHAPES, write_config
from nanovllm.layers.attention import Attention

DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
MODES = ("high", "offset-high", "attention-low")
_HIGHEST = -8  # torch clamps a stream priority to the device's range


def rows_of(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """Rows ``start:end`` of a decode batch's metadata as a batch of their own, without a row
    order (the whole batch's names rows outside them). Every tensor field of a decode batch holds
    one row per sequence, as :meth:`AttentionMetadata.first_rows` cuts them too."""
    tensors = [f.name for f in fields(meta) if isinstance(getattr(meta, f.name), torch.Tensor)]
    sliced = {name: getattr(meta, name)[start:end] for name in tensors}
    return replace(meta, **(sliced | {"decode_order": None}))


class DecodeHalves:
    """``forward`` over a decode batch's rows ``[0, n/2)`` and ``[n/2, n)`` on two streams, each
    half's attention over its rows longest context first; hooks on ``attentions`` (the model's
    attention layers, first to last) are set for the call only. ``mode``: ``high``: the second
    half on a high-priority stream from the start; ``offset-high``: so, from the first half's
    first attention on (one half's attention meets the other's GEMMs, not its attention);
    ``attention-low``: offset, and every kernel but attention on high-priority streams, so that
    SMs the attention frees go to the other half's GEMMs first."""

    def __init__(self, forward: DecodeForward, attentions: list[Attention], mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.forward, self.attentions, self.mode = forward, attentions, mode
        self.streams = [torch.cuda.Stream(priority=_HIGHEST) for _ in range(2)]
        self.attention_streams = {s: torch.cuda.Stream() for s in self.streams}  # default: lowest
        self.at_first_attention = torch.cuda.Event()

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        main = torch.cuda.current_stream()
        first = self.streams[0] if self.mode == "attention-low" else main
        second = self.streams[1]
        hooks = [self.attentions[0].register_forward_pre_hook(lambda *_: self.at_first_attention.record())]
        if self.mode == "attention-low":
            for layer in self.attentions:
                hooks.append(layer.register_forward_pre_hook(self._to_attention_stream))
                hooks.append(layer.register_forward_hook(self._back_from_attention_stream))
        halves = []
        for start, end in ((0, n // 2), (n // 2, n)):
            half = rows_of(meta, start, end)
            half.decode_order = torch.argsort(half.context_lens, descending=True, stable=True).int()
            halves.append((input_ids[start:end], positions[start:end], half))
        for stream in {first, second} - {main}:
            stream.wait_stream(main)
        try:
            with torch.cuda.stream(first):
                out_first = self.forward(*halves[0])
            hooks.pop(0).remove()
            if self.mode != "high":
                second.wait_event(self.at_first_attention)
            with torch.cuda.stream(second):
                out_second = self.forward(*halves[1])
        finally:
            for hook in hooks:
                hook.remove()
        for stream in {first, second} - {main}:
            main.wait_stream(stream)
        return torch.cat((out_first, out_second))

    def _to_attention_stream(self, *_) -> None:
        here = torch.cuda.current_stream()
        there = self.attention_streams[here]
        there.wait_stream(here)
        torch.cuda.set_stream(there)

    def _back_from_attention_stream(self, *_) -> None:
        there = torch.cuda.current_stream()
        here = next(s for s, a in self.attention_streams.items() if a == there)
        here.wait_stream(there)
        torch.cuda.set_stream(here)


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
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    out = {}

    def whole():
        out["whole"] = model(ids, pos, meta)

    def serial():
        out["halves"] = torch.cat(
            [model(ids[a:b], pos[a:b], rows_of(meta, a, b)) for a, b in ((0, half), (half, n))]
        )

    def halves(mode: str):
        overlapped = DecodeHalves(model, attentions, mode)

        def run():
            out["halves"] = overlapped(ids, pos, meta)

        return run

    with torch.inference_mode():
        graphs, outputs = {}, {}  # each graph's output tensors, which its replays overwrite
        variants = [("whole batch, one stream", whole), ("two halves, one stream", serial)]
        variants += [(f"two halves, {mode}", halves(mode)) for mode in MODES]
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
