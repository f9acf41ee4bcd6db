"""vLLM's ``LLM(...)`` arguments as nanovllm reads them: each is honoured (an option of
:class:`~nanovllm.config.Config`, maybe under another name), accepted with the meaning it has
here, or refused by name when it asks for a feature nanovllm lacks. ``None`` means the default.
"""

RENAMED = {"block_size": "kvcache_block_size"}
"""vLLM's name -> the option that honours it."""

ACCEPTED = {
    "trust_remote_code": "no remote code ever runs: nanovllm implements each architecture itself",
    "swap_space": "preemption recomputes; nothing is swapped to CPU memory",
    "disable_log_stats": "nanovllm logs no periodic statistics",
    "disable_custom_all_reduce": "tensor parallelism all-reduces through torch.distributed",
    "max_seq_len_to_capture": "decode CUDA graphs serve every context length",
    "enable_chunked_prefill": "a prompt longer than max_num_batched_tokens is always chunked",
    "download_dir": "models load from local folders only",
    "hf_token": "models load from local folders only",
    "disable_async_output_proc": "outputs are processed while the next step runs (async_scheduling)",
    "compilation_config": "nothing is compiled with torch.compile: the fused ops are Triton kernels",
    "max_lora_rank": "LoRA adapters are not implemented (enable_lora is refused): no rank to bound",
    "max_loras": "LoRA adapters are not implemented (enable_lora is refused): no adapter to count",
}
"""Arguments that take any value here, and what they mean here."""

REFUSED = {
    "enable_lora": ((False,), "LoRA adapters are not implemented: merge the adapter into the weights"),
    "revision": ((None,), "models load from local folders: pass the folder of that revision"),
    "tokenizer_revision": ((None,), "tokenizers load from local folders: pass tokenizer=<folder>"),
    "pipeline_parallel_size": ((1,), "use tensor_parallel_size to spread a model over GPUs"),
    "data_parallel_size": ((1,), "run replicas on Ray (nanovllm.replicas)"),
    "cpu_offload_gb": ((0,), "weights stay on the GPU: use tensor_parallel_size for a larger model"),
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "task": (("auto", "generate"), "only text generation is implemented"),
    "runner": (("auto", "generate"), "only text generation is implemented"),
}
"""Arguments accepted only at the values given, which ask for nothing nanovllm lacks."""


def to_options(options: dict) -> dict:
    """``options`` as :class:`~nanovllm.config.Config` fields: None values dropped (the default),
    vLLM's names mapped, accepted arguments taken, refused ones raising ``ValueError``."""
    options = {name: value for name, value in options.items() if value is not None}
    for vllm_name, name in RENAMED.items():
        if vllm_name in options:
            if name in options:
                raise ValueError(f"{vllm_name} and {name} are one option: pass one of them")
            options[name] = options.pop(vllm_name)
    for name, (allowed, why) in REFUSED.items():
        if name in options and options[name] not in allowed:
            raise ValueError(f"{name}={options[name]!r} is not supported: {why}")
        options.pop(name, None)
    for name in ACCEPTED:
        options.pop(name, None)
    return options
