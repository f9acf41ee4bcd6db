"""A decode step's rows as two halves on two CUDA streams, against the whole batch on one (CUDA).

    PYTHONPATH=. python3 benchmarks/bench_two_streams.py [--shape qwen3-0.6b] [--batch 256] [--context 1024]

At the 0.6B shape a 256-row decode step's GEMMs are bound by launch latency (7-10 µs each,
whatever the rows: ``bench_gemm.py``) and its attention by memory bandwidth. Run as two
independent halves on two streams, one half's GEMMs may run while the other's attention streams
K/V, at the cost of reading every weight twice. This probe asks whether that pays before the
engine is built for it: it starts an engine with ``--batch`` sequences of ``--context`` tokens,
plans a real decode step, and times CUDA graphs of the model's forward over its rows: the whole
batch on one stream, the two halves one after the other, and the two halves forked onto two
streams, the second either from the start or from the moment the first reaches its first
attention (so that one half's attention meets the other's GEMMs rather than its attention). The
halves' hidden states are checked against the whole batch's first.
"""

import argparse
import tempfile
from dataclasses import fields, replace

import torch

from benchmarks.cuda_graphs import capture, replay_ms
from nanovllm import LLM, SamplingParams
from nanovllm.attention import AttentionMetadata
from nanovllm.demo_models import SHAPES, write_config


def rows_of(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
    """Rows ``start:end`` of a decode batch's metadata (its per-row tensors sliced), run as a batch
    of their own (no row order: the whole batch's names rows outside the slice)."""
    rows = meta.context_lens.shape[0]
    sliced = {
        f.name: value[start:end]
        for f in fields(meta)
        if isinstance(value := getattr(meta, f.name), torch.Tensor) and value.shape[0] == rows
    }
    return replace(meta, **(sliced | {"decode_order": None}))


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
    n, half = len(step.batch), len(step.batch) // 2
    ids = torch.zeros(n, dtype=torch.int64, device="cuda")  # the tokens do not change the time
    pos, meta, model = inputs.positions, inputs.meta, runner.model
    side = torch.cuda.Stream()
    high = [torch.cuda.Stream(priority=-8) for _ in range(2)]  # clamped to the highest there is
    low = {h: torch.cuda.Stream() for h in high}  # the default priority is the lowest
    attentions = [layer.self_attn.attn for layer in runner.model.model.layers]
    at_attention = torch.cuda.Event()
    out = {}

    def whole():
        out["whole"] = model(ids, pos, meta)

    def attention_on_low(module):
        """``module``'s forward run on the low-priority stream paired with the current one."""
        forward = module.forward

        def run(*args, **kwargs):
            here = torch.cuda.current_stream()
            there = low[here]
            there.wait_stream(here)
            with torch.cuda.stream(there):
                o = forward(*args, **kwargs)
            here.wait_stream(there)
            return o

        return run

    def halves(mode: str):
        """``serial``: one after the other; ``parallel``: on two streams at once; ``high``: so, the
        second on a high-priority stream; ``offset``: the second from the first's first attention
        on; ``offset-high``: so, the second on a high-priority stream; ``attention-low``: offset,
        each half's attention at low priority and the rest at high."""

        def run():
            a = (ids[:half], pos[:half], rows_of(meta, 0, half))
            b = (ids[half:], pos[half:], rows_of(meta, half, n))
            if mode == "serial":
                out["a"], out["b"] = model(*a), model(*b)
                return
            main = torch.cuda.current_stream()
            first = high[0] if mode == "attention-low" else main
            second = {"parallel": side, "offset": side}.get(mode, high[1])
            for s in (first, second):
                s.wait_stream(main)
            hooks = [attentions[0].register_forward_pre_hook(lambda *_: at_attention.record())]
            if mode == "attention-low":
                for m in attentions:
                    m.forward = attention_on_low(m)
            with torch.cuda.stream(first):
                out["a"] = model(*a)
            for h in hooks:
                h.remove()
            if mode.startswith("offset") or mode == "attention-low":
                second.wait_event(at_attention)
            with torch.cuda.stream(second):
                out["b"] = model(*b)
            for m in attentions:
                m.__dict__.pop("forward", None)
            for s in (first, second):
                main.wait_stream(s)

        return run

    with torch.inference_mode():
        graphs, outputs = {}, {}  # each graph's output tensors, which its replays overwrite
        for name, fn in [("whole batch, one stream", whole)] + [
            (f"two halves, {mode}", halves(mode))
            for mode in ("serial", "parallel", "high", "offset", "offset-high", "attention-low")
        ]:
            graphs[name] = capture(fn)
            outputs[name] = dict(out)
        graphs["whole batch, one stream"].replay()  # captured, not yet run
        whole_out = outputs["whole batch, one stream"]["whole"].float()
        for name in list(graphs)[1:]:
            graphs[name].replay()
            torch.cuda.synchronize()
            err = (torch.cat((outputs[name]["a"], outputs[name]["b"])).float() - whole_out).abs().max().item()
            scale = whole_out.abs().max().item()
            if err > 2e-2 * scale:
                raise AssertionError(f"{name}: the halves differ from the whole batch by {err:.3g}")
        print(f"{torch.cuda.get_device_name()}, {args.shape}, {n} rows, context ~{args.context}")
        for name, graph in graphs.items():
            print(f"  {name:32s} {replay_ms(graph, args.reps):.3f} ms", flush=True)
    llm.exit()


if __name__ == "__main__":
    main()
