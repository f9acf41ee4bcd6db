"""nanovllm: a compact offline LLM inference engine.

``LLM``, ``SamplingParams`` and the output types load on first use, so that a layer's package
(say the torch-free ``nanovllm.scheduling``) can be imported alone.
"""

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "TextPrompt",
    "TokensPrompt",
    "BeamSearchParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanovllm.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from nanovllm import outputs

        return getattr(outputs, name)
    if name in ("BeamSearchParams", "StructuredOutputsParams"):
        from nanovllm import sampling_params

        return getattr(sampling_params, name)
    if name in ("TextPrompt", "TokensPrompt"):
        from nanovllm import inputs

        return getattr(inputs, name)
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
