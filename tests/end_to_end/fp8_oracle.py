"""The oracle of FP8 weights: Hugging Face models whose decoder linears (and experts) compute what
nanovllm's FP8 layers compute, each e4m3 product exact, and the FP8 checkpoint formats (128 x 128
blocks as Qwen3-*-FP8, one scale per tensor as AutoFP8) written from a random checkpoint."""

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from nanovllm import SamplingParams
from nanovllm.kernels.fp8 import (
    quantize_per_token_group_ref,
    quantize_weight_blockwise_ref,
    quantize_weight_per_channel_ref,
)

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ROW_PARALLEL = ("o_proj", "down_proj")  # their input is split across ranks
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def exact_fp8_product(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``x [rows, in]`` rounded to e4m3 per row, times the e4m3 ``w_fp8 [out, in]`` scaled per
    output row (``w_scale [out]``) or as a whole (one scale): exact in float64, rounded once to
    ``x``'s dtype."""
    x_fp8, x_scale = quantize_per_token_group_ref(x, group=x.shape[-1])
    exact = (x_fp8.double() @ w_fp8.double().T) * x_scale.double() * w_scale.double()
    return exact.to(x.dtype)


def scaled_fp8_forward(w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, parts: int):
    """A linear layer's forward as nanovllm's FP8 layer computes it from an e4m3 weight with a
    scale per output row or per tensor, on ``parts`` ranks: each rank's slice of the input rounded
    per token, its product exact, rounded; the partial products summed in rank order."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows, y = x.reshape(-1, x.shape[-1]), 0
        for x_part, w_part in zip(rows.chunk(parts, dim=-1), w_fp8.chunk(parts, dim=-1)):
            y = y + exact_fp8_product(x_part, w_part, w_scale)
        return (y + (bias if bias is not None else 0)).view(*x.shape[:-1], -1)

    return forward


def fp8_forward(weight: torch.Tensor, bias: torch.Tensor | None, parts: int):
    """:func:`scaled_fp8_forward` of ``weight`` quantized per output channel
    (``quantization="fp8"``)."""
    return scaled_fp8_forward(*quantize_weight_per_channel_ref(weight), bias, parts)


def hf_fp8_model(model_or_dir, tp: int = 1):
    """A Hugging Face model whose decoder linears compute what nanovllm's FP8 layers compute."""
    from transformers import AutoModelForCausalLM

    model = model_or_dir
    if isinstance(model_or_dir, str):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    for name, module in model.model.layers.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != "gate":
            parts = tp if name.endswith(ROW_PARALLEL) else 1
            module.forward = fp8_forward(module.weight.data, module.bias, parts)
    return model


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int = 12) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def experts_on_ranks(parts: int, expert_output):
    """Hugging Face's ``Qwen3MoeExperts.forward`` loop as nanovllm runs it on ``parts`` ranks:
    ``expert_output(e, x, rows)`` is expert ``e``'s down projection for the tokens ``x`` through
    its intermediate rows ``rows`` (the rank's slice); per rank HF's loop weights and sums a
    token's expert outputs (fp32 here: with two experts, the single rounding of nanovllm's fp32
    sum), and the ranks' sums are then added in rank order."""

    def forward(hidden_states, top_k_index, top_k_weights):
        assert top_k_index.shape[1] <= 2  # beyond two experts HF's sum rounds more often
        final = torch.zeros_like(hidden_states)
        for rank in range(parts):
            partial = torch.zeros_like(hidden_states)
            for e in top_k_index.unique().tolist():
                top_k_pos, token_idx = torch.where(top_k_index.t() == e)
                y = expert_output(e, hidden_states[token_idx], rank)
                partial.index_add_(0, token_idx, y * top_k_weights[token_idx, top_k_pos, None])
            final = final + partial
        return final

    return forward


def fp8_experts_forward(experts: nn.Module, parts: int):
    """:func:`experts_on_ranks` as nanovllm's FP8 experts (``quantization="fp8"``) compute: each
    expert's gate / up / down rows in e4m3 with a scale per whole row (down's rows then split
    across ranks), each projection's input rounded to e4m3 per row (down's: each rank's slice of
    ``silu(gate) * up``), each product exact (float64), rounded to the dtype."""
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    gate_up_fp8, gate_up_scale = quantize_weight_per_channel_ref(gate_up.reshape(-1, hidden))
    gate_up_fp8, gate_up_scale = gate_up_fp8.view(gate_up.shape), gate_up_scale.view(num_experts, two_inter)
    down_fp8, down_scale = quantize_weight_per_channel_ref(down.reshape(-1, inter))
    down_fp8, down_scale = down_fp8.view(down.shape), down_scale.view(num_experts, hidden)
    size = inter // parts

    def expert_output(e: int, x: torch.Tensor, rank: int) -> torch.Tensor:
        gate_rows = slice(rank * size, (rank + 1) * size)
        up_rows = slice(inter + rank * size, inter + (rank + 1) * size)
        gate = exact_fp8_product(x, gate_up_fp8[e, gate_rows], gate_up_scale[e, gate_rows])
        up = exact_fp8_product(x, gate_up_fp8[e, up_rows], gate_up_scale[e, up_rows])
        return exact_fp8_product(experts.act_fn(gate) * up, down_fp8[e][:, gate_rows], down_scale[e])

    return experts_on_ranks(parts, expert_output)


