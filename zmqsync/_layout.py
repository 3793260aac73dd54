"""Weights in, manifest and slot views out.

A module, a TensorDict or a state_dict becomes a flat ``{key: tensor}`` mapping (keys
are tuples of strings; nested TensorDict keys and dotted module names both map there)
and a `Layout`: every tensor at a 256-byte-aligned offset inside one slot, slots rounded
to whole pages. Parameters *and* buffers travel (BatchNorm statistics, int64 counters),
so a worker computes exactly what the trainer would.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from . import _places as places
from ._errors import LayoutMismatch
from ._protocol import ALIGN, DTYPES, TensorSpec, contiguous_stride
from ._tensor_kinds import check_kinds, odd_type

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = [
    "Key",
    "Layout",
    "ModuleReader",
    "flatten",
    "to_tensordict",
    "torch_dtype",
]

Key = tuple[str, ...]
PAGE = 4096

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in DTYPES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}


# The base class's getters: nn.Parameter's own go through __torch_function__ (8x slower),
# and torch has no public name for the base class.
_BASE: Any = torch._C.TensorBase  # noqa: SLF001
_SHAPE: Callable[[torch.Tensor], tuple[int, ...]] = _BASE.shape.__get__
_DTYPE: Callable[[torch.Tensor], torch.dtype] = _BASE.dtype.__get__


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name (a fixed table, never getattr on input)."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise LayoutMismatch(f"dtype {name} is not supported by this torch build") from None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def flatten(weights: Any, *, detach: bool = True, sharded: bool = False) -> dict[Key, torch.Tensor]:
    """``{key: tensor}`` for a module (parameters and buffers), TensorDict or state_dict.

    Args:
        detach: False leaves module parameters as they are (a caller that only reads
            them under no_grad saves a tensor object per parameter). It is also how a
            publish reads: then only each tensor's type is checked, not all it is.
        sharded: DTensors are expected (a sharded publisher's weights).

    Raises:
        TypeError: `weights` is none of the accepted kinds, or holds a non-tensor or a
            tensor no slot can hold (`_tensor_kinds`: named, one line).
    """
    if isinstance(weights, torch.nn.Module):
        flat = _module_tensors(weights)
        if detach:
            flat = {key: t.detach() for key, t in flat.items()}
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
    if detach:
        check_kinds(flat, sharded=sharded)
    else:
        odd_type(flat, sharded=sharded)
    return flat


def _module_tensors(module: torch.nn.Module) -> dict[Key, torch.Tensor]:
    """What ``named_parameters()`` then ``named_buffers()`` yield, keyed by tuples."""
    return {key: owner[name] for key, owner, name in _module_plan(module)}


def _module_plan(module: torch.nn.Module) -> list[tuple[Key, dict[str, Any], str]]:
    """Where each tensor of `module` lives: (key, the dict that holds it, its name there).

    Same order and the same de-duplication as ``named_parameters()`` then
    ``named_buffers()`` (a shared module or a tied tensor appears once, under its first
    name), without their generators and dotted-name joins.
    """
    modules: list[tuple[Key, torch.nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: Key, m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        modules.append((prefix, m))
        for name, child in m.named_children():
            visit((*prefix, name), child)

    visit((), module)
    plan: list[tuple[Key, dict[str, Any], str]] = []
    for members in ("_parameters", "_buffers"):
        memo: set[int] = set()  # ids: Tensor.__hash__ is a Python call
        for prefix, m in modules:
            owner = getattr(m, members)
            for name, tensor in owner.items():
                if tensor is None or id(tensor) in memo:
                    continue
                memo.add(id(tensor))
                plan.append(((*prefix, name), owner, name))
    return plan


_structure = [0]  # bumped whenever torch registers a module, parameter or buffer anywhere
_watching = threading.Lock()
_watched = False


def _structure_changed(*args: Any) -> None:
    _structure[0] += 1


def _watch_structure() -> None:
    """Install torch's global registration hooks once (each only bumps a counter)."""
    global _watched
    with _watching:
        if _watched:
            return
        from torch.nn.modules import module as nn_module

        nn_module.register_module_module_registration_hook(_structure_changed)
        nn_module.register_module_parameter_registration_hook(_structure_changed)
        nn_module.register_module_buffer_registration_hook(_structure_changed)
        _watched = True


class ModuleReader:
    """Reads a module's parameters and buffers on every publish, cheaply.

    Walking the module tree costs ~1.5 us per submodule (3 ms for 2,000 of them: more
    than copying their bytes). So the walk's result — which dict holds each tensor — is
    kept, and only the lookups run per read. It is walked again when torch registers a
    module, parameter or buffer anywhere in the process (assigning a new submodule or
    ``nn.Parameter`` does), when an entry disappeared or became None, and at least once
    a second (a change made behind torch's back, e.g. writing ``_modules`` directly).
    In-place changes (``.data =``, ``load_state_dict``) need no walk: the layout check
    sees shapes and dtypes on every read.
    """

    REWALK_S = 1.0

    def __init__(self, module: torch.nn.Module, keys: Iterable[Key] = ()) -> None:
        """`keys`: key objects to reuse (the layout's): comparing a read's keys with the
        layout's then costs one identity check per key, not a tuple comparison."""
        _watch_structure()
        self._module = module
        self._keys = {key: key for key in keys}
        self._plan: list[tuple[Key, dict[str, Any], str]] = []
        self._owners: list[dict[str, Any]] = []  # the plan's owners and names, apart
        self._names: list[str] = []
        self._places = places.Places([], [])  # the check of `at`, for these owners
        self._generation = -1
        self._walked_at = -math.inf

    def at(self, addresses: bytes) -> bool:
        """Whether the tensors `read` would return are at `addresses` (`_places.pack`ed,
        in its order), without building its dict: the flat layout's check of a publish,
        one pass in C++ (`_places.at`). False when `read` would walk the module again."""
        if self._generation != _structure[0] or time.monotonic() - self._walked_at >= self.REWALK_S:
            return False
        return self._places.at(addresses)

    def read(self) -> dict[Key, torch.Tensor]:
        now = time.monotonic()
        if self._generation == _structure[0] and now - self._walked_at < self.REWALK_S:
            try:
                flat = {key: owner[name] for key, owner, name in self._plan}
            except KeyError:
                flat = {}
            if flat and all(t is not None for t in flat.values()):
                return flat
        self._generation = _structure[0]
        self._plan = [(self._keys.get(k, k), o, n) for k, o, n in _module_plan(self._module)]
        self._owners = [owner for _, owner, _ in self._plan]
        self._names = [name for _, _, name in self._plan]
        self._places = places.Places(self._owners, self._names)
        self._walked_at = now
        if not self._plan:
            raise ValueError("weights hold no tensors: nothing to publish")
        return {key: owner[name] for key, owner, name in self._plan}


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

    @cached_property
    def _position(self) -> dict[Key, int]:
        """Each key's place in the manifest."""
        return {spec.key: i for i, spec in enumerate(self.specs)}

    @cached_property
    def _signature(self) -> tuple[list[Key], list[tuple[int, ...]], list[torch.dtype]]:
        keys = [spec.key for spec in self.specs]
        return keys, [spec.shape for spec in self.specs], [torch_dtype(s.dtype) for s in self.specs]

    def check(
        self,
        flat: Mapping[Key, torch.Tensor],
        keys: frozenset[Key] | None = None,
        *,
        whose: str = "publish() got",
        advice: str | None = None,
    ) -> None:
        """Raise LayoutMismatch naming the first difference between `flat` and the layout
        (`keys`: only those tensors, the others may be missing). `whose` and `advice`
        word the error for whoever holds `flat` (default: a trainer's publish(); a
        worker's model is not fixed the way a publish() is)."""
        if keys is not None:  # a partial publish: a few tensors of many, in manifest order
            specs = self.specs
            for i in sorted(map(self._position.__getitem__, keys)):
                self._check_one(specs[i], flat[specs[i].key], advice)
            return
        names, shapes, dtypes = self._signature
        # The hot path: same keys in the same order, same shapes and dtypes; shapes
        # compare as plain tuples (a list of torch.Size compares 10x slower).
        values = flat.values()
        if (
            list(flat) == names
            and list(map(_SHAPE, values)) == shapes
            and list(map(_DTYPE, values)) == dtypes
        ):
            return
        expected = [spec.key for spec in self.specs]
        known = set(expected)
        missing = [k for k in expected if k not in flat]
        extra = [k for k in flat if k not in known]
        if missing or extra:
            what = f"missing key {'.'.join(missing[0])!r}" if missing else ""
            what = what or f"unexpected key {'.'.join(extra[0])!r}"
            raise LayoutMismatch(
                f"{whose} other keys than the bus was created with: {what}; "
                f"{advice or 'publish tensors with the same keys, or start a new Publisher'}"
            )
        for spec in self.specs:
            self._check_one(spec, flat[spec.key], advice)

    @staticmethod
    def _check_one(spec: TensorSpec, tensor: torch.Tensor, advice: str | None) -> None:
        dtype = _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
        if tuple(tensor.shape) != spec.shape or dtype != spec.dtype:
            raise LayoutMismatch(
                f"{spec.name}: got {dtype}{list(tensor.shape)}, the bus carries "
                f"{spec.dtype}{list(spec.shape)}; "
                f"{advice or 'publish the same shapes and dtypes, or start a new Publisher'}"
            )

    def check_keys(self, flat: Mapping[Key, torch.Tensor], keys: Iterable[Key]) -> None:
        """Like `check`, for a partial publish: `flat` holds at least `keys`, as laid out."""
        keys = frozenset(keys)
        for key in keys:
            if key not in flat:
                raise LayoutMismatch(
                    f"publish(keys=...) names {'.'.join(key)!r}, which the tensors given "
                    "do not hold; pass them, or leave weights= out to read the source"
                )
        self.check(flat, keys=keys)

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
