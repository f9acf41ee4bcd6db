"""Model registry: Hugging Face architecture name -> model class."""

from nanovllm.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": Qwen3ForCausalLM,
}
