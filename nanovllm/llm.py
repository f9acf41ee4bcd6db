"""The user API: ``LLM(model, **options).generate(prompts, sampling_params)``."""

import os
import weakref

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
    """An engine over a Hugging Face model folder; see :class:`Config` for the options.

    Workers and device memory are released by :meth:`exit`, at the end of a ``with`` block,
    when the last reference to the engine goes, or at interpreter exit, whichever comes first.
    """

    def __init__(self, model: str, **options):
        config = Config.from_options(model, **options)
        tokenizer = load_tokenizer(config.model)
        executor = TPExecutor(config)
        try:
            super().__init__(config, executor, tokenizer)
        except BaseException:
            executor.close()
            raise
        # holds the executor, not the engine, so dropping the engine still frees everything
        self._finalizer = weakref.finalize(self, executor.close)

    def exit(self) -> None:
        super().exit()
        self._finalizer.detach()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()
