"""Weights in, manifest and slot views out.

A module, a TensorDict or a state_dict becomes a flat ``{key: tensor}`` mapping (keys
are tuples of strings; nested TensorDict keys and dotted module names both map there)
and a `Layout`: every tensor at a 256-byte-aligned offset inside one slot, slots rounded
to whole pages. Parameters *and* buffers travel (BatchNorm statistics, int64 counters),
so a worker computes exactly what the trainer would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._errors import LayoutMismatch
from ._protocol import ALIGN, DTYPES, TensorSpec, contiguous_stride

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = ["Key", "Layout", "flatten", "to_tensordict", "torch_dtype"]

Key = tuple[str, ...]
PAGE = 4096

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name (a fixed table, never getattr on input)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise LayoutMismatch(f"dtype {name} is not supported by this torch build") from None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def flatten(weights: Any) -> dict[Key, torch.Tensor]:
    """``{key: tensor}`` for a module (parameters and buffers), TensorDict or state_dict.

    Raises:
        TypeError: `weights` is none of the accepted kinds, or holds a non-tensor.
    """
    if isinstance(weights, torch.nn.Module):
        items = [*weights.named_parameters(), *weights.named_buffers()]
        flat = {tuple(name.split(".")): t.detach() for name, t in items}
    elif _is_tensordict(weights):
        flat = {}
        for k, v in weights.items(include_nested=True, leaves_only=True):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"TensorDict entry {k!r} is a {type(v).__name__}, not a tensor")
            flat[(k,) if isinstance(k, str) else tuple(k)] = v.detach()
    elif isinstance(weights, Mapping):
        flat = {}
        for k, v in weights.items():
            if isinstance(k, str):
                key = tuple(k.split("."))
            elif isinstance(k, tuple) and all(isinstance(part, str) for part in k):
                key = k
            else:
                raise TypeError(f"state_dict key {k!r} must be a str or a tuple of str")
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"state_dict entry {k!r} is a {type(v).__name__}, not a tensor")
            flat[key] = v.detach()
    else:
        raise TypeError(
            "weights must be an nn.Module, a TensorDict or a state_dict mapping, "
            f"not {type(weights).__name__}"
        )
    if not flat:
        raise ValueError("weights hold no tensors: nothing to publish")
    return flat


def _is_tensordict(obj: Any) -> bool:
    """Without importing tensordict (it imports torch._dynamo: seconds of start-up)."""
    if not type(obj).__module__.startswith("tensordict"):
        return False
    from tensordict import TensorDictBase

    return isinstance(obj, TensorDictBase)


def to_tensordict(flat: Mapping[Key, torch.Tensor]) -> TensorDictBase:
    """A (nested) TensorDict sharing the tensors of `flat`."""
    from tensordict import TensorDict

    td = TensorDict({}, batch_size=[])
    for key, value in flat.items():
        td.set(key if len(key) > 1 else key[0], value)
    return td


@dataclass(frozen=True)
class Layout:
    """Where each tensor sits in a slot. Built once by the publisher, sent in WELCOME."""

    specs: tuple[TensorSpec, ...]
    slot_bytes: int

    @classmethod
    def of(
        cls, flat: Mapping[Key, torch.Tensor], buffers: Mapping[Key, int] | None = None
    ) -> Layout:
        """Lay `flat` out in one slot.

        Args:
            flat: the tensors, in the order they get their offsets.
            buffers: key -> index of the buffer that holds the tensor (one buffer per
                device); None or a key not listed: buffer 0, the CPU segment. Every
                buffer uses the same offsets, so the CPU segment can hold a copy of any
                tensor at its place.
        """
        specs, offset = [], 0
        for key, tensor in flat.items():
            if tensor.dtype not in _DTYPE_NAMES:
                raise TypeError(f"{'.'.join(key)}: dtype {tensor.dtype} cannot be published")
            nbytes = tensor.numel() * tensor.element_size()
            shape = tuple(tensor.shape)
            specs.append(
                TensorSpec(
                    key=key,
                    dtype=_DTYPE_NAMES[tensor.dtype],
                    shape=shape,
                    stride=contiguous_stride(shape),
                    offset=offset,
                    nbytes=nbytes,
                    buffer=buffers.get(key, 0) if buffers else 0,
                )
            )
            offset = _round_up(offset + nbytes, ALIGN)
        return cls(tuple(specs), max(PAGE, _round_up(offset, PAGE)))

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in one version (without padding)."""
        return sum(spec.nbytes for spec in self.specs)

    def check(self, flat: Mapping[Key, torch.Tensor]) -> None:
        """Raise LayoutMismatch naming the first difference between `flat` and the layout."""
        expected = [spec.key for spec in self.specs]
        known = set(expected)
        missing = [k for k in expected if k not in flat]
        extra = [k for k in flat if k not in known]
        if missing or extra:
            what = f"missing key {'.'.join(missing[0])!r}" if missing else ""
            what = what or f"unexpected key {'.'.join(extra[0])!r}"
            raise LayoutMismatch(
                f"publish() got other keys than the bus was created with: {what}; "
                "publish tensors with the same keys, or start a new Publisher"
            )
        for spec in self.specs:
            tensor = flat[spec.key]
            dtype = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
            if tuple(tensor.shape) != spec.shape or dtype != spec.dtype:
                raise LayoutMismatch(
                    f"{spec.name}: got {dtype}{list(tensor.shape)}, the bus carries "
                    f"{spec.dtype}{list(spec.shape)}; publish the same shapes and dtypes, "
                    "or start a new Publisher"
                )

    def views(self, slot: torch.Tensor, buffer: int | None = None) -> dict[Key, torch.Tensor]:
        """Typed views of every tensor inside `slot` (a flat uint8 tensor).

        With `buffer`, only of the tensors that buffer holds.
        """
        out = {}
        for spec in self.specs:
            if buffer is not None and spec.buffer != buffer:
                continue
            raw = slot[spec.offset : spec.offset + spec.nbytes]
            out[spec.key] = raw.view(torch_dtype(spec.dtype)).view(spec.shape)
        return out
