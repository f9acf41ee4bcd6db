"""nanovllm: a compact offline LLM inference engine.

``LLM`` and ``SamplingParams`` load on first use, so that a layer's package (say the
torch-free ``nanovllm.scheduling``) can be imported alone.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from nanovllm.llm import LLM

        return LLM
    if name == "SamplingParams":
        from nanovllm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
