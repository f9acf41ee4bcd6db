"""The user API: ``LLM(model, **options)``, then ``generate``, ``stream`` or ``chat``."""

import gc
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.execution.platform import probe_platform, torch_dtype
from nanovllm.execution.tp_executor import TPExecutor
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(config: Config):
    """The Hugging Face tokenizer ``config`` names (its own folder or the model's), or None when
    it skips one or the folder has no tokenizer files."""
    path = os.path.expanduser(config.tokenizer or config.model)
    if config.skip_tokenizer_init or not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, use_fast=config.tokenizer_mode == "auto")


def freeze_start_up_objects() -> None:
    """Move every object alive after start-up (torch, transformers, the model's modules: hundreds of
    thousands) out of the garbage collector's sight, as vLLM does: a full collection during a run
    would walk them all, stalling the step loop for ~0.3 s (seen on a run of fresh prompts);
    afterwards collections walk only what the runs themselves allocate. Undone when the engine
    is released, so that what it leaves in reference cycles can be collected."""
    gc.collect()
    gc.freeze()


def release(executor: TPExecutor) -> None:
    executor.close()
    gc.unfreeze()


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's ``llm.llm_engine.model_config``, the fields scripts read."""

    model: str
    max_model_len: int
    hf_config: PretrainedConfig
    dtype: torch.dtype


class LLM(LLMEngine):
    """An engine over a Hugging Face model folder; see :class:`Config` for the options.

    Workers and device memory are released by :meth:`exit`, at the end of a ``with`` block,
    when the last reference to the engine goes, or at interpreter exit, whichever comes first.
    """

    def __init__(self, model: str, **options):
        config = Config.from_options(model, probe_platform(), **options)
        tokenizer = load_tokenizer(config)
        executor = TPExecutor(config)
        try:
            super().__init__(executor.config, executor, tokenizer)
        except BaseException:
            executor.close()
            raise
        # holds the executor, not the engine, so dropping the engine still frees everything
        self._finalizer = weakref.finalize(self, release, executor)
        freeze_start_up_objects()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages)
        or to a list of them, rendered by the tokenizer's chat template (or ``chat_template``)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model!r} has no tokenizer files: chat needs a tokenizer")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for i, conversation in enumerate(conversations):
            if not isinstance(conversation, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conversation
            ):
                raise TypeError(f"conversation {i} must be a list of {{'role': ..., 'content': ...}} dicts")
            text = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # the template writes any special tokens itself
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """vLLM's: ``func`` on the model of every tensor-parallel rank (each holds its shard);
        the results in rank order."""
        return self.collective_rpc("apply_model", args=(func,))

    @property
    def llm_engine(self) -> "LLM":
        """This engine (vLLM scripts reach the engine's configuration through it)."""
        return self

    @property
    def model_config(self) -> ModelConfig:
        """The model's settings under vLLM's names."""
        config = self.config
        return ModelConfig(config.model, config.max_model_len, config.hf_config, torch_dtype(config.dtype))

    def exit(self) -> None:
        super().exit()
        self._finalizer.detach()
        gc.unfreeze()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()
