"""Tiny random Hugging Face checkpoints for the tests, written by transformers itself."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm.demo_models import write_tokenizer
from nanovllm.models.registry import ARCHITECTURES

TINY_QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.2,
)


def make_random_checkpoint(
    path: str,
    architecture: str = "Qwen3ForCausalLM",
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: bool = True,
    **overrides,
) -> str:
    """Save a random-weight model with ``save_pretrained`` (and a tokenizer) into ``path``."""
    params = dict(TINY_QWEN3, **overrides)
    config = AutoConfig.for_model(ARCHITECTURES[architecture].model_type, **params)
    config.architectures = [architecture]
    if tokenizer:
        write_tokenizer(path, params["vocab_size"])
        config.eos_token_id = AutoTokenizer.from_pretrained(path).eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    return path
