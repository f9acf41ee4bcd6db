from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """``LLM(model_dir, **options).generate(prompts, sampling_params)``; see :class:`Config`."""
