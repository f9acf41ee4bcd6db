"""lm-evaluation-harness's vLLM backend runs on nanovllm unchanged, through a ``vllm`` package
that maps vLLM's import paths and nothing else (``tests/lm_eval_alias``), and scores a
loglikelihood task and a generate_until task from local files (``include_path``) as
lm-eval's Hugging Face backend does on the same checkpoint (CPU, fp32)."""

import json
import os
import sys

import pytest

ALIAS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "lm_eval_alias")
DOCS = [
    {"context": "Hello there", "continuation": " general Kenobi"},
    {"context": "The quick brown fox", "continuation": " jumps over"},
    {"context": "Nano-vLLM is", "continuation": " small"},
    {"context": "introduce yourself", "continuation": " please"},
]
TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
"""
GENERATION = """generation_kwargs:
  until: ["\\n\\n"]
  do_sample: false
  max_gen_toks: 12
"""


def write_tasks(folder) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "tiny_ll.yaml").write_text(
        TASK.format(name="tiny_ll", data=data, output_type="loglikelihood", metric="acc")
    )
    generate = TASK.format(name="tiny_gen", data=data, output_type="generate_until", metric="exact_match")
    (folder / "tiny_gen.yaml").write_text(generate + GENERATION)


@pytest.fixture
def vllm_alias():
    sys.path.insert(0, ALIAS)
    yield
    sys.path.remove(ALIAS)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def test_lm_eval_vllm_backend_scores_as_its_hf_backend(qwen3_dir, tmp_path, vllm_alias):
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_tasks(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))
    samples = {}
    for backend, args in (
        ("vllm", f"pretrained={qwen3_dir},dtype=float32,max_model_len=256"),
        ("hf", f"pretrained={qwen3_dir},dtype=float32,device=cpu"),
    ):
        out = lm_eval.simple_evaluate(
            model=backend, model_args=args, tasks=["tiny_ll", "tiny_gen"], task_manager=tasks,
            log_samples=True, batch_size=4,
        )  # fmt: skip
        samples[backend] = {task: [s["resps"][0][0] for s in out["samples"][task]] for task in out["samples"]}
    ours, hf = samples["vllm"], samples["hf"]
    assert len(ours["tiny_ll"]) == len(DOCS) and len(ours["tiny_gen"]) == len(DOCS)
    assert [greedy for _, greedy in ours["tiny_ll"]] == [greedy for _, greedy in hf["tiny_ll"]]
    assert [v for v, _ in ours["tiny_ll"]] == pytest.approx([v for v, _ in hf["tiny_ll"]], abs=5e-5)
    assert ours["tiny_gen"] == hf["tiny_gen"] and all(ours["tiny_gen"])
