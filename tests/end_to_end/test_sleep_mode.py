"""vLLM's sleep mode, as RL trainers use it: sleep(level) frees the weights and the KV cache of
every rank, wake_up(tags) brings them back (all, or weights then KV cache), and the engine
answers as before; calls that run the model while a part sleeps raise, naming what to wake."""

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.execution.loader import load_model
from nanovllm.sampling_params import BeamSearchParams

OPTIONS = dict(
    device="cpu",
    dtype="float32",
    max_model_len=256,
    kvcache_block_size=16,
    max_num_seqs=8,
    enable_sleep_mode=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def reload_checkpoint(llm: LLM, model_dir: str) -> None:
    """Every rank loads its shard of the checkpoint again (the weights after a level-2 sleep)."""
    llm.collective_rpc(lambda runner: load_model(runner.model, model_dir))


def device_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@pytest.mark.parametrize(
    "wakes", [[None], [["weights"], ["kv_cache"]], [["kv_cache"], ["weights"]]], ids=["all", "w-kv", "kv-w"]
)
@pytest.mark.parametrize("model", ["qwen3_dir", "qwen2_dir"], ids=["qwen3", "qwen2-tied"])
def test_level_1_gives_back_the_same_outputs(request, model, wakes, prompts):
    model_dir = request.getfixturevalue(model)
    with LLM(model_dir, **OPTIONS) as llm:
        before = greedy(llm, prompts)
        runner = llm.executor.runner
        shapes = [t.shape for t in device_tensors(runner.model)]
        assert not llm.is_sleeping()
        llm.sleep(level=1)
        assert llm.is_sleeping()
        assert all(t.numel() == 0 for t in device_tensors(runner.model))
        assert runner.kv_cache.tensor is None
        for tags in wakes:
            llm.wake_up(tags=tags)
        assert not llm.is_sleeping()
        assert [t.shape for t in device_tensors(runner.model)] == shapes
        assert runner.kv_cache.tensor is not None and runner.kv_cache.num_blocks == llm.num_kvcache_blocks
        head, embedding = runner.model.lm_head.weight, runner.model.model.embed_tokens.weight
        if model == "qwen2_dir":  # a tied head still shares its embedding's memory
            assert head is embedding and head.data_ptr() == embedding.data_ptr()
        else:
            assert head.data_ptr() != embedding.data_ptr()
        assert greedy(llm, prompts) == before


def test_level_2_drops_the_weights_for_the_caller_to_load(qwen3_dir, prompts, hf_reference):
    expected = hf_reference(qwen3_dir, prompts, 16)
    with LLM(qwen3_dir, **OPTIONS) as llm:
        assert greedy(llm, prompts) == expected
        llm.sleep(level=2)
        assert llm.executor.runner.offloaded.nbytes > 0
        # only the buffers (the rotary table, which no checkpoint holds) are kept
        kept = [s for s in llm.executor.runner.offloaded.storages.values() if s.host is not None]
        assert [v.tensor for s in kept for v in s.views] == list(llm.executor.runner.model.buffers())
        llm.wake_up()
        reload_checkpoint(llm, qwen3_dir)
        assert greedy(llm, prompts) == expected


def test_calls_that_run_the_model_raise_naming_what_to_wake(qwen3_dir, prompts):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        greedy(llm, prompts[:2])
        llm.sleep()
        calls = [  # chat runs through generate
            ("generate", lambda: llm.generate(prompts[:1], GREEDY, use_tqdm=False)),
            ("stream", lambda: llm.stream(prompts[:1], GREEDY)),
            ("generate", lambda: llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False)),
            (
                "beam_search",
                lambda: llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4)),
            ),
            ("collective_rpc", lambda: llm.collective_rpc(lambda runner: 0)),
        ]
        for what, call in calls:
            with pytest.raises(RuntimeError, match=rf"{what}: the engine is asleep \(weights and kv_cache"):
                call()
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()
        for what, call in calls:
            with pytest.raises(RuntimeError, match=rf"{what}: .*\(kv_cache .*wake_up\(tags=\['kv_cache'\]\)"):
                call()
        llm.add_request(prompts[0], GREEDY)
        with pytest.raises(RuntimeError, match="step: the engine is asleep"):
            llm.step()
        llm.abort_all()
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert llm.collective_rpc(lambda runner: sorted(runner.asleep)) == [[]]
        assert len(greedy(llm, prompts[:1])[0]) == 16