def hf_fp8_moe_model(model_or_dir, tp: int = 1):
    """:func:`hf_fp8_model` with its experts computing what nanovllm's FP8 experts compute (the
    router untouched)."""
    model = hf_fp8_model(model_or_dir, tp)
    patched = 0
    for layer in model.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.forward = fp8_experts_forward(experts, tp)
            patched += 1
    assert patched == 2
    return model


def write_fp8_block_checkpoint(source: str, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``source``'s checkpoint as Qwen3-*-FP8 ships: each decoder linear's weight in e4m3 with
    its 128 x 128 blocks' ``weight_scale_inv``; returns those, by weight name."""

    tensors, quantized = load_file(os.path.join(source, "model.safetensors")), {}
    for name in list(tensors):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            weight, scale_inv = quantize_weight_blockwise_ref(tensors[name])
            tensors[name], tensors[name + "_scale_inv"] = weight, scale_inv
            quantized[name] = (weight, scale_inv)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(source, "generation_config.json"), path)
    return quantized


def block_forward(weight_fp8: torch.Tensor, scale_inv: torch.Tensor, bias, parts: int):
    """What nanovllm's FP8 block layer computes on ``parts`` ranks (float64 inside)."""
    weight = (
        weight_fp8.double()
        * scale_inv.double()
        .repeat_interleave(128, 0)
        .repeat_interleave(128, 1)[: weight_fp8.shape[0], : weight_fp8.shape[1]]
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows, y = x.reshape(-1, x.shape[-1]), 0
        for x_part, w_part in zip(rows.chunk(parts, dim=-1), weight.chunk(parts, dim=-1)):
            x_fp8, x_scales = quantize_per_token_group_ref(x_part, group=128)
            x_deq = x_fp8.double() * x_scales.double().repeat_interleave(128, 1)[:, : x_part.shape[-1]]
            y = y + (x_deq @ w_part.T).to(x.dtype)
        return (y + (bias if bias is not None else 0)).view(*x.shape[:-1], -1)

    return forward


def block_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 per token and 128 features, times the dequantized float64 ``weight``,
    rounded once to ``x``'s dtype: an FP8 block layer's product."""
    x_fp8, x_scales = quantize_per_token_group_ref(x, group=128)
    x_deq = x_fp8.double() * x_scales.double().repeat_interleave(128, 1)[:, : x.shape[-1]]
    return (x_deq @ weight.T).to(x.dtype)


def dequantize_blocks(weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """An FP8 checkpoint's e4m3 weight times its 128 x 128 blocks' scales, in float64."""
    rows, cols = weight_fp8.shape
    scales = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    return weight_fp8.double() * scales


def block_experts_forward(experts: nn.Module, prefix: str, quantized: dict, parts: int):
    """:func:`experts_on_ranks` as nanovllm's experts compute an FP8 block checkpoint's
    (``quantized``: :func:`write_fp8_block_checkpoint`'s, ``prefix``: the layer's ``...mlp``):
    each projection's input rounded per token and 128 features (down's: each rank's slice), the
    product with the dequantized weight in float64, rounded."""
    num_experts = experts.gate_up_proj.shape[0]

    def weights(name: str) -> list[torch.Tensor]:
        names = [f"{prefix}.experts.{e}.{name}.weight" for e in range(num_experts)]
        return [dequantize_blocks(*quantized[n]) for n in names]

    gate, up, down = weights("gate_proj"), weights("up_proj"), weights("down_proj")
    size = gate[0].shape[0] // parts

    def expert_output(e: int, x: torch.Tensor, rank: int) -> torch.Tensor:
        rows = slice(rank * size, (rank + 1) * size)
        h = experts.act_fn(block_product(x, gate[e][rows])) * block_product(x, up[e][rows])
        return block_product(h, down[e][:, rows])

    return experts_on_ranks(parts, expert_output)


def tensor_experts_forward(experts: nn.Module, prefix: str, quantized: dict, parts: int):
    """:func:`experts_on_ranks` as nanovllm's experts compute a per-tensor FP8 checkpoint's
    (``quantized``: :func:`write_fp8_tensor_checkpoint`'s): each expert tensor's e4m3 values with
    its one scale, the inputs rounded per row (down's: each rank's slice), each product exact."""
    num_experts = experts.gate_up_proj.shape[0]

    def weights(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [quantized[f"{prefix}.experts.{e}.{name}.weight"] for e in range(num_experts)]

    gate, up, down = weights("gate_proj"), weights("up_proj"), weights("down_proj")
    size = gate[0][0].shape[0] // parts

    def expert_output(e: int, x: torch.Tensor, rank: int) -> torch.Tensor:
        rows = slice(rank * size, (rank + 1) * size)
        (gate_fp8, gate_scale), (up_fp8, up_scale), (down_fp8, down_scale) = gate[e], up[e], down[e]
        h = experts.act_fn(exact_fp8_product(x, gate_fp8[rows], gate_scale))
        h = h * exact_fp8_product(x, up_fp8[rows], up_scale)
        return exact_fp8_product(h, down_fp8[:, rows], down_scale)

    return experts_on_ranks(parts, expert_output)


def checkpoint_twin(source: str, quantized: dict, parts: int, blocks: bool):
    """HF's model of ``source`` whose decoder linears and experts compute what nanovllm computes
    on ``parts`` ranks from the FP8 checkpoint written from it (``quantized``: by 128 x 128
    ``blocks`` or one scale per tensor)."""
    from transformers import AutoModelForCausalLM

    linear_forward = block_forward if blocks else scaled_fp8_forward
    experts_forward = block_experts_forward if blocks else tensor_experts_forward
    twin = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    twin.generation_config.eos_token_id = None
    for name, module in twin.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            split = parts if name.endswith(ROW_PARALLEL) else 1
            module.forward = linear_forward(*quantized[name + ".weight"], module.bias, split)
        elif name.endswith("mlp.experts"):
            module.forward = experts_forward(module, name.rsplit(".", 1)[0], quantized, parts)
    return twin


def assert_greedy_up_to_near_ties(exact, plain, exact_bf16, prompts, completions) -> tuple[int, int, int]:
    """Teacher-forced on ``completions`` (greedy runs on CUDA, where fp8 tensor cores keep ~14 bits
    in their sums, so a random model's near-ties may go either way): each token ``exact``'s argmax
    (HF with the same rounding, each product exact), or within a twentieth of the FP8 rounding's
    own effect on the logits (``exact`` against the unquantized ``plain``) of it; with
    ``exact_bf16`` (``exact`` in bf16), plus bf16's effect on the FP8 model (it against
    ``exact``). Returns (tokens that are ``exact``'s argmax, ``plain``'s argmax, all tokens)."""
    argmax = unquantized = total = 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions):
            ids, tokens = torch.tensor([prompt + completion[:-1]]), torch.tensor(completion)
            ref = exact(ids).logits[0, len(prompt) - 1 :]
            plain_logits = plain(ids).logits[0, len(prompt) - 1 :]
            allowed = 0.05 * (ref - plain_logits).abs().max()
            if exact_bf16 is not None:
                allowed += (exact_bf16(ids).logits[0, len(prompt) - 1 :].float() - ref).abs().max()
            gaps = ref.max(dim=1).values - ref.gather(1, tokens[:, None])[:, 0]
            assert (gaps <= allowed).all(), (gaps.max().item(), allowed.item())
            argmax += int((gaps == 0).sum())
            unquantized += int((plain_logits.argmax(dim=1) == tokens).sum())
            total += len(completion)
    return argmax, unquantized, total


def assert_close_to_twin(
    twin, prompts: list[list[int]], llm, max_gap: float = 0.25, close: float = 0.95, agree: float = 0.97
) -> None:
    """``llm``'s log-probabilities of the twin's greedy completions, teacher-forced, position by
    position: rounding activations to e4m3 turns the last-ulp differences between two float32
    implementations of attention and norms (1e-6 here) into an occasional different e4m3 value,
    so whole greedy runs may part. Each position within ``max_gap`` (a flipped e4m3 value moves a
    dense model's log-probability by ~0.1 at most here), a share ``close`` of them within 1e-4,
    ``agree`` with the same argmax."""
    sequences = [p + c for p, c in zip(prompts, hf_generate(twin, prompts))]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    same = total = within = 0
    for sequence, output in zip(sequences, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(twin(torch.tensor([sequence])).logits[0, :-1].float(), dim=-1)
        ours = torch.tensor([lp[t].logprob for lp, t in zip(output.prompt_logprobs[1:], sequence[1:])])
        gap = (ours - reference.gather(1, torch.tensor(sequence[1:])[:, None]).squeeze(1)).abs()
        assert gap.max() < max_gap, gap.max()
        within += int((gap < 1e-4).sum())
        top = [
            max(lp, key=lambda t: lp[t].logprob if lp[t].rank == 1 else float("-inf"))
            for lp in output.prompt_logprobs[1:]
        ]
        same += sum(a == b for a, b in zip(top, reference.argmax(dim=-1).tolist()))
        total += len(top)
    assert within >= close * total and same >= agree * total, (within, same, total)


def write_fp8_tensor_checkpoint(source: str, path: str, scale_shape: tuple = ()) -> dict:
    """``source``'s checkpoint as AutoFP8 writes a dynamic one: each decoder linear's weight in
    e4m3 with one float32 ``weight_scale`` for the whole tensor (shape ``scale_shape``), the LM
    head left as it is; returns ``(e4m3 weight, scale)`` by weight name."""

    tensors, quantized = load_file(os.path.join(source, "model.safetensors")), {}
    for name in list(tensors):
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            weight = tensors[name].float()
            scale = (weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
            tensors[name] = (weight / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            tensors[name + "_scale"] = scale.reshape(scale_shape)
            quantized[name] = (tensors[name], scale)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(source, "generation_config.json"), path)
    return quantized
