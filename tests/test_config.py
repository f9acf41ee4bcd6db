"""The configuration: every check runs before a model or worker exists; the registry refuses
what we do not implement, by name."""

import json

import pytest
import torch

from nanovllm import LLM
from nanovllm.config import Config, Platform
from nanovllm.demo_models import write_config
from nanovllm.execution.platform import torch_dtype
from nanovllm.models.registry import ARCHITECTURES
from tests.checkpoints import TINY_QWEN3 as SMALL


@pytest.fixture
def no_executor(monkeypatch):
    """Fail the test if an engine gets as far as starting its executor."""

    def refuse(config):
        raise AssertionError("an executor was started for a config that should have been refused")

    monkeypatch.setattr("nanovllm.llm.TPExecutor", refuse)


def test_auto_values_are_resolved_and_the_config_is_frozen(tmp_path):
    write_config(str(tmp_path), **SMALL)
    config = Config(str(tmp_path), device="cpu")
    assert (config.device, config.dtype, config.attention_backend) == ("cpu", "bfloat16", "torch")
    assert config.architecture is ARCHITECTURES["Qwen3ForCausalLM"]
    assert config.eos_token_ids == (2,)
    with pytest.raises(AttributeError):
        config.max_num_seqs = 3


def test_the_block_size_defaults_by_backend(tmp_path, monkeypatch):
    write_config(str(tmp_path), **SMALL)
    assert Config(str(tmp_path), device="cpu").kvcache_block_size == 128
    assert Config(str(tmp_path), device="cpu", kvcache_block_size=32).kvcache_block_size == 32
    # flash-attn's kernels take 256-token blocks at least: "auto" gives it those
    monkeypatch.setattr(Config, "_resolve_attention_backend", lambda self: "flash_attn")
    assert Config(str(tmp_path), device="cpu").kvcache_block_size == 256


def test_auto_values_resolve_against_the_platform_given(tmp_path):
    """The configuration knows the machine only through the Platform it is handed."""
    write_config(str(tmp_path), **SMALL)
    two_hoppers = Platform(((9, 0), (9, 0)))
    config = Config(str(tmp_path), platform=two_hoppers, kv_cache_memory_gb=0.01)
    assert (config.device, config.attention_backend) == ("cuda:0", "triton")
    assert (
        Config(str(tmp_path), platform=two_hoppers, device="cuda:1", kv_cache_memory_gb=0.01).device
        == "cuda:1"
    )
    assert Config(str(tmp_path), kv_cache_memory_gb=0.01).device == "cpu"
    with pytest.raises(ValueError, match="needs 3 GPUs"):
        Config(str(tmp_path), platform=two_hoppers, device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="compute capability 8.9"):
        Config(str(tmp_path), platform=Platform(((8, 0),)), kv_cache_dtype="fp8", kv_cache_memory_gb=0.01)


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_a_bf16_one(tmp_path):
    write_config(str(tmp_path), **SMALL)
    bf16 = Config(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.01)
    fp8 = Config(str(tmp_path), device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype="fp8")
    assert (bf16.kv_cache_dtype, fp8.kv_cache_dtype) == ("bfloat16", "fp8")
    assert torch_dtype(fp8.kv_cache_dtype) == torch.float8_e4m3fn
    assert bf16.kv_block_bytes == 2 * fp8.kv_block_bytes
    assert fp8.fixed_num_kvcache_blocks // 2 == bf16.fixed_num_kvcache_blocks  # floors of x and 2x


def test_max_model_len_is_capped_by_the_model(tmp_path):
    write_config(str(tmp_path), **{**SMALL, "max_position_embeddings": 100})
    config = Config(str(tmp_path), device="cpu", max_model_len=4096)
    assert (config.max_model_len, config.max_shared_prompt_len) == (100, None)


def test_dynamic_rope_stretches_the_context_and_limits_prefix_sharing(tmp_path):
    dynamic = {"rope_type": "dynamic", "factor": 4.0}
    write_config(str(tmp_path), **{**SMALL, "max_position_embeddings": 100}, rope_scaling=dynamic)
    config = Config(str(tmp_path), device="cpu", max_model_len=4096)
    assert (config.max_model_len, config.max_shared_prompt_len) == (400, 100)


