"""A GRPO-style loop with nanovllm as the rollout engine, the trainer beside it on one device.

    python examples/rl_rollout.py                    # a small random policy on the CPU, 4 steps
    python examples/rl_rollout.py --model /path/to/Qwen3-0.6B --device cuda --steps 20

Each step: the engine samples a group of completions per prompt with the log-probabilities of
its tokens; a toy reward (the share of its tokens from the first half of the vocabulary) gives
each completion its advantage
within its group; the engine sleeps while the Hugging Face policy takes an optimizer step on
the policy-gradient loss; then it wakes and takes the new weights (``load_weights``) before the
next rollout. Per step it prints the mean reward and the largest difference between the
engine's log-probability of a sampled token and the policy's own (they agree to float noise:
the rollout is on-policy).
"""

import argparse
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm.demo_models import write_demo_model

PROMPTS = ["The quick brown fox", "Paged attention stores", "Continuous batching keeps", "introduce yourself"]


def completion_logprobs(policy, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The policy's log-probability of each completion token (with gradients)."""
    ids = torch.tensor([prompt + completion], device=policy.device)
    logits = policy(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="Hugging Face model folder (default: a small random demo model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    path = args.model or write_demo_model(tempfile.mkdtemp(prefix="nanovllm-rl-"))
    if not args.model:  # the demo folder has a config only: give the policy real weights to train
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.float32
        ).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    half = len(tokenizer) // 2
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    llm = LLM(path, device=args.device, dtype="float32", enable_sleep_mode=True, max_model_len=256)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.group, logprobs=0, seed=0)

    for step in range(args.steps):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.sleep(level=1)  # the trainer gets the device's memory while it trains

        loss, rewards, largest_gap = 0.0, [], 0.0
        for prompt, output in zip(prompts, outputs):
            group = output.outputs
            reward = torch.tensor([sum(t < half for t in c.token_ids) / len(c.token_ids) for c in group])
            advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
            rewards += reward.tolist()
            for completion, adv in zip(group, advantage):
                own = completion_logprobs(policy, prompt, completion.token_ids)
                engine = torch.tensor(
                    [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
                )
                largest_gap = max(largest_gap, (own.detach().cpu() - engine).abs().max().item())
                loss = loss - adv * own.sum() / len(group)
        optimizer.zero_grad()
        (loss / len(prompts)).backward()
        optimizer.step()

        llm.wake_up(tags=["weights"])
        llm.load_weights(policy.named_parameters())
        llm.wake_up(tags=["kv_cache"])
        print(
            f"step {step}: mean reward {sum(rewards) / len(rewards):.3f}, "
            f"largest |engine - policy| sampled-token logprob {largest_gap:.2e}"
        )
    llm.exit()


if __name__ == "__main__":
    main()
