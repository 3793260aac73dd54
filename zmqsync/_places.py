"""Whether a module's tensors are where the flat layout put them: a publish's check.

A flat publish announces the block as the version, which is sound only while every
tensor the trainer's module holds still views its place in the block: one data pointer
per tensor, compared on every publish. From Python that is ``Tensor.data_ptr()`` per
tensor, ~80-150 ns each through torch's method call (by host state): 160-290 µs of a
2,000-tensor model's ~800 µs publish, the largest cost left beside the copies. `at`
makes the same check in one pass of C++ (``_places.cpp``, ~20 ns a tensor, 40 µs for
those 2,000): it looks each tensor up in its
owner's dict and reads its data pointer through the function torch exports for the C++
its compiler generates (``torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr``,
a function's address: inductor's kernels read a tensor's data pointer with it, without
torch's headers).

The contract, shared by the C++ and `at_reference`, its Python twin (differential tests
in tests/test_places.py): True only if ``owners[i][names[i]]`` is a tensor at the i-th
address for every i; False for anything else (a missing or non-tensor entry, lengths
that differ, a tensor with no data pointer, anything raised). False is never wrong, only
slow: the caller then reads the module and checks it in Python, which decides. Without
the extension, or without torch's function (another torch), or where the probe below
finds that it does not return what ``Tensor.data_ptr()`` does, `at` is the twin.

`Places` is the check a reader makes publish after publish with the same owners and
names. In a loop of publishes the module's objects come back cold after the copies,
and the dict lookups were most of the check (2,000 tensors: ~80 of ~135 µs cold; the
data pointers of the objects themselves ~55). So it remembers what the lookups found
and the owner dicts' version tags (CPython 3.11 changes a dict's tag whenever the dict
changes, PEP 509), and while no tag changed it checks those objects' data pointers
without looking them up (``still_at``). A changed tag, another Python, or no extension:
the lookups, as `at`.

``ZMQSYNC_NATIVE=0`` turns it off as it does ``_native``; `_native_lib.native_class` is
not reused for that because it imports zmq, which this layer never does.
"""

from __future__ import annotations

import functools
import importlib
import os
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["NATIVE_AT", "NATIVE_STILL_AT", "Places", "at", "at_reference", "pack"]

_DATA_PTR: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr

At = Callable[[list[Any], list[str], bytes], bool]


def pack(addresses: Sequence[int]) -> bytes:
    """`addresses` as `at` compares them: native unsigned 64-bit words."""
    return array("Q", addresses).tobytes()


def at_reference(owners: list[Any], names: list[str], addresses: bytes) -> bool:
    """The contract of `at` in Python (module doc)."""
    if len(names) != len(owners) or len(addresses) != 8 * len(owners):
        return False
    try:
        found = list(map(_DATA_PTR, map(dict.__getitem__, owners, names)))
    except Exception:  # gone, not a tensor, no data pointer: "not there"
        return False
    return pack(found) == addresses


def _native_at() -> At | None:
    """The C++ `at`, bound to torch's function, once a probe agrees with
    ``Tensor.data_ptr()``; None where any part is missing or disagrees."""
    if os.environ.get("ZMQSYNC_NATIVE", "1") == "0":
        return None
    try:
        guards = importlib.import_module("torch._C._dynamo.guards")  # loaded with torch
    except ImportError:
        return None
    function = getattr(guards, "_torchinductor_pyobject_tensor_data_ptr", None)
    if not isinstance(function, int) or function == 0:
        return None
    try:
        from ._places_native import at as native
    except ImportError:  # installed without a C++ compiler
        return None
    probe = torch.zeros(3)
    owner = {"probe": probe, "view": probe[1:]}
    names = ["probe", "view"]
    bound: At = functools.partial(native, function)
    if not bound([owner, owner], names, pack([probe.data_ptr(), probe[1:].data_ptr()])):
        return None
    if bound([owner], ["probe"], pack([probe.data_ptr() + 4])):
        return None
    return bound


NATIVE_AT = _native_at()
at: At = NATIVE_AT or at_reference

Versions = Callable[[list[dict[str, Any]]], "bytes | None"]
StillAt = Callable[[list[dict[str, Any]], bytes, list[Any], bytes], bool]


def _native_still_at() -> tuple[Versions, StillAt] | None:
    """The C++ `versions` and `still_at` (bound to torch's function), once a probe sees
    a dict's tag change when the dict does and stay when it does not; None otherwise."""
    if NATIVE_AT is None:
        return None
    from ._places_native import still_at, versions

    function = NATIVE_AT.args[0]  # type: ignore[attr-defined]
    bound: StillAt = functools.partial(still_at, function)
    probe = torch.zeros(2)
    owner: dict[str, Any] = {"probe": probe}
    tags = versions([owner])
    if tags is None or not bound([owner], tags, [probe], pack([probe.data_ptr()])):
        return None
    owner["probe"] = torch.zeros(2)
    if bound([owner], tags, [probe], pack([probe.data_ptr()])):
        return None
    return versions, bound


NATIVE_STILL_AT = _native_still_at()


class Places:
    """`at` for one fixed list of owners and names, asked again and again (module doc).

    True exactly when `at` would be: the remembered objects are what the lookups find
    while no owner dict changed, and their data pointers are checked every time.
    """

    __slots__ = ("_owners", "_names", "_dicts", "_tags", "_objects")

    def __init__(self, owners: list[dict[str, Any]], names: list[str]) -> None:
        self._owners, self._names = owners, names
        self._dicts = list({id(owner): owner for owner in owners}.values())
        self._tags: bytes | None = None  # the dicts' tags when `_objects` were looked up
        self._objects: list[Any] = []

    @property
    def remembers(self) -> bool:
        """Whether the next check may skip the lookups (it still checks the dicts' tags)."""
        return self._tags is not None

    def at(self, addresses: bytes) -> bool:
        """Whether owners[i][names[i]] is a tensor at the i-th of `addresses`, every i."""
        native = NATIVE_STILL_AT
        if native is not None and self._tags is not None:
            if native[1](self._dicts, self._tags, self._objects, addresses):
                return True
        self._tags, self._objects = None, []
        if not at(self._owners, self._names, addresses):
            return False
        if native is not None and all(type(owner) is dict for owner in self._dicts):
            tags = native[0](self._dicts)  # first: a change after it shows next time
            self._objects = list(map(dict.__getitem__, self._owners, self._names))
            self._tags = tags
        return True