@pytest.mark.parametrize(
    "options, match",
    [
        pytest.param(
            dict(device="cuda"),
            "CUDA is not available",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available"),
        ),
        (dict(device="tpu"), "device must be"),
        (dict(num_kvcache_blocks=1, kvcache_block_size=16, max_model_len=64), "KV cache holds 16 tokens"),
        (dict(kv_cache_memory_gb=1e-9), "KV cache holds 0 tokens"),
        (dict(attention_backend="flash_attn"), "flash-attn"),
        (dict(attention_backend="triton", kvcache_block_size=8), "kvcache_block_size >= 16"),
        (dict(load_format="pt"), "load_format"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kv_cache_dtype="int8"), "kv_cache_dtype must be"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(tmp_path, no_executor, options, match):
    write_config(str(tmp_path), **SMALL)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **{"device": "cpu", **options})


@pytest.mark.parametrize(
    "architecture, overrides, match",
    [
        ("Qwen3ForCausalLM", dict(rope_scaling={"rope_type": "dynamic", "factor": 0.5}), "factor=0.5"),
        ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "su", "factor": 4.0}), "rope scaling 'su'"),
        ("MistralForCausalLM", dict(sliding_window=4096), "sliding_window=4096"),
        ("MixtralForCausalLM", dict(sliding_window=4096, num_local_experts=4), "sliding_window=4096"),
        ("Qwen3ForCausalLM", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("LlamaForCausalLM", dict(mlp_bias=True), "mlp_bias"),
        ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64), "sliding-window"),
        ("Qwen3ForCausalLM", dict(quantization_config={"quant_method": "awq"}), "quantization_config"),
        (
            "Qwen3ForCausalLM",
            dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static"}),
            "dynamic activation scales",
        ),
    ],
)
def test_checkpoint_features_we_do_not_implement_are_refused_by_name(
    tmp_path, no_executor, architecture, overrides, match
):
    write_config(str(tmp_path), architecture=architecture, **SMALL, **overrides)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), device="cpu")


def test_unknown_architecture_lists_the_supported_ones(tmp_path, no_executor):
    write_config(str(tmp_path), **SMALL, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="supported: .*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize(
    "dtype, resolved",
    [("half", "float16"), ("float", "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16")],
)
def test_vllm_dtype_names_are_accepted(tmp_path, dtype, resolved):
    write_config(str(tmp_path), **SMALL)
    assert Config(str(tmp_path), device="cpu", dtype=dtype).dtype == resolved


def test_a_config_missing_a_shape_field_is_refused_by_name(tmp_path):
    write_config(str(tmp_path), **SMALL)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    del raw["num_attention_heads"]  # transformers would use 32 heads
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json lacks \['num_attention_heads'\]"):
        Config(str(tmp_path), device="cpu")


def test_a_config_transformers_cannot_read_is_named(tmp_path):
    write_config(str(tmp_path), **SMALL)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["torch_dtype"] = "float13"
    raw.pop("dtype", None)
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"config\.json cannot be read: .*float13"):
        Config(str(tmp_path), device="cpu", dtype="float32")


def test_the_triton_backend_on_cpu_needs_the_interpreter(tmp_path, monkeypatch):
    write_config(str(tmp_path), **SMALL)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton' needs CUDA"):
        Config(str(tmp_path), device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Config(str(tmp_path), device="cpu", attention_backend="triton").attention_backend == "triton"


def test_max_model_len_defaults_to_the_models_context(tmp_path):
    write_config(str(tmp_path), **{**SMALL, "max_position_embeddings": 8192})
    assert Config(str(tmp_path), device="cpu").max_model_len == 8192
    assert Config(str(tmp_path), device="cpu", max_model_len=None).max_model_len == 8192
    assert Config(str(tmp_path), device="cpu", max_model_len=100).max_model_len == 100


def test_a_default_max_model_len_is_lowered_to_what_the_cache_holds(tmp_path, caplog):
    write_config(str(tmp_path), **{**SMALL, "max_position_embeddings": 8192})
    with caplog.at_level("WARNING", logger="nanovllm"):
        config = Config(str(tmp_path), device="cpu", num_kvcache_blocks=3, kvcache_block_size=16)
    assert config.max_model_len == 48 and "the KV cache holds 48 tokens" in caplog.text
    # the same when the block count comes from profiling the GPU, after start-up
    profiled = Config(str(tmp_path), device="cpu", kvcache_block_size=16)
    assert profiled.max_model_len == 8192
    assert profiled.fit_max_model_len(3).max_model_len == 48
    assert profiled.fit_max_model_len(1000) is profiled
    with pytest.raises(
        ValueError, match="KV cache holds 48 tokens, less than one sequence of max_model_len=64"
    ):
        Config(str(tmp_path), device="cpu", max_model_len=64, kvcache_block_size=16).fit_max_model_len(3)
