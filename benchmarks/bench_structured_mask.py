"""What a structured-output step's token bitmask costs, per step of ``--rows`` constrained rows.

    PYTHONPATH=. python benchmarks/bench_structured_mask.py [--rows 256] [--threads 8]

With the bench's JSON schema (``benchmarks/structured_workload.py``) and the byte-level tokenizer that fills
Qwen3's 151,936 logits (``write_large_tokenizer``): each row's matcher is first walked a random
number of tokens into the record (random allowed tokens), then the medians of
- the host fill of every row's bitmask (``StructuredOutputs.bitmask``, xgrammar's batch fill);
- on CUDA, its upload and the masking kernel over ``[rows, 151,936]`` bf16 logits.
"""

import argparse
import random
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoTokenizer

from benchmarks.structured_workload import JSON_SCHEMA
from nanovllm.demo_models import SHAPES, write_large_tokenizer
from nanovllm.engine.structured_outputs import StructuredOutputs
from nanovllm.execution.token_bitmask import BitmaskUpload
from nanovllm.sampling_params import StructuredOutputsParams


def allowed_tokens(bitmask_row: np.ndarray, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-walk", type=int, default=80, help="tokens each matcher is walked, at most")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    vocab = SHAPES["qwen3-0.6b"]["vocab_size"]
    path = tempfile.mkdtemp(prefix="nanovllm-mask-")
    eos = write_large_tokenizer(path, vocab)
    structured = StructuredOutputs(AutoTokenizer.from_pretrained(path), vocab, (eos,))
    start = time.perf_counter()
    compiled = structured.compile(StructuredOutputsParams(json=JSON_SCHEMA))
    compiled.result()
    print(f"schema compiled in {time.perf_counter() - start:.2f} s")
    rng = random.Random(0)
    seqs = [SimpleNamespace(seq_id=i) for i in range(args.rows)]
    one = np.empty((1, structured.num_words), dtype=np.int32)
    for seq in seqs:
        structured.track(seq.seq_id, compiled)
        matcher = structured.matchers[seq.seq_id]
        for _ in range(rng.randrange(args.max_walk)):
            matcher.matcher().fill_next_token_bitmask(one, 0)
            choices = allowed_tokens(one[0], vocab)
            choices = choices[choices != eos]
            if not len(choices):
                break
            matcher.accept(int(choices[rng.randrange(len(choices))]))
    step = SimpleNamespace(seqs=seqs, batch=SimpleNamespace(structured_rows=list(range(args.rows))))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    upload = BitmaskUpload(device, args.rows, vocab)
    fills = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        bitmask = structured.bitmask(step, upload.host_rows_view(args.rows))  # as the engine fills it
        fills.append(time.perf_counter() - start)
    print(f"host fill, {args.rows} rows, into the upload's buffer: {statistics.median(fills) * 1e3:.2f} ms")
    if torch.cuda.is_available():
        logits = torch.randn(args.rows, vocab, device=device, dtype=torch.bfloat16)
        rows = list(range(args.rows))
        times = []
        for _ in range(args.repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            upload.apply(logits, rows, bitmask)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        ms = statistics.median(times)
        print(f"upload + masking kernel, {args.rows} x {vocab} bf16 logits: {ms:.3f} ms")
    structured.close()


if __name__ == "__main__":
    main()
