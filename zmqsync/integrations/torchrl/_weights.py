"""What a torchrl weight sync scheme publishes, found the way torchrl's own schemes find
it: the collector's model or policy factories, ``params_map``, payloads and devices."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.weight_update.utils import _resolve_model

from ..._tensor_kinds import is_dtensor

__all__ = [
    "all_on_cpu",
    "check_params_map",
    "find_model",
    "generated_name",
    "materialize",
    "on_cpu",
    "payload",
    "per_worker",
    "private_copy",
    "refuse_sharded",
    "sharded",
    "tensors",
    "workers_on_cpu",
]

EXTRA_STATE = "__extra_state__"  # torchrl's key for module extra state: not a tensor leaf


def generated_name(model_id: str) -> str:
    return f"torchrl-{re.sub(r'[^A-Za-z0-9_.-]', '_', model_id)[:24]}-{secrets.token_hex(4)}"


def find_model(context: Any, model_id: str) -> Any:
    """The collector's model, as torchrl's own schemes find it."""
    get_model: Callable[[str], Any] | None = getattr(context, "get_model", None)
    try:
        model = get_model(model_id) if get_model else _resolve_model(context, model_id)
    except (AttributeError, ValueError):  # no such model (a collector built from factories)
        model = None
    if model is None and model_id == "policy":
        factories = list(getattr(context, "policy_factory", None) or ())
        if any(f is not factories[0] for f in factories):  # each worker its own weights
            return {i: f() for i, f in enumerate(factories) if f is not None}
        model = factories[0]() if factories and factories[0] is not None else None
    return model


def workers_on_cpu(context: Any) -> bool:
    """Whether every worker of the collector computes on the CPU (alias needs it)."""
    devices = getattr(context, "policy_device", None)
    if devices is None:
        return True
    devices = devices if isinstance(devices, list | tuple) else [devices]
    return all(d is None or torch.device(d).type == "cpu" for d in devices)


def check_params_map(params_map: Any) -> dict[int, TensorDictBase]:
    """torchrl's ``params_map``: ``{worker_idx: TensorDict}``, as its schemes check it."""
    if (
        not isinstance(params_map, Mapping)
        or not params_map
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in params_map)
        or not all(isinstance(td, TensorDictBase) for td in params_map.values())
    ):
        raise ValueError("params_map must be a dict[int, TensorDictBase]")
    return dict(params_map)


def per_worker(weights: Any) -> bool:
    """Whether `weights` is ``{worker_idx: weights}`` (torchrl's per-worker form)."""
    return (
        isinstance(weights, Mapping)
        and not isinstance(weights, TensorDictBase)
        and bool(weights)
        and all(isinstance(k, int) and not isinstance(k, bool) for k in weights)
    )


def private_copy(source: Any) -> dict[str, torch.Tensor]:
    """A worker's own weights, to start from: a CPU copy of `source`'s tensors."""
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors(source)}


def payload(weights: Any) -> Any:
    """What Publisher.publish() takes: a module, a TensorDict or a state_dict."""
    if isinstance(weights, nn.Module):
        return weights
    if isinstance(weights, TensorDictBase):
        return weights.exclude(EXTRA_STATE) if EXTRA_STATE in weights.keys() else weights
    if isinstance(weights, Mapping):
        if per_worker(weights):
            raise ValueError("{worker_idx: weights} where one set of weights was expected")
        return weights
    raise TypeError(
        f"weights must be a module, a TensorDict or a state_dict, not {type(weights).__name__}"
    )


def tensors(source: Any) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(source, nn.Module):
        return [*source.named_parameters(), *source.named_buffers()]
    if isinstance(source, TensorDictBase):
        return [
            (".".join(k) if isinstance(k, tuple) else k, v) for k, v in source.items(True, True)
        ]
    return list(source.items())


def sharded(source: Any) -> bool:
    """Whether `source` holds DTensors (FSDP2, tensor parallel): a collective bus."""
    return any(is_dtensor(t) for _, t in tensors(source))


def refuse_sharded(source: Any, context: Any, model_id: str) -> None:
    """Refuse, in one line, the sharded policies torchrl itself cannot run.

    A multi-process collector ships its policy to worker processes outside the trainer's
    process group, where a DTensor's forward (an all-gather, a collective) has no group:
    torchrl's own ``SharedMemWeightSyncScheme`` crashes its workers at start. Checked
    before any bus starts, and before torchrl starts the collector's workers: nothing is
    left behind.

    Raises:
        TypeError: `source` holds DTensors and `context` is a multi-process collector.
    """
    from torchrl.collectors import MultiCollector

    if isinstance(context, MultiCollector) and sharded(source):
        raise TypeError(
            f"model {model_id!r} of {type(context).__name__} holds DTensors (FSDP2 or "
            "tensor parallel): torchrl's worker processes cannot run a sharded policy; "
            "build the scheme's sender over the trainer's model on every rank "
            "(init_on_sender(model=...)) and give the collector a plain policy with "
            "ZmqWeightSyncScheme(name=..., attach=True)"
        )


def all_on_cpu(source: Any) -> bool:
    return all(t.device.type == "cpu" for _, t in tensors(source))


def on_cpu(source: Any) -> Any:
    """The source itself when it is on the CPU, else a CPU copy with the same keys."""
    if all_on_cpu(source):
        return source
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors(source)}


def materialize(model: Any, strategy: Any) -> None:
    """Give meta-device parameters real (CPU) storage: torchrl ships workers a stateless
    policy and expects the scheme to fill it, as SharedMemWeightSyncScheme does."""
    if not isinstance(model, nn.Module):
        return
    weights = TensorDict.from_module(model).data
    if not any(t.is_meta for t in weights.values(True, True)):
        return
    real = weights.apply(lambda t: torch.zeros_like(t, device="cpu") if t.is_meta else t)
    strategy.apply_weights(model, real, inplace=False)
