"""Batch inference over a JSONL file of prompts with nanovllm replicas on Ray Data.

    python examples/ray_batch.py                          # a small demo model, local Ray, 2 replicas
    python examples/ray_batch.py --model /path/to/Qwen3-0.6B --input prompts.jsonl --output out/

Each input line is ``{"prompt": "..."}`` (other fields are carried through); each output line
adds ``generated_text`` and ``generated_token_ids``. On one machine Ray starts locally. On a
cluster, change two lines: ``ray.init(address="auto")`` (join the cluster) and put ``--input``
/ ``--output`` on storage every node reads (``s3://...``, a shared filesystem); each replica
then runs wherever Ray finds ``--gpus-per-replica`` free GPUs.
"""

import argparse
import json
import os
import tempfile

import ray

from nanovllm import SamplingParams
from nanovllm.demo_models import write_demo_model
from nanovllm.replicas import LLMPredictor


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Hugging Face model folder (default: a small random demo model)")
    parser.add_argument("--input", help="JSONL of prompts (default: a few demo prompts)")
    parser.add_argument("--output", default="ray_batch_output", help="folder for the JSONL results")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--gpus-per-replica", type=float, default=0, help="0: run on CPU")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    scratch = tempfile.mkdtemp(prefix="nanovllm-ray-")
    model = args.model or write_demo_model(os.path.join(scratch, "model"))
    source = args.input or os.path.join(scratch, "prompts.jsonl")
    if not args.input:
        with open(source, "w") as f:
            prompts = ["introduce yourself", "list all prime numbers within 100", "Hello, Nano-vLLM."]
            for prompt in prompts * 4:
                f.write(json.dumps({"prompt": prompt}) + "\n")
    options = dict(max_model_len=1024)
    if args.gpus_per_replica == 0:
        options.update(device="cpu", dtype="float32")
    if not args.model:
        options["load_format"] = "dummy"

    ray.init()  # on a cluster: ray.init(address="auto")
    params = SamplingParams(0.6, args.max_tokens)
    ds = ray.data.read_json(source).map_batches(
        LLMPredictor,
        fn_constructor_kwargs=dict(model=model, sampling_params=params, **options),
        concurrency=args.replicas,
        num_gpus=args.gpus_per_replica,
        # on CPU, leave Ray Data slots for reading and writing even on a 2-core machine
        num_cpus=1 if args.gpus_per_replica else 0.5,
        batch_size=64,
    )
    ds.write_json(args.output)
    lines = sum(len(open(os.path.join(args.output, f)).readlines()) for f in os.listdir(args.output))
    print(f"wrote {lines} completions to {args.output}/")


if __name__ == "__main__":
    main()
