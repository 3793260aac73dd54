"""Read what a vLLM engine computes with, from inside a worker; and the same from a
state_dict, to compare.

On the CPU, vLLM packs each linear layer's weight for its GEMM kernel (oneDNN or its
own) after loading and leaves ``layer.weight`` empty: the packed copy is what computes.
`engine_digests` reads those through the kernel itself: ``cpu_linear(I)`` with an
identity matrix gives ``W^T`` exactly (each output is one product by 1.0 plus exact
zeros, accumulated in fp32, and the result is a bf16 value), so a layer whose packed
copy went stale would show it. Tensors vLLM keeps (embeddings, norms, lm_head) are read
as they are.

`expected_digests` fuses a checkpoint state_dict the way vLLM's Llama does (qkv_proj =
q, k, v stacked; gate_up_proj = gate, up) and hashes it the same way.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def engine_digests(worker: Any) -> dict[str, str]:
    """``{parameter name: sha256}`` of what the worker's model computes with."""
    model = worker.model_runner.model
    out: dict[str, str] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor):
                continue
            if weight.numel() == 0 and hasattr(module, "cpu_linear"):
                k = module.input_size_per_partition
                eye = torch.eye(k, dtype=module.params_dtype)
                weight = module.cpu_linear(eye, module.weight, None).t()
            out[f"{name}.weight"] = digest(weight)
    return out


# tensor parallel: these are split along their input dimension (RowParallelLinear); the
# other matrices along their output dimension (column parallel, vocab parallel); vectors
# (norms) are whole on every rank
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def shard(state: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    """What tensor-parallel rank `rank` of `world` holds of each checkpoint tensor."""
    if world == 1:
        return state
    out = {}
    for name, t in state.items():
        if t.dim() == 1:
            out[name] = t
        else:
            dim = 1 if any(f".{r}." in name for r in ROW_PARALLEL) else 0
            out[name] = t.chunk(world, dim)[rank]
    return out


def expected_digests(
    state: dict[str, torch.Tensor], rank: int = 0, world: int = 1
) -> dict[str, str]:
    """The digests `engine_digests` reads from rank `rank` of an engine loaded with `state`."""
    state = shard(state, rank, world)
    fused: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        for target, parts in FUSED.items():
            if f".{parts[0]}." in name:
                prefix = name.split(f".{parts[0]}.")[0]
                fused[f"{prefix}.{target}.weight"] = torch.cat(
                    [state[f"{prefix}.{p}.weight"] for p in parts]
                )
        if not any(f".{p}." in name for parts in FUSED.values() for p in parts):
            fused[name] = t
    return {name: digest(t) for name, t in fused.items()}
