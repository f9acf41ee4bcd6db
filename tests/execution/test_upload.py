"""upload: a step's host arrays as device tensors of the same values, from one packed buffer."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from nanovllm.execution.upload import upload


@dataclass
class Arrays:
    ints: np.ndarray
    small: np.ndarray
    floats: np.ndarray
    table: np.ndarray
    empty: np.ndarray
    untouched: object = "kept"
    absent: np.ndarray | None = None


@dataclass
class More:
    odd: np.ndarray


def test_every_array_arrives_with_its_values_dtype_and_shape_from_one_buffer() -> None:
    a = Arrays(
        ints=np.array([3, -1, 2**40], dtype=np.int64),
        small=np.array([7, 8, 9], dtype=np.int32),
        floats=np.array([0.5, -2.0], dtype=np.float32),
        table=np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],  # not contiguous
        empty=np.zeros(0, dtype=np.int64),
    )
    b = More(odd=np.array([1, 2, 3, 4, 5], dtype=np.int64))
    host = {name: getattr(a, name).copy() for name in ("ints", "small", "floats", "table", "empty")}
    upload(torch.device("cpu"), a, b)
    for name, values in host.items():
        got = getattr(a, name)
        assert isinstance(got, torch.Tensor) and got.shape == values.shape
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(values)))
    assert torch.equal(b.odd, torch.arange(1, 6))
    assert a.untouched == "kept" and a.absent is None
    tensors = [a.ints, a.small, a.floats, a.table, b.odd]
    base = a.ints.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # one buffer
    offsets = [t.data_ptr() - base for t in tensors]
    assert offsets[0] == 0 and all(o % 16 == 0 for o in offsets)
    assert offsets == sorted(offsets)  # in field order, groups in order


def arrays(rows: int, odd: int) -> tuple[Arrays, More]:
    a = Arrays(
        ints=np.arange(rows, dtype=np.int64),
        small=np.arange(rows, dtype=np.int32) * 2,
        floats=np.ones(rows, dtype=np.float32),
        table=np.zeros((rows, 3), dtype=np.int32),
        empty=np.zeros(0, dtype=np.int64),
    )
    return a, More(odd=np.arange(odd, dtype=np.int64) + 7)


def test_into_a_buffer_the_first_group_lands_at_the_same_addresses_every_time() -> None:
    into = torch.zeros(1024, dtype=torch.uint8)
    upload(torch.device("cpu"), *arrays(4, 3), into=into)  # the others fit: all in `into`
    addresses = None
    for odd in (3, 200):  # 200 int64s do not fit: the second group goes to a buffer of its own
        a, b = arrays(4, odd)
        upload(torch.device("cpu"), a, b, into=into)
        seen = [t.data_ptr() for t in (a.ints, a.small, a.floats, a.table)]
        assert addresses is None or seen == addresses
        addresses = seen
        assert a.ints.untyped_storage().data_ptr() == into.untyped_storage().data_ptr()
        assert a.ints.data_ptr() == into.data_ptr()
        in_into = b.odd.untyped_storage().data_ptr() == into.untyped_storage().data_ptr()
        assert in_into == (odd == 3)
        assert torch.equal(b.odd, torch.arange(odd) + 7) and torch.equal(a.small, torch.arange(4) * 2)
        assert a.table.shape == (4, 3) and torch.equal(a.floats, torch.ones(4))


def test_a_first_group_larger_than_the_buffer_is_refused() -> None:
    a, b = arrays(100, 1)
    with pytest.raises(ValueError, match="the first group's arrays take"):
        upload(torch.device("cpu"), a, b, into=torch.zeros(64, dtype=torch.uint8))


def test_an_array_of_another_dtype_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"odd \(int16\)"):
        upload(torch.device("cpu"), More(odd=np.zeros(3, dtype=np.int16)))
