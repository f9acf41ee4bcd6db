"""Data parallelism on Ray: N engine replicas (each an ``LLM``, maybe tensor-parallel over its
own GPUs) as Ray actors, fed balanced chunks of prompts; and a callable class for
``ray.data.Dataset.map_batches``. Needs the ``ray`` extra: ``pip install -e ".[ray]"``."""

import os
import warnings
from collections import deque

from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams

CHUNKS_PER_REPLICA = 4  # smaller chunks balance the replicas; larger ones batch better


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError('nanovllm\'s replicas need Ray: pip install -e ".[ray]"') from e
    return ray


class _Replica:
    """One engine inside a Ray actor."""

    def __init__(self, model: str, options: dict):
        from nanovllm import LLM

        self.llm = LLM(model, **options)

    def pid(self) -> int:
        return os.getpid()

    def generate(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        return self.llm.generate(prompts, params, use_tqdm=False)

    def exit(self) -> None:
        self.llm.exit()


class LLMReplicas:
    """``num_replicas`` engines of ``model`` as Ray actors, each built with ``LLM(model,
    **options)``. Each takes ``num_gpus_per_replica`` GPUs (default: its
    ``tensor_parallel_size`` on a GPU, none with ``device="cpu"``), so Ray places replicas on
    any machine of the cluster with room for them. Connects to the running Ray instance, or
    starts a local one. Use as a context manager, or call :meth:`shutdown`.
    """

    def __init__(
        self,
        model: str,
        num_replicas: int,
        num_gpus_per_replica: float | None = None,
        num_cpus_per_replica: float = 1,
        **options,
    ):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
        ray = _ray()
        self.owns_ray = not ray.is_initialized()  # started here, so stopped by shutdown()
        if self.owns_ray:
            ray.init()
        if num_gpus_per_replica is None:
            on_cpu = options.get("device") == "cpu"
            num_gpus_per_replica = 0 if on_cpu else options.get("tensor_parallel_size", 1)
        resources = dict(num_gpus=num_gpus_per_replica, num_cpus=num_cpus_per_replica, max_restarts=0)
        actor = ray.remote(**resources)(_Replica)
        self.replicas = [actor.remote(model, options) for _ in range(num_replicas)]
        self.pids = ray.get([r.pid.remote() for r in self.replicas])  # raises if an engine cannot start
        self.dead: dict[int, str] = {}
        """Replicas that died, by index, with the cause Ray reported."""

    def generate(
        self,
        prompts: list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt on the replicas; outputs in prompt order, one progress bar.

        Prompts go out in chunks, a replica taking the next chunk as soon as it is free. When a
        replica dies its chunk is retried once on the others (with a warning naming the
        cause); a chunk failing twice, or no replica left, raises ``RuntimeError``.
        """
        from tqdm.auto import tqdm

        ray = _ray()
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        size = max(1, -(-len(prompts) // (len(self.replicas) * CHUNKS_PER_REPLICA)))
        todo = deque((start, min(start + size, len(prompts)), 0) for start in range(0, len(prompts), size))
        results: list[RequestOutput | None] = [None] * len(prompts)
        running = {}  # object ref -> (replica index, chunk)
        idle = [i for i in range(len(self.replicas)) if i not in self.dead]
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while todo or running:
                while todo and idle:
                    i, (start, end, tries) = idle.pop(), todo.popleft()
                    ref = self.replicas[i].generate.remote(prompts[start:end], params[start:end])
                    running[ref] = (i, (start, end, tries))
                if not running:
                    raise RuntimeError(f"every replica died; causes: {self.dead}")
                (ref,), _ = ray.wait(list(running), num_returns=1)
                i, (start, end, tries) = running.pop(ref)
                try:
                    results[start:end] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    self.dead[i] = str(error).splitlines()[0]
                    message = f"replica {i} (pid {self.pids[i]}) died: {self.dead[i]}"
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
                    if tries:
                        raise RuntimeError(f"prompts {start}..{end - 1} failed on two replicas") from error
                    todo.appendleft((start, end, tries + 1))
                    continue
                idle.append(i)
                bar.update(end - start)
        return results

    def shutdown(self) -> None:
        """Stop every replica's engine and actor. Idempotent."""
        ray = _ray()
        for i, replica in enumerate(self.replicas):
            if i not in self.dead:
                try:
                    ray.get(replica.exit.remote(), timeout=60)
                except Exception:  # noqa: BLE001 (dying anyway: the kill below ends it)
                    pass
            ray.kill(replica)
        self.replicas, self.dead = [], {}
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
            self.owns_ray = False

    def __enter__(self) -> "LLMReplicas":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


class LLMPredictor:
    """For ``ray.data.Dataset.map_batches``: one engine per instance, completing the batch's
    ``prompt_column`` (strings or token-id lists) and adding ``generated_text`` and
    ``generated_token_ids`` columns. Pass the model and options with ``fn_constructor_kwargs``
    and the number of replicas with ``concurrency``.
    """

    def __init__(
        self,
        model: str,
        sampling_params: SamplingParams | None = None,
        prompt_column: str = "prompt",
        **options,
    ):
        from nanovllm import LLM

        self.llm = LLM(model, **options)
        self.params = sampling_params or SamplingParams()
        self.column = prompt_column

    def __call__(self, batch: dict) -> dict:
        prompts = [p.tolist() if hasattr(p, "tolist") else p for p in batch[self.column]]
        outputs = self.llm.generate(prompts, self.params, use_tqdm=False)
        return {
            **batch,
            "generated_text": [o.outputs[0].text for o in outputs],
            "generated_token_ids": [o.outputs[0].token_ids for o in outputs],
        }
