"""The same prompts twice through one engine: the second pass is served from the prefix cache."""

from nanovllm import LLM, SamplingParams


def generate_twice(model_dir: str, prompts, params: SamplingParams, options: dict) -> list[list[int]]:
    """The first pass's token ids, after checking that it registered cache blocks and that the
    second pass, hitting them, gives the same tokens."""
    with LLM(model_dir, **options) as llm:
        first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.scheduler.block_manager.hash_to_block
        again = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again
    return first
