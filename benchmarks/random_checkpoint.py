"""The folder each engine of ``bench.py`` loads: the user's checkpoint, or a config-only one of
a model shape (random weights), with a tokenizer that fills the logits where the workload needs
text (``--tokenizer``, ``--structured``), and an FP8 checkpoint's ``quantization_config`` with
``--fp8-checkpoint``."""

import hashlib
import os
import shutil
import tempfile
import time

from nanovllm import demo_models
from nanovllm.demo_models import SHAPES, write_config


def model_dir(args) -> tuple[str, bool]:
    """The checkpoint to use, and whether it is a config-only folder (random weights); with
    ``--tokenizer`` (or ``--structured``) the folder also has a tokenizer that fills the logits."""
    if args.model:
        return os.path.expanduser(args.model), False
    path = tempfile.mkdtemp(prefix="nanovllm-bench-")
    options = checkpoint_quantization(args)
    if args.tokenizer:
        start = time.perf_counter()
        options["eos_token_id"] = copy_bench_tokenizer(path, SHAPES[args.shape]["vocab_size"])
        print(f"tokenizer: {time.perf_counter() - start:.1f} s", flush=True)
    write_config(path, args.shape, **options)
    return path, True


_EOS_FILE = "eos_token_id"


def copy_bench_tokenizer(path: str, vocab_size: int) -> int:
    """Write :func:`~nanovllm.demo_models.write_large_tokenizer`'s tokenizer into ``path``; return
    its EOS id. It is deterministic but takes 10-20 s, so each machine builds it once per vocabulary
    size and version of ``demo_models.py`` (in the temp folder) and every process copies it."""
    with open(demo_models.__file__, "rb") as f:
        version = hashlib.sha256(f.read()).hexdigest()[:12]
    cache = os.path.join(tempfile.gettempdir(), f"nanovllm-bench-tokenizer-{vocab_size}-{version}")
    if not os.path.isdir(cache):
        building = tempfile.mkdtemp(prefix="nanovllm-bench-tokenizer-")
        eos = demo_models.write_large_tokenizer(building, vocab_size)
        with open(os.path.join(building, _EOS_FILE), "w") as f:
            f.write(str(eos))
        try:
            os.rename(building, cache)  # whole or not at all
        except OSError:  # another process's is there already
            shutil.rmtree(building, ignore_errors=True)
    for name in os.listdir(cache):
        if name != _EOS_FILE:
            shutil.copy(os.path.join(cache, name), path)
    with open(os.path.join(cache, _EOS_FILE)) as f:
        return int(f.read())


def checkpoint_quantization(args) -> dict:
    """``--fp8-checkpoint``: the random-weight folder's config declares an FP8 checkpoint with
    128 x 128 block scales, as Qwen3-*-FP8's does, so each engine builds its block-scaled layers."""
    if not args.fp8_checkpoint:
        return {}
    block = dict(quant_method="fp8", activation_scheme="dynamic", fmt="e4m3", weight_block_size=[128, 128])
    return dict(quantization_config=block)
