"""Calls run on every tensor-parallel rank (vLLM's ``collective_rpc``): what a call is, how it
travels to the workers (a callable by value, with cloudpickle) and how results come back."""

import pickle
import traceback
from collections.abc import Callable
from typing import Any


def encode_call(method: str | Callable, args: tuple, kwargs: dict) -> bytes:
    """A call as bytes for the workers; callables (lambdas included), in ``method`` or among the
    arguments, travel by value."""
    import cloudpickle

    return cloudpickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def run_call(target, method: str | Callable, args: tuple, kwargs: dict) -> Any:
    """``target.method(*args, **kwargs)``, or ``method(target, *args, **kwargs)`` for a callable."""
    if isinstance(method, str):
        function = getattr(target, method, None)
        if not callable(function):
            raise AttributeError(f"the worker has no method {method!r}")
        return function(*args, **kwargs)
    return method(target, *args, **kwargs)


def run_encoded(target, call: bytes) -> bytes:
    """Run an encoded call; its result or error, encoded for the way back."""
    try:
        method, args, kwargs = pickle.loads(call)
        return pickle.dumps((True, run_call(target, method, args, kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as error:  # sent back: the caller raises it, naming the rank
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        return pickle.dumps((False, text), protocol=pickle.HIGHEST_PROTOCOL)


def decode_result(rank: int, data: bytes) -> Any:
    ok, value = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"collective_rpc failed on tensor-parallel rank {rank}: {value}")
    return value


def result_key(call_id: int, rank: int) -> str:
    return f"rpc/{call_id}/{rank}"
