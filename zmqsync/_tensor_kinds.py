"""Which tensors can travel through a slot, and a one-line refusal for the others.

A slot holds plain, strided, dense bytes, copied by address. A tensor that is not that
(a subclass that wraps other tensors, a quantized, nested or sparse tensor, a meta or
fake tensor without data, memory the bus cannot map) has no such bytes: copying from its
data pointer reads garbage or crashes the process. So every tensor is looked at once,
where the weights come in (`flatten` at a publisher's or a worker's start), and refused
by name with what to do instead.

A DTensor is the one subclass with a meaning here: a publisher built from DTensors is
collective over their mesh (see `_shards`), and a worker's model of DTensors takes its
slices (see `_shard_reads`). Anywhere it is not expected, it is refused like the others.

A publish re-reads the weights every time: there only the type is compared (`odd_type`,
one lookup per tensor), which is what would crash the copy.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_kinds", "is_dtensor", "odd_type", "refusal"]

# The types a slot takes as they are: a Parameter is a plain tensor with a flag.
_PLAIN: frozenset[type] = frozenset({torch.Tensor, torch.nn.Parameter})
_DEVICES = frozenset({"cpu", "cuda"})


def is_dtensor(tensor: Any) -> bool:
    """Without importing torch.distributed.tensor unless a subclass is met."""
    if type(tensor) in _PLAIN:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def refusal(tensor: torch.Tensor, *, sharded: bool = False) -> str | None:
    """Why `tensor` cannot travel through a slot (None: it can). `sharded`: a DTensor
    is expected (a sharded publisher's own weights)."""
    kind = type(tensor)
    if kind not in _PLAIN:
        return _odd_subclass(tensor, sharded)
    if tensor.is_meta:
        return (
            "is on the meta device and has no data; materialize it first (to_empty() and "
            "an init, or load a state_dict)"
        )
    if tensor.is_quantized:
        return (
            "is a quantized tensor; send its dequantize() or its int_repr() and scales as "
            "plain tensors"
        )
    if tensor.is_nested:
        return "is a nested tensor; send its components (unbind()) as plain tensors"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}; send its to_dense(), or its parts, as plain tensors"
    if tensor.device.type not in _DEVICES:
        return (
            f"is on {tensor.device}, which the bus cannot map (CPU and CUDA memory only); "
            "move it to one of those"
        )
    return None


def _odd_subclass(tensor: torch.Tensor, sharded: bool) -> str | None:
    kind = type(tensor)
    if is_dtensor(tensor):
        if sharded:
            return None
        return (
            "is a DTensor: a Publisher takes DTensors (each rank writes its shards) and a "
            "worker's model may hold them (each rank takes its slice); here plain tensors "
            "are expected (full_tensor(), or a full state_dict)"
        )
    if kind.__name__ == "NestedTensor":
        return "is a nested tensor; send its components (unbind()) as plain tensors"
    if kind.__name__ == "FakeTensor":
        return "is a FakeTensor and has no data; publish real tensors (outside FakeTensorMode)"
    return (
        f"is a {kind.__module__}.{kind.__qualname__}, a tensor subclass whose bytes are not "
        "its values; send plain tensors (its dense values or its parts)"
    )


def check_kinds(flat: dict[tuple[str, ...], torch.Tensor], *, sharded: bool = False) -> None:
    """Raise TypeError naming the first tensor of `flat` that cannot travel.

    Raises:
        TypeError: one line: the tensor's name, what it is, what to do.
    """
    for key, tensor in flat.items():
        why = refusal(tensor, sharded=sharded)
        if why is not None:
            raise TypeError(f"{'.'.join(key)!r} {why}")


def odd_type(flat: dict[tuple[str, ...], torch.Tensor], *, sharded: bool = False) -> None:
    """The cheap check of every publish: TypeError for a tensor of another type than a
    plain tensor (or, for a sharded publisher, a DTensor)."""
    plain = _PLAIN
    for key, tensor in flat.items():
        if type(tensor) not in plain:
            why = _odd_subclass(tensor, sharded)
            if why is not None:
                raise TypeError(f"{'.'.join(key)!r} {why}")
