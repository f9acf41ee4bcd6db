"""A stand-in ``vllm`` for tests: vLLM's import paths that lm-evaluation-harness's vLLM backend
uses, mapped onto nanovllm and nothing else (with this folder on ``sys.path``)."""

from nanovllm import LLM, SamplingParams, TextPrompt, TokensPrompt

__all__ = ["LLM", "SamplingParams", "TextPrompt", "TokensPrompt"]
