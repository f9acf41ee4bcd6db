"""Hugging Face's rope scaling settings as plain data: which types exist and how they are
read. No torch, so the configuration can check a checkpoint before anything heavy loads."""

SCALING_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


def scaling_type(scaling: dict) -> str:
    """The rope scaling type of Hugging Face's ``rope_parameters`` (older configs: ``type``)."""
    return scaling.get("rope_type", scaling.get("type", "default"))


def dynamic_factor(scaling: dict) -> float:
    """The ``factor`` of a "dynamic" setting: a number >= 1 (Hugging Face warns below 1)."""
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise ValueError(f"rope scaling 'dynamic' needs a number factor >= 1, got factor={factor!r}")
    return float(factor)
