"""SamplingParams: vLLM-style names and defaults, and a ValueError naming the bad field."""

import math

import pytest

from nanovllm.sampling_params import SamplingParams


def test_defaults_are_valid_and_disable_the_filters():
    p = SamplingParams()
    assert p.temperature == 1.0
    assert p.top_k in (-1, 0)  # both mean "disabled"
    assert p.top_p == 1.0
    assert p.min_p == 0.0
    assert p.seed is None
    assert p.max_tokens >= 1
    assert p.ignore_eos is False
    assert p.stop_token_ids == []


def test_default_stop_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop_token_ids.append(5)
    assert b.stop_token_ids == []


def test_stop_token_ids_are_copied_into_a_list():
    ids = [3, 4]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(9)
    assert p.stop_token_ids == [3, 4]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(max_tokens=1),
        dict(seed=0),
        dict(seed=2**40),
        dict(ignore_eos=True, stop_token_ids=[1, 2]),
    ],
)
def test_valid_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", -1e-9),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.0001),
        ("top_p", 2.0),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", -100),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", math.nan),
        ("seed", "42"),
        ("seed", 1.5),
        ("temperature", "0.5"),
        ("top_p", "0.9"),
        ("repetition_penalty", None),
        ("presence_penalty", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 3),
    ],
)
def test_invalid_values_raise_a_useful_value_error(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert field in msg, f"message does not name the field: {msg!r}"
    assert repr(value) in msg or str(value) in msg, f"message does not show the value: {msg!r}"


@pytest.mark.parametrize("value", [math.nan, -math.inf])
def test_non_finite_temperature_is_rejected(value):
    """NaN passes a plain ``< 0`` check and would turn every row's logits into NaN."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)
