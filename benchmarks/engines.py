"""How bench.py drives each engine: nanovllm, vLLM and HF transformers, on the throughput
workload (``ENGINES``) and in latency mode (``LATENCY_ENGINES``), each returning its result row's
figures. The engines are imported inside, so that a process loads only the one it runs."""

import os
import time

from benchmarks.latency import measure_latency
from benchmarks.structured_workload import JSON_SCHEMA


def given_options(args, *names: str) -> dict:
    """The named engine options the command line sets (the rest keep each engine's default)."""
    return {name: getattr(args, name) for name in names if getattr(args, name)}


def workload_params(args, params_cls, constraint_cls, max_tokens: list[int]) -> list:
    """Each request's sampling parameters (``params_cls``: the engine's ``SamplingParams``,
    ``constraint_cls``: its ``StructuredOutputsParams``)."""
    if args.structured == "json":
        return [
            params_cls(
                temperature=0.6,
                max_tokens=n,
                detokenize=False,
                structured_outputs=constraint_cls(json=JSON_SCHEMA),
            )
            for n in max_tokens
        ]
    plain = {"detokenize": False} if args.tokenizer else {}
    return [params_cls(temperature=0.6, ignore_eos=True, max_tokens=n, **plain) for n in max_tokens]


def completions(outputs) -> list[tuple[str | None, list[int]]]:
    """(finish reason, token ids) of each request's completion (nanovllm's and vLLM's outputs)."""
    return [(o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in outputs]


def make_nanovllm(args, path, dummy, max_model_len: int):
    from nanovllm import LLM

    start = time.perf_counter()
    llm = LLM(
        path,
        load_format="dummy" if dummy else "auto",
        enforce_eager=args.enforce_eager,
        max_model_len=max_model_len,
        tensor_parallel_size=args.tp,
        attention_backend=args.attention_backend,
        async_scheduling=args.async_scheduling,
        mixed_steps=args.mixed_steps,
        kv_cache_dtype=args.kv_cache_dtype,
        **given_options(args, "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size", "quantization"),
    )
    print(f"nanovllm start-up: {startup_line(time.perf_counter() - start, llm, 1)}", flush=True)
    return llm


def startup_line(seconds: float, llm, digits: int) -> str:
    """``seconds`` of start-up with the runner's phases and "other" (the engine around the
    runner: config, tokenizer, scheduler)."""
    phases = llm.executor.startup_seconds
    listed = ", ".join(f"{name} {s:.{digits}f}" for name, s in phases.items())
    return f"{seconds:.{digits}f} s ({listed}, other {seconds - sum(phases.values()):.{digits}f})"


def run_nanovllm(args, path, dummy, runs_prompts, max_tokens) -> dict:
    from nanovllm import SamplingParams
    from nanovllm.sampling_params import StructuredOutputsParams

    llm = make_nanovllm(args, path, dummy, 4096)
    params = workload_params(args, SamplingParams, StructuredOutputsParams, max_tokens)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)
    if args.structured == "json":
        warm_up = workload_params(args, SamplingParams, StructuredOutputsParams, [16])
        llm.generate([[1, 2, 3, 4]], warm_up, use_tqdm=False)
    times, tokens, outputs = [], [], []
    for prompts in runs_prompts:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    llm.exit()
    return {"times": times, "tokens": tokens, "completions": completions(outputs)}


def refill_like_nanovllm(model) -> None:
    """Refill a vLLM model's random weights with nanovllm's recipe (``init_dummy_weights``: uniform
    in +-0.05, norms and FP8 scales at 1), so that both engines run the same kind of random model.

    vLLM's own (uniform in +-1e-3, norms too) leaves a mixture of experts' router with logits so
    close that its steps read a handful of experts: at the Qwen3-30B-A3B shape, 256 decode rows'
    experts took 1.7 ms a step against 13 ms with routing spread over all 128."""
    from nanovllm.execution.loader import init_dummy_weights

    for name, param in model.named_parameters():
        if "scale" in name:
            param.derived = True  # filled with 1, as nanovllm's derived FP8 scales
    init_dummy_weights(model)


def make_vllm(args, path, dummy, max_model_len: int):
    if dummy:  # refill_like_nanovllm goes to vLLM's engine process pickled
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        path,
        load_format="dummy" if dummy else "auto",
        skip_tokenizer_init=dummy and not args.tokenizer,  # structured outputs need the tokenizer
        max_model_len=max_model_len,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype,
        **given_options(args, "max_num_seqs", "max_num_batched_tokens", "quantization"),
    )
    if dummy:
        llm.apply_model(refill_like_nanovllm)
    print(f"vllm start-up: {time.perf_counter() - start:.1f} s", flush=True)
    return llm


def run_vllm(args, path, dummy, runs_prompts, max_tokens) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    llm = make_vllm(args, path, dummy, 4096)
    if args.structured == "none":
        params = [
            SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, detokenize=False)
            for n in max_tokens
        ]
    else:
        params = workload_params(args, SamplingParams, StructuredOutputsParams, max_tokens)
    warm_up = [TokensPrompt(prompt_token_ids=[1, 2, 3, 4])]
    llm.generate(warm_up, SamplingParams(max_tokens=16, detokenize=False), use_tqdm=False)
    if args.structured == "json":
        llm.generate(
            warm_up, workload_params(args, SamplingParams, StructuredOutputsParams, [16]), use_tqdm=False
        )
    times, tokens, outputs = [], [], []
    for prompts in runs_prompts:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    return {"times": times, "tokens": tokens, "completions": completions(outputs)}


def run_hf(args, path, dummy, runs_prompts, max_tokens) -> dict:
    """Static batching with ``generate`` (left padding, sdpa): the baseline without paging (no
    prefix cache: every run has run 1's prompts)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if dummy:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device).eval()
    config = GenerationConfig(
        do_sample=True,
        temperature=0.6,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=0,
        max_new_tokens=max(max_tokens),
    )
    model.generation_config.eos_token_id = None
    prompts = runs_prompts[0]
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        model.generate(
            ids[:1, -4:],
            attention_mask=mask[:1, -4:],
            generation_config=GenerationConfig(
                do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0
            ),
        )
        times = []
        for _ in range(args.hf_runs):
            start = time.perf_counter()
            model.generate(ids, attention_mask=mask, generation_config=config)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return {"times": times, "tokens": [sum(max_tokens)] * len(times), "completions": None}


ENGINES = {"nanovllm": run_nanovllm, "vllm": run_vllm, "hf": run_hf}


def latency_max_model_len(args) -> int:
    return max(args.latency_prompt_len, args.latency_ttft_len) + args.latency_decode_tokens


def latency_nanovllm(args, path, dummy) -> dict:
    from nanovllm import SamplingParams

    llm = make_nanovllm(args, path, dummy, latency_max_model_len(args))

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    result = measure_latency(args, "nanovllm", generate)
    llm.exit()
    return result


def latency_vllm(args, path, dummy) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_vllm(args, path, dummy, latency_max_model_len(args))

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return measure_latency(args, "vllm", generate)


LATENCY_ENGINES = {"nanovllm": latency_nanovllm, "vllm": latency_vllm}
