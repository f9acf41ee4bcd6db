"""Small random Hugging Face checkpoints, for tests, the demo and benchmarks (no download)."""

import json
import os

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
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
_CORPUS = (
    "Hello, Nano-vLLM. The quick brown fox jumps over the lazy dog. Paged attention stores keys "
    "and values in fixed-size blocks. Continuous batching keeps the GPU busy. Prefix caching "
    "reuses blocks that hold the same tokens. list all prime numbers within 100. introduce yourself"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(path: str, vocab_size: int) -> None:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)


def write_config(
    path: str, architecture: str = "Qwen3ForCausalLM", dtype: str = "bfloat16", **overrides
) -> dict:
    """Write only ``config.json`` (for ``load_format="dummy"``); returns the config dict."""
    model_type = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
    cfg = dict(
        QWEN3_0_6B,
        architectures=[architecture],
        model_type=model_type[architecture],
        dtype=dtype,
        torch_dtype=dtype,
        hidden_act="silu",
        eos_token_id=2,
        bos_token_id=1,
    )
    cfg.update(overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return cfg


def make_random_checkpoint(
    path: str,
    architecture: str = "Qwen3ForCausalLM",
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: bool = True,
    **overrides,
) -> str:
    """Save a random-weight model with transformers (``save_pretrained``) plus a tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    params = dict(TINY_QWEN3, **overrides)
    model_type = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
    config = AutoConfig.for_model(model_type[architecture], **params)
    config.architectures = [architecture]
    if tokenizer:
        write_tokenizer(path, params["vocab_size"])
        from transformers import AutoTokenizer

        config.eos_token_id = AutoTokenizer.from_pretrained(path).eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    return path