def test_sleep_needs_enable_sleep_mode_and_checks_its_arguments(qwen3_dir):
    with LLM(qwen3_dir, **{**OPTIONS, "enable_sleep_mode": False}) as llm:
        assert not llm.config.enable_sleep_mode
        with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
            llm.sleep()
        assert not llm.is_sleeping()
    with LLM(qwen3_dir, **OPTIONS) as llm:
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            llm.sleep(level=3)
        assert not llm.is_sleeping()
        llm.wake_up()  # nothing asleep: nothing to do
        llm.sleep()
        with pytest.raises(ValueError, match=r"tags \['gpu'\] are unknown"):
            llm.wake_up(tags=["gpu"])
        llm.sleep()  # asleep already: stays so
        llm.wake_up()
        assert not llm.is_sleeping()


def test_a_prefix_cached_before_sleep_is_computed_again(qwen3_dir, prompts, hf_reference):
    prompt = prompts[-1]  # 100 tokens: six full blocks
    expected = hf_reference(qwen3_dir, [prompt], 16)
    with LLM(qwen3_dir, **OPTIONS) as llm:
        first, again = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
        assert first.num_cached_tokens == 0 and again.num_cached_tokens == 96
        llm.sleep(level=1)
        llm.wake_up()
        after = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert after.num_cached_tokens == 0
        assert [first.outputs[0].token_ids, after.outputs[0].token_ids] == expected * 2


def test_sleep_and_wake_up_wait_for_no_call(qwen3_dir, prompts):
    with LLM(qwen3_dir, **OPTIONS) as llm:
        stream = llm.stream(prompts[:2], GREEDY)
        next(stream)
        with pytest.raises(RuntimeError, match="sleep: the engine is running a call"):
            llm.sleep()
        stream.close()
        llm.sleep()
        llm.add_request(prompts[0], GREEDY)  # queued while asleep: wake_up waits for it too
        with pytest.raises(RuntimeError, match="wake_up: requests queued with add_request"):
            llm.wake_up()
        llm.abort_all()
        llm.wake_up()
        assert len(greedy(llm, prompts[:1])[0]) == 16


def test_tensor_parallel_ranks_sleep_and_wake_together(qwen3_dir, prompts, hf_reference):
    expected = hf_reference(qwen3_dir, prompts, 16)
    with LLM(qwen3_dir, tensor_parallel_size=2, **OPTIONS) as llm:
        assert greedy(llm, prompts) == expected
        llm.sleep(level=1)
        llm.wake_up(tags=["weights"])
        with pytest.raises(RuntimeError, match="kv_cache"):
            llm.generate(prompts, GREEDY, use_tqdm=False)
        llm.wake_up(tags=["kv_cache"])
        assert llm.collective_rpc(lambda runner: sorted(runner.asleep)) == [[], []]
        assert greedy(llm, prompts) == expected
        llm.sleep(level=2)
        llm.wake_up()
        reload_checkpoint(llm, qwen3_dir)
        assert greedy(llm, prompts) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sleep_frees_gpu_memory_and_cuda_graphs_come_back(qwen3_dir, prompts, hf_reference):
    expected = hf_reference(qwen3_dir, prompts, 16)
    options = {**OPTIONS, "device": "cuda", "enforce_eager": False, "kv_cache_memory_gb": 0.25}
    with LLM(qwen3_dir, **options) as llm:
        runner = llm.executor.runner
        assert runner.graphs is not None
        assert greedy(llm, prompts) == expected
        weight_bytes = sum(t.numel() * t.element_size() for t in device_tensors(runner.model))
        cache_bytes = runner.kv_cache.tensor.numel() * runner.kv_cache.tensor.element_size()
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        llm.sleep(level=1)
        freed = allocated - torch.cuda.memory_allocated()
        assert freed >= weight_bytes + cache_bytes, (freed, weight_bytes, cache_bytes)
        assert runner.graphs is None
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        assert runner.graphs is not None
        assert greedy(llm, prompts) == expected
