"""nanovllm: a compact offline LLM inference engine."""

from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
