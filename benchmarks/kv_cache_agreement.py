"""Greedy tokens with an FP8 KV cache against the same model with a cache in its own dtype.

    PYTHONPATH=. python3 benchmarks/kv_cache_agreement.py [--model DIR] [--dtype bfloat16]

Without ``--model`` it builds the tests' random Qwen3 checkpoint (``tests/checkpoints.py``,
seed 0) and runs the tests' seven prompts. Prints the share of greedy tokens equal position by
position, and how many tokens each completion keeps before it first differs. On a
random-weight model the logits are nearly flat, so any rounding flips greedy picks: there the
figures bound the agreement from below rather than measure what a trained model would show.
"""

import argparse
import random
import tempfile

from tests.checkpoints import make_random_checkpoint  # (first: on CPU it sets Triton's interpreter up)


def greedy(model: str, prompts: list[list[int]], max_tokens: int, **options) -> list[list[int]]:
    from nanovllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    with LLM(model, max_model_len=1024, **options) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a model folder (default: the tests' random Qwen3)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    model = args.model
    if model is None:
        model = make_random_checkpoint(tempfile.mkdtemp(prefix="nanovllm-agreement-"), seed=0)
    rng = random.Random(0)  # the tests' prompts (tests/conftest.py)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 16, 17, 40, 63, 100)]
    options = dict(dtype=args.dtype, device=args.device)
    reference = greedy(model, prompts, args.max_tokens, **options)
    fp8 = greedy(model, prompts, args.max_tokens, kv_cache_dtype="fp8", **options)
    same = sum(a == b for x, y in zip(fp8, reference) for a, b in zip(x, y))
    total = sum(map(len, reference))
    kept = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y)) for x, y in zip(fp8, reference)]
    print(f"{args.dtype} model, fp8 cache against a {args.dtype} cache: {same}/{total} greedy tokens equal")
    print(f"({100 * same / total:.0f}%); tokens before the first difference, per prompt: {kept}")


if __name__ == "__main__":
    main()
