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
    assert max(offsets[0], b.odd.data_ptr() - base) < min(offsets[1:4])  # 8-byte arrays first


def test_an_array_of_another_dtype_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"odd \(int16\)"):
        upload(torch.device("cpu"), More(odd=np.zeros(3, dtype=np.int16)))
