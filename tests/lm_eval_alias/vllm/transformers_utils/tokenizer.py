from transformers import AutoTokenizer


def get_tokenizer(name, tokenizer_mode="auto", trust_remote_code=False, revision=None, **kwargs):
    """The folder's Hugging Face tokenizer, as vLLM's helper loads it."""
    return AutoTokenizer.from_pretrained(name, use_fast=tokenizer_mode != "slow", **kwargs)
