"""Model folders for demos and benchmarks, made on the spot (no download, runtime dependencies only).

A config-only folder runs with ``load_format="dummy"`` (random weights); a small tokenizer
can be added so that string prompts work.
"""

import json
import os

from nanovllm.models.registry import ARCHITECTURES

SHAPES = {
    "qwen3-0.6b": dict(
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
    ),
    "qwen3-8b": dict(
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
    ),
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
}
_CORPUS = (
    "Hello, Nano-vLLM. The quick brown fox jumps over the lazy dog. Paged attention stores keys "
    "and values in fixed-size blocks. Continuous batching keeps the GPU busy. Prefix caching "
    "reuses blocks that hold the same tokens. list all prime numbers within 100. introduce yourself"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_config(
    path: str,
    shape: str = "qwen3-0.6b",
    architecture: str | None = None,
    dtype: str = "bfloat16",
    **overrides,
) -> dict:
    """Write a ``config.json`` of a named shape (for ``load_format="dummy"``); returns it. The
    architecture defaults to the shape's own (Qwen3 dense unless it names one)."""
    shape_cfg = dict(SHAPES[shape])
    architecture = architecture or shape_cfg.get("architecture", "Qwen3ForCausalLM")
    shape_cfg.pop("architecture", None)
    cfg = dict(
        shape_cfg,
        architectures=[architecture],
        model_type=ARCHITECTURES[architecture].model_type,
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


def write_tokenizer(path: str, vocab_size: int) -> int:
    """Train a byte-level BPE tokenizer of at most ``vocab_size`` tokens and save it; returns
    its EOS id ("<|im_end|>")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
    return fast.eos_token_id


def write_demo_model(path: str) -> str:
    """A small Qwen3-shaped folder with a tokenizer, to run with ``load_format="dummy"``."""
    eos = write_tokenizer(path, 512)
    write_config(
        path,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=eos,
        dtype="float32",
    )
    return path
