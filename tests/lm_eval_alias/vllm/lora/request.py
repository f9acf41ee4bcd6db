class LoRARequest:
    """nanovllm has no LoRA adapters: making a request for one fails."""

    def __init__(self, *args, **kwargs):
        raise ValueError("LoRA adapters are not implemented")
