"""The trainer's weights as a publisher sees them: where each tensor lives, the layout
they are checked against, and how a publish reads them.

Every write mode reads the same way (re-read a module, or take the tensors given, and
check them), so reading lives here once; what differs between modes is how the bytes
then reach a slot (`_write_modes`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ._errors import LayoutMismatch
from ._layout import Key, Layout, ModuleReader, _is_tensordict, flatten
from ._tensor_kinds import is_dtensor

__all__ = ["Source", "cast_to", "trainer_tensors"]


def _tensor_device(tensor: torch.Tensor) -> str:
    """The buffer a tensor goes to: "cpu" or "cuda:<index>" (a seam for CPU-only tests)."""
    return str(tensor.device)


class Source:
    """The weights a `Publisher` was given, placed and laid out once.

    `buffers` maps each CUDA tensor to the index of its device's buffer (1, 2, ...), or
    is None when every tensor is on the CPU: the CPU segment is buffer 0 and always
    exists (it holds the header).
    """

    def __init__(self, weights: Any) -> None:
        self.weights = weights
        flat = flatten(weights, sharded=True)  # DTensors: a sharded publisher (`_shards`)
        self.sharded = any(map(is_dtensor, flat.values()))
        placed = {key: _tensor_device(t) for key, t in flat.items()}
        devices = set(placed.values())
        other = sorted(d for d in devices if d != "cpu" and not d.startswith("cuda:"))
        if other:
            raise NotImplementedError(
                f"weights on {other}: zmqsync publishes CPU and CUDA tensors; move them "
                "to one of those"
            )
        cuda = sorted(devices - {"cpu"}, key=lambda d: int(d.split(":")[1]))
        if len(cuda) > 15:
            raise ValueError(f"weights on {len(cuda)} GPUs: at most 15 per bus")
        index = {device: i + 1 for i, device in enumerate(cuda)}
        self.cuda_devices = cuda
        self.buffers = {k: index[d] for k, d in placed.items() if d != "cpu"} if cuda else None
        self.flat = flat  # detached, as they were at construction (meta-free)
        self.layout = Layout.of(flat, self.buffers)
        self._reader = (
            ModuleReader(weights, (spec.key for spec in self.layout.specs))
            if isinstance(weights, torch.nn.Module)
            else None
        )
        # what publish(keys=...) may name: key tuples and dotted names
        self._key_of: dict[str | Key, Key] = {spec.key: spec.key for spec in self.layout.specs}
        self._key_of.update({spec.name: spec.key for spec in self.layout.specs})

    def at(self, addresses: bytes) -> bool:
        """Whether the module's tensors are at `addresses` (`_places.pack`ed, in layout
        order), checked without reading them into a dict (`ModuleReader.at`); False for
        other weights, or when they must be read again."""
        return self._reader is not None and self._reader.at(addresses)

    def reread(self, weights: Any = None) -> dict[Key, torch.Tensor]:
        """The tensors to publish, unchecked: `weights`, or the source re-read."""
        if weights is None and self._reader is not None:
            return self._reader.read()
        given = self.weights if weights is None else weights
        return flatten(given, detach=False, sharded=self.sharded)

    def read(self, weights: Any, named: frozenset[Key] | None) -> dict[Key, torch.Tensor]:
        """The tensors to publish: `weights`, or the source re-read; checked (a partial
        publish checks only the tensors it names)."""
        flat = self.reread(weights)
        if named is None:
            self.layout.check(flat)
        else:
            self.layout.check_keys(flat, named)
        return flat

    def named(self, keys: Iterable[str | Key] | None) -> frozenset[Key] | None:
        """`keys` as the layout's key tuples (None: every tensor)."""
        if keys is None:
            return None
        named = []
        for key in [keys] if isinstance(keys, str) else keys:
            found = self._key_of.get(key if isinstance(key, str) else tuple(key))
            if found is None:
                raise LayoutMismatch(
                    f"keys: {key!r} is not a tensor of this bus; name tensors as the "
                    "manifest does (dotted names, e.g. 'head.weight', or key tuples)"
                )
            named.append(found)
        if not named:
            raise ValueError("keys= names no tensor: leave it out to publish all of them")
        return frozenset(named)


def cast_to(source: Source, dtype: torch.dtype) -> Layout:
    """The layout of slots that hold `source`'s floating tensors in `dtype` (no memory:
    the tensors it is computed from are on the meta device)."""
    meta = {
        key: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        for key, t in source.flat.items()
    }
    return Layout.of(meta, source.buffers)


def trainer_tensors(weights: Any) -> dict[Key, torch.Tensor]:
    """The trainer's own tensor objects (not detached copies), keyed as `flatten` does."""
    if isinstance(weights, torch.nn.Module):
        return flatten(weights, detach=False)
    keys = list(flatten(weights))  # checks the kinds and gives the keys, in order
    if _is_tensordict(weights):
        leaves = weights.values(include_nested=True, leaves_only=True)
        return dict(zip(keys, leaves, strict=True))
    return dict(zip(keys, weights.values(), strict=True))
