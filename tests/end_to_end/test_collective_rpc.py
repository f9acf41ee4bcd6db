"""vLLM's collective_rpc and apply_model: a call on every tensor-parallel rank, results in rank
order, callables by value, a rank's error named."""

import pytest

from nanovllm import LLM, SamplingParams

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def shard_rows(model) -> int:
    return model.model.layers[0].self_attn.qkv_proj.weight.shape[0]


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, qwen3_dir):
    with LLM(qwen3_dir, tensor_parallel_size=request.param, **OPTIONS) as llm:
        yield llm


def test_results_come_in_rank_order(engine):
    size = engine.config.tensor_parallel_size
    assert engine.collective_rpc(lambda runner: runner.tp.rank) == list(range(size))
    offset = 10
    assert engine.collective_rpc(
        lambda runner, k, extra=0: runner.tp.rank * k + extra, args=(2,), kwargs={"extra": offset}
    ) == [offset + 2 * r for r in range(size)]


def test_apply_model_runs_on_each_shard(engine, qwen3_dir):
    size = engine.config.tensor_parallel_size
    rows = engine.apply_model(shard_rows)  # a module-level function, and a lambda, by value
    assert rows == [rows[0]] * size
    assert engine.apply_model(lambda model: shard_rows(model) * size) == [rows[0] * size] * size
    with LLM(qwen3_dir, tensor_parallel_size=1, **OPTIONS) as whole:
        assert whole.apply_model(shard_rows) == [rows[0] * size]


def test_a_method_name_calls_the_worker_method(engine):
    size = engine.config.tensor_parallel_size
    assert engine.collective_rpc("apply_model", args=(lambda model: 7,)) == [7] * size
    with pytest.raises((AttributeError, RuntimeError), match="no method 'no_such_method'"):
        engine.collective_rpc("no_such_method")


def test_an_error_names_its_rank_and_leaves_the_engine_usable(engine, qwen3_dir, prompts, hf_reference):
    size = engine.config.tensor_parallel_size
    failing = size - 1
    with pytest.raises((RuntimeError, ZeroDivisionError), match=f"rank {failing}" if failing else "division"):
        engine.collective_rpc(lambda runner: 1 // (runner.tp.rank - failing))
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference(qwen3_dir, prompts, 8)


def test_refused_while_a_call_runs(engine):
    stream = engine.stream(["Hello"], GREEDY)
    next(stream)
    with pytest.raises(RuntimeError, match="collective_rpc: the engine is running a call"):
        engine.collective_rpc(lambda runner: 0)
    stream.close()
    assert engine.collective_rpc(lambda runner: 0) == [0] * engine.config.tensor_parallel_size
