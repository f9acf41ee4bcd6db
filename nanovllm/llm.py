"""The user API: ``LLM(model, **options).generate(prompts, sampling_params)``."""

import atexit
import os

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.execution.tp_executor import TPExecutor

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    """The folder's Hugging Face tokenizer, or None when it has no tokenizer files."""
    if not any(os.path.exists(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, use_fast=True)


class LLM(LLMEngine):
    """An engine over a Hugging Face model folder; see :class:`Config` for the options."""

    def __init__(self, model: str, **options):
        config = Config.from_options(model, **options)
        tokenizer = load_tokenizer(config.model)
        executor = TPExecutor(config)
        try:
            super().__init__(config, executor, tokenizer)
        except BaseException:
            executor.close()
            raise
        atexit.register(self.exit)

    def exit(self) -> None:
        super().exit()
        atexit.unregister(self.exit)
