"""Generate completions with nanovllm.

python example.py                      # ~/huggingface/Qwen3-0.6B, or a small demo model
python example.py --model /path/to/Qwen3-0.6B
"""

import argparse
import os
import tempfile

from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import write_demo_model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="~/huggingface/Qwen3-0.6B", help="Hugging Face model folder")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
    args = parser.parse_args()

    path = os.path.expanduser(args.model)
    if os.path.isdir(path):
        run(path, args, demo=False)
        return
    print(f"{path} does not exist: running on a small generated demo model with RANDOM weights,")
    print("so the completions below are gibberish. Pass --model DIR for a real model.\n")
    with tempfile.TemporaryDirectory(prefix="nanovllm-demo-") as demo_dir:
        run(write_demo_model(demo_dir), args, demo=True)


def run(path: str, args: argparse.Namespace, demo: bool) -> None:
    llm = LLM(
        path,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=1,
        max_model_len=1024,
        load_format="dummy" if demo else "auto",
    )
    try:
        sampling_params = SamplingParams(temperature=0.6, max_tokens=args.max_tokens)
        questions = ["introduce yourself", "list all prime numbers within 100"]
        if llm.get_tokenizer().chat_template:
            outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], sampling_params)
        else:
            outputs = llm.generate(questions, sampling_params)
        for output in outputs:
            print(f"\nPrompt: {output.prompt!r}\nCompletion: {output.outputs[0].text!r}")
    finally:
        llm.exit()


if __name__ == "__main__":
    main()
