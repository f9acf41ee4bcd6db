"""Weights updated in place (``load_weights``), as an RL trainer syncs its policy into the
rollout engine: HF transformers on the same new weights is the oracle."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanovllm import LLM, SamplingParams
from tests.checkpoints import make_random_checkpoint
from tests.conftest import hf_greedy
from tests.end_to_end.hf_oracle import hf_logprobs

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MOE = dict(
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    router_aux_loss_coef=0.0,
    norm_topk_prob=True,
)


def perturbed(model_dir: str, seed: int):
    """The checkpoint's HF model with every weight moved a little."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return make_random_checkpoint(str(tmp_path_factory.mktemp("moe")), "Qwen3MoeForCausalLM", seed=5, **MOE)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_follows_the_new_weights(qwen3_dir, moe_dir, prompts, tmp_path, kind, tp):
    model_dir = qwen3_dir if kind == "dense" else moe_dir
    policy = perturbed(model_dir, seed=1)
    policy.save_pretrained(tmp_path)
    expected = hf_greedy(str(tmp_path), prompts, 12)
    with LLM(model_dir, tensor_parallel_size=tp, **OPTIONS) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert before != expected
        loaded = llm.load_weights(policy.named_parameters())
        assert set(loaded) == {name for name, _ in policy.named_parameters()}
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)  # the same prompts: cached before
        assert all(o.num_cached_tokens == 0 for o in outputs)
        assert [o.outputs[0].token_ids for o in outputs] == expected


def test_sampled_logprobs_follow_the_policy_round_after_round(qwen3_dir, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=8, logprobs=0, seed=3, n=2, ignore_eos=True)
    with LLM(qwen3_dir, **OPTIONS) as llm:
        for round_ in range(3):
            policy = perturbed(qwen3_dir, seed=10 + round_)
            llm.load_weights(policy.state_dict().items())
            for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
                for completion in output.outputs:
                    reference = hf_logprobs(policy, prompt, completion.token_ids)
                    ours = torch.tensor(
                        [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
                    )
                    theirs = reference.gather(1, torch.tensor(completion.token_ids)[:, None]).squeeze(1)
                    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_a_tied_head_copy_is_accepted(qwen2_dir, prompts, tmp_path):
    policy = perturbed(qwen2_dir, seed=2)  # tie_word_embeddings: lm_head.weight is the embedding
    policy.save_pretrained(tmp_path)
    state = policy.state_dict()
    assert "lm_head.weight" in state
    with LLM(qwen2_dir, **OPTIONS) as llm:
        llm.load_weights(state.items())
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(str(tmp_path), prompts, 12)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_bad_updates_write_nothing(qwen3_dir, prompts, hf_reference, tp):
    policy = perturbed(qwen3_dir, seed=4)
    good = list(policy.named_parameters())
    q = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        r"no place for: \['model\.layers\.9\.mlp\.up_proj\.weight'\]": good
        + [("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))],
        "q_proj.weight' has shape \\(3, 3\\)": good + [(q, torch.zeros(3, 3))],
        "q_proj.weight' has dtype torch.int64": good
        + [(q, torch.zeros(dict(good)[q].shape, dtype=torch.int64))],
    }
    with LLM(qwen3_dir, tensor_parallel_size=tp, **OPTIONS) as llm:
        for message, weights in cases.items():
            with pytest.raises(ValueError, match=message):
                llm.load_weights(weights)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_reference(qwen3_dir, prompts, 12)


def test_reset_prefix_cache(qwen3_dir, prompts):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.generate(prompts[-1:], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
        stream = llm.stream(prompts[:1], GREEDY)
        next(stream)
        assert llm.reset_prefix_cache() is False  # a call is running
        stream.close()
        assert llm.reset_prefix_cache() is True
        assert llm.generate(prompts[-1:], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_trl_colocate_order(qwen3_dir, prompts, tmp_path, tp):
    """sleep(2), wake the weights, load them, wake the cache: TRL's colocate mode."""
    policy = perturbed(qwen3_dir, seed=6)
    policy.save_pretrained(tmp_path)
    with LLM(qwen3_dir, tensor_parallel_size=tp, enable_sleep_mode=True, **OPTIONS) as llm:
        llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match="load_weights: the engine is asleep"):
            llm.load_weights(policy.named_parameters())
        llm.wake_up(tags=["weights"])
        llm.load_weights(policy.named_parameters())
        with pytest.raises(RuntimeError, match="kv_cache"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.wake_up(tags=["kv_cache"])
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(str(tmp_path), prompts, 12)


def test_the_rl_example_stays_on_policy():
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "examples/rl_rollout.py", "--steps", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    gaps = [float(line.rsplit(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(gaps) == 2 and max(gaps) < 1e-4
