"""Apply a version to what the worker computes with: `copy` into it, or `alias` it.

* copy: the model keeps its own tensors; bytes are copied from the slot (works with
  torch.compile, CUDA graphs and a model on another device than the buffer). With
  ``flat``, the model's CPU tensors are moved once into one private block laid out as a
  slot (`FlatBlock`; parameters stay the same objects), and a version is one copy of
  the slot into it, whatever the number of tensors.
* alias: the model's parameters and buffers become views into the slot (zero-copy;
  switching version is a pointer swap). Parameter objects keep their identity; only
  their ``.data`` changes, so references held elsewhere stay valid. On the CPU the
  model's tensors view one storage of their own, bound once, and a version switch
  moves that storage to the other slot's bytes (`Switch`): one call per version,
  whatever the number of tensors.

A tensor-parallel worker's model holds DTensors (`parallelize_module` over the worker
group's ranks); each rank takes only its slice of each full tensor in the slot
(`_shard_reads.Slices`, found once at bind; a plain model has none and pays nothing
per version). copy: the slice's bytes are copied into the DTensor's local shard, in the
same byte-copy plan as the plain tensors. alias: a slice that is one byte range becomes
the local shard itself (its ``.data`` is set to a view of the slot; the DTensor and its
Parameter stay the same objects); a slice that is not (a column shard of a row-major
weight) is copied into the shard, and the seqlock is read again after it. No `Switch`
then: every version binds each tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils.dlpack import from_dlpack

from ._copy import ByteCopies, CopyPlan
from ._errors import LayoutMismatch
from ._flat import FlatBlock
from ._home import SWAP_DATA_PTR as _SWAP_DATA_PTR  # None: .data set per tensor
from ._layout import (
    Key,
    Layout,
    flatten,
    to_tensordict,
    torch_dtype,
)
from ._tensor_kinds import is_dtensor

if TYPE_CHECKING:
    from ._shard_reads import Slices

__all__ = ["Switch", "Target", "slot_views"]

log = logging.getLogger(__name__)


class Target:
    """The tensors a subscriber updates, bound once to a model (or to nothing)."""

    def __init__(
        self,
        model: Any,
        layout: Layout,
        mode: str,
        device: str | None,
        view_devices: Mapping[Key, torch.device] | None = None,
        *,
        flat: bool = False,
    ) -> None:
        """Bind `model` (or fresh tensors when it is None) to `layout`.

        Args:
            device: where fresh tensors live in copy mode (default: where the buffer they
                are read from lives: a GPU for the CUDA transport, else the CPU).
            view_devices: the device of each slot view (default: all on the CPU). In
                alias mode the model's tensors must already be there.
            flat: copy mode: move the model's tensors into one block laid out as a slot
                (see the module doc), where they are all plain CPU tensors of the bus's
                shapes and dtypes (else they stay, and this is logged). Fresh tensors on
                the CPU always live in such a block.
        """
        self.mode = mode
        self.model = model
        self._layout = layout
        cpu = torch.device("cpu")
        where = view_devices or {}
        # copy mode with the tensors in one block: one copy per version (see copy_from)
        self.flat: FlatBlock | None = None
        self._flat_plans: dict[int, tuple[Mapping[Key, torch.Tensor], ByteCopies | None]] = {}
        homes = {s.key: _home(s.key, mode, device, where) for s in layout.specs}
        if model is None and mode == "copy" and all(h.type == "cpu" for h in homes.values()):
            self.flat = FlatBlock(layout)
            self.tensors: dict[Key, torch.Tensor] = dict(self.flat.views)
        elif model is None:
            self.tensors = {
                s.key: torch.zeros(s.shape, dtype=torch_dtype(s.dtype), device=homes[s.key])
                for s in layout.specs
            }
        else:
            self.tensors = flatten(model, sharded=True)  # a DTensor: this rank's slice
            try:
                layout.check(self.tensors, whose="it has", advice=_WORKER_ADVICE)
            except LayoutMismatch as exc:
                raise LayoutMismatch(f"the model does not match the bus: {exc}") from None
        # a tensor-parallel model's DTensors (None: a plain model, the usual case)
        self.slices = _slices_of(self.tensors, model, mode) if model is not None else None
        if model is not None and flat and mode == "copy":
            if self.slices is None:
                self._flatten_model()
            else:
                log.info("copy mode keeps a tensor-parallel model's tensors where they are")
        # per slot view mapping (kept alive in the tuple, so its id is not reused)
        self._copy_plans: dict[int, tuple[Mapping[Key, torch.Tensor], CopyPlan]] = {}
        self._subset_plans: dict[
            tuple[int, frozenset[Key]], tuple[Mapping[Key, torch.Tensor], CopyPlan]
        ] = {}
        self._binders: dict[int, _SlotBinding] = {}
        self.switch: Switch | None = None  # alias mode on the CPU, once a slot was aliased
        self._no_switch = self._switchless()  # then: per tensor
        # alias mode: some slices are copied, not aliased (the reader checks the seqlock)
        self.copies_slices = False
        if mode == "alias":
            wrong = sorted(
                {
                    f"{t.device} (buffer on {where.get(k, cpu)})"
                    for k, t in self.tensors.items()
                    if t.device != where.get(k, cpu) and t.device.type != "meta"
                }
            )
            if wrong:
                raise ValueError(
                    f"alias mode needs the model on the buffer's device, not {', '.join(wrong)}; "
                    "use mode='copy' for a model on another device"
                )

    def copy_from(
        self, views: Mapping[Key, torch.Tensor], keys: frozenset[Key] | None = None
    ) -> None:
        """Copy one slot into the model's own tensors.

        Plain CPU tensors (`bytes_are_values`) are copied as bytes, on this thread, by
        one `ByteCopies` plan per slot (one native call; else a memmove each when large
        and a memoryview assignment when small). Not through torch: its intra-op threads
        fight the other workers for the same cores (a 64 MB copy went from 6 ms to 8 ms
        and worse with the other core busy), 8 small copies through torch cost a cold
        worker ~25 us of CPU more per version on the bench, and 2,000 of them in one
        `_foreach_copy_` take twice as long as from Python. The rest (other devices,
        conj/neg views, dtype casts) goes through torch. A byte copy writes where the
        plan saw the tensor; every copy first checks those addresses (a storage resized
        under the model moves or frees them) and plans again if one changed.
        """
        if keys is not None:  # only what changed (a partial publish): planned per subset
            self._copy_subset(views, keys)
            return
        if self.flat is not None and self._copy_flat(views):
            return
        plan = self._copy_plans.get(id(views))
        if plan is None or plan[0] is not views or not plan[1].still_valid():
            plan = (views, self._plan_copies(self.tensors, views))
            self._copy_plans[id(views)] = plan
        plan[1].run()

    def _plan_copies(
        self, dsts: Mapping[Key, torch.Tensor], views: Mapping[Key, torch.Tensor]
    ) -> CopyPlan:
        """The copies of `dsts` from `views`: a DTensor's as its slice's byte ranges into
        its local shard (`slice_moves`), in the same native call as the plain ones."""
        slices = self.slices
        if slices is None:
            return CopyPlan.of(dsts, views)
        from ._shard_reads import slice_moves

        pieces, local = slices.pieces, slices.locals
        plain = {key: t for key, t in dsts.items() if key not in pieces}
        sliced = [
            (local[key], slice_moves(views[key], local[key], pieces[key]))
            for key in dsts
            if key in pieces
        ]
        return CopyPlan.of(plain, views, sliced)

    def copier(self, views: list[dict[Key, torch.Tensor]]) -> Callable[[int], bool]:
        """``copy(slot)``: copy slot `slot` of `views` whole (what a follower calls in
        copy mode); True once copied."""

        def copy(slot: int) -> bool:
            self.copy_from(views[slot])
            return True

        return copy

    def _flatten_model(self) -> None:
        """Move the model's tensors into one block (copy mode, ``flat``): values first,
        then each parameter's ``.data`` and each buffer or entry set to its view."""
        why = FlatBlock.refusal(self.tensors, self._layout)
        if why is not None:
            log.info("copy mode keeps the model's tensors where they are: %s", why)
            return
        block = FlatBlock(self._layout)
        with torch.no_grad():
            for key, view in block.views.items():
                view.copy_(self.tensors[key])
        params, stores = _binders(self.model, block.views)
        for param, view in params:
            param.data = view
        for store, view in stores:
            store(view)
        self.flat, self.tensors = block, dict(block.views)

    def _copy_flat(self, views: Mapping[Key, torch.Tensor]) -> bool:
        """One copy of the whole slot into the block; False where `views` are not one
        CPU slot at the layout's offsets, or the block's storage moved (resized through
        a view): then tensor by tensor, from now on in the second case."""
        flat = self.flat
        assert flat is not None
        plan = self._flat_plans.get(id(views))
        if plan is None or plan[0] is not views:
            plan = (views, _slot_copy(flat, views, self._layout))
            self._flat_plans[id(views)] = plan
        if plan[1] is None:
            return False
        if not flat.in_place():
            self.flat = None
            self._flat_plans.clear()
            return False
        plan[1].run()
        return True

    def _copy_subset(self, views: Mapping[Key, torch.Tensor], keys: frozenset[Key]) -> None:
        cached = self._subset_plans.get((id(views), keys))
        if cached is None or cached[0] is not views or not cached[1].still_valid():
            if len(self._subset_plans) > 64:  # the few subsets a trainer publishes
                self._subset_plans.clear()
            mine = {k: t for k, t in self.tensors.items() if k in keys}
            cached = (views, self._plan_copies(mine, views))
            self._subset_plans[(id(views), keys)] = cached
        cached[1].run()

    def alias_to(self, views: list[dict[Key, torch.Tensor]], slot: int) -> None:
        """Point the model's tensors at `slot` (`views`: every slot's tensors).

        On the CPU, one pointer swap (see `Switch`). Else one ``.data`` or dict store
        per tensor: the owners (parameter objects, buffer dicts) are found once per
        slot, not on every version (`get_submodule` was most of a worker's CPU on a
        2,000-tensor model), and a parameter's ``.data`` is set by the loop itself, not
        through a bound setter.
        """
        switch = self.switch
        if switch is not None:
            if switch.point_at(slot, views[slot]):
                return
            switch.active = False
            self.switch, self._no_switch = None, True  # from now on: every tensor is set
        elif not self._no_switch and self._switch_to(views, slot):
            return
        at = views[slot]
        binding = self._binders.get(id(at))
        if binding is None or binding[0] is not at:
            binding = self._binding(at)
            self._binders[id(at)] = binding
        _, (params, stores), copies, tensors = binding
        for param, view in params:
            param.data = view
        for store, view in stores:
            store(view)
        if copies is not None:
            copies.run()
        self.tensors = tensors  # the slot's views, built once and never changed: no copy

    def _binding(self, at: dict[Key, torch.Tensor]) -> _SlotBinding:
        """How to point the model at the slot `at` (see `_SlotBinding`): a DTensor's
        local shard is rebound to its slice where that is one byte range, else its slice
        is copied into it."""
        slices = self.slices
        if slices is None:
            return (at, _binders(self.model, at), None, at)
        from ._shard_reads import slice_moves, slice_view

        pieces = slices.pieces
        params, stores = _binders(self.model, {k: v for k, v in at.items() if k not in pieces})
        sliced: list[tuple[torch.Tensor, list[tuple[int, int, int]]]] = []
        for key, piece in pieces.items():
            inner, view = slices.inner[key], slice_view(at[key], piece)
            if view is None:
                sliced.append((inner, slice_moves(at[key], inner, piece)))
            else:
                params.append((inner, view))
        self.copies_slices = bool(sliced)
        copies = CopyPlan.of({}, {}, sliced) if sliced else None
        return (at, (params, stores), copies, {**at, **slices.owned})

    def _switch_to(self, views: list[dict[Key, torch.Tensor]], slot: int) -> bool:
        """Bind the model to a `Switch` at `slot`; False where none can be made (views
        not all in one CPU storage): then every tensor is set per version instead."""
        switch = Switch.over(views[slot], slot, len(views))
        if switch is None:
            self._no_switch = True
            return False
        params, stores = _binders(self.model, switch.tensors)  # once: they stay bound
        for param, view in params:
            param.data = view
        for store, view in stores:
            store(view)
        self.switch, self.tensors = switch, switch.tensors
        return True

    def forget_views(self) -> None:
        """Drop what was prepared for the old slot views (they pin the old mapping)."""
        self._copy_plans.clear()
        self._subset_plans.clear()
        self._flat_plans.clear()
        self._binders.clear()
        if self.switch is not None:
            self.switch.active = False
        self.switch = None
        self._no_switch = self._switchless()

    def _switchless(self) -> bool:
        """Whether a version binds every tensor (no `Switch`): no pointer swap in this
        torch, copy mode, or DTensors (their local shards are bound one by one)."""
        return _SWAP_DATA_PTR is None or self.mode != "alias" or self.slices is not None

    def weights(self) -> Any:
        return to_tensordict(self.tensors)


def slot_views(
    layout: Layout, cpu: SharedSlots, gpus: Mapping[int, SharedSlots], slot: int
) -> dict[Key, torch.Tensor]:
    """Every tensor of `slot`: from its CUDA buffer if mapped, else from the CPU segment."""
    views = layout.views(cpu.slot(slot))
    for index, gpu in gpus.items():
        views.update(layout.views(gpu.slot(slot), index))
    return views


class SharedSlots(Protocol):
    """A mapped buffer's slots (a CPU segment or a CUDA buffer)."""

    def slot(self, index: int) -> torch.Tensor: ...


def _slot_copy(
    flat: FlatBlock, views: Mapping[Key, torch.Tensor], layout: Layout
) -> ByteCopies | None:
    """The copy of the slot `views` cover into `flat`, or None unless every view is a
    CPU tensor at its offset from one base (the slot's bytes, gaps included)."""
    specs = layout.specs
    if not specs:
        return None
    base = views[specs[0].key].data_ptr() - specs[0].offset
    for spec in specs:
        view = views[spec.key]
        if view.device.type != "cpu" or view.data_ptr() != base + spec.offset:
            return None
    slot = torch.empty(0, dtype=torch.uint8)
    slot.set_(views[specs[0].key].untyped_storage())
    start = base - slot.data_ptr()
    if start < 0 or start + layout.slot_bytes > slot.numel():
        return None
    return flat.copies(slot[start : start + layout.slot_bytes], into_slot=False)


def _home(key: Key, mode: str, device: str | None, views: Mapping[Key, torch.device]) -> Any:
    """Where a fresh tensor lives: `device`, else where the buffer it reads lives (an alias
    of GPU memory starts as a "meta" placeholder: the first apply replaces it)."""
    view = views.get(key, torch.device("cpu"))
    if mode == "copy":
        return torch.device(device) if device else view
    return view if view.type == "cpu" else torch.device("meta")


_WORKER_ADVICE = (
    "build this worker's model with the trainer's keys, shapes and dtypes (for a bf16 "
    "bus: model.to(torch.bfloat16)), or leave model= out to receive the tensors as the "
    "bus carries them"
)


class Switch:
    """Alias mode on the CPU: a version switch as one pointer swap.

    The model's tensors view one storage of their own (`model`), bound to them once; to
    switch to another slot, that storage and the one holding the slot's bytes swap
    their data pointers (torch's ``_swap_data_ptr_``, `swap`), and every tensor of the
    model reads the new slot. Setting each tensor's ``.data`` instead cost a worker
    ~30 us of CPU per version for 8 tensors with cold caches (torch's setter dispatches
    a check and copies metadata per tensor), and grows with the number of tensors.

    Every slot's bytes are held by one storage made by `torch.from_dlpack` over a view
    of the mapping: the pointer's context is that view, so whichever storage holds a
    slot's pointer keeps the mapping alive, the model's included. `holders` says which
    storage holds which slot's pointer now: the model's holds slot `at`'s (its entry is
    None), and a slot not yet pointed at has none yet. A native `Follower` switches by
    the same steps on these same attributes; `active` is False once the `Target` has
    dropped this switch.

    `__slots__`: the native Follower reads and writes `model`, `swap`, `holders`, `at`
    and `active` by name; it checks them when it is built, and a renamed one can never
    become a stale attribute beside the real one.
    """

    __slots__ = ("model", "swap", "tensors", "_size", "holders", "at", "active")

    def __init__(
        self,
        views: dict[Key, torch.Tensor],
        model: torch.UntypedStorage,
        base: int,
        slot: int,
        slots: int,
    ) -> None:
        self.model = model
        self.swap = _SWAP_DATA_PTR
        self.tensors = {
            key: _over(model, view, int(view.storage_offset()) * view.element_size() - base)
            for key, view in views.items()
        }
        self._size = model.nbytes()
        self.holders: list[torch.UntypedStorage | None] = [None] * slots
        self.at = slot
        self.active = True

    @classmethod
    def over(cls, views: dict[Key, torch.Tensor], slot: int, slots: int) -> Switch | None:
        """A switch at `slot`, whose tensors are `views`, or None if they are not all CPU
        views of one storage."""
        held = _holder(views)
        return None if held is None else cls(views, *held, slot, slots)

    def point_at(self, slot: int, views: dict[Key, torch.Tensor]) -> bool:
        """Make the model read `slot` (whose tensors are `views`); False if that slot
        cannot be swapped in. Mirrored in C by point_at (``_follower.c``), which takes
        only a slot whose holder is built."""
        at = self.at
        if slot == at:
            return True
        holder = self.holders[slot]
        if holder is None:
            held = _holder(views)
            if held is None or held[0].nbytes() != self._size:
                return False
            holder = held[0]
        assert self.swap is not None
        self.swap(self.model, holder)  # the holder now holds the old slot's bytes
        self.holders[at], self.holders[slot] = holder, None
        self.at = slot
        return True


def _holder(views: Mapping[Key, torch.Tensor]) -> tuple[torch.UntypedStorage, int] | None:
    """A storage of its own over the bytes `views` cover, and where they start in the
    storage they view; None unless they are CPU views of one storage."""
    tensors = list(views.values())
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return None
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
    ends = [s + t.numel() * t.element_size() for s, t in zip(starts, tensors, strict=True)]
    base, end = min(starts), max(ends)
    region = torch.empty(0, dtype=torch.uint8).set_(storage, base, (end - base,), (1,))
    return from_dlpack(region).untyped_storage(), base


def _over(storage: torch.UntypedStorage, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A tensor shaped as `like`, at byte `offset` of `storage`."""
    step = like.element_size()
    return torch.empty(0, dtype=like.dtype).set_(storage, offset // step, like.shape, like.stride())


# (parameter, its view): `.data` set per version; (setter, view): a buffer or a
# TensorDict entry stored per version.
_Binders = tuple[
    list[tuple[torch.Tensor, torch.Tensor]],
    list[tuple[Callable[[torch.Tensor], None], torch.Tensor]],
]


def _binders(model: Any, views: Mapping[Key, torch.Tensor]) -> _Binders:
    """How to point each tensor of `model` at its view: parameters, then setters."""
    params: list[tuple[torch.Tensor, torch.Tensor]] = []
    stores: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = []
    if isinstance(model, torch.nn.Module):
        # One lookup per owner, not per tensor: a module that holds thousands of
        # tensors itself (a ParameterList, experts side by side) made this quadratic,
        # seconds of a worker's join at 2,000 tensors.
        owners: dict[Key, tuple[torch.nn.Module, dict[str, torch.nn.Parameter]]] = {}
        for key, view in views.items():
            path = key[:-1]
            if path not in owners:
                owner = model.get_submodule(".".join(path)) if path else model
                owners[path] = (owner, dict(owner.named_parameters(recurse=False)))
            owner, own = owners[path]
            param = own.get(key[-1])
            if param is not None:  # keep the Parameter object: optimizers and hooks hold it
                params.append((param, view))
            else:
                stores.append((_buffer_setter(owner, key[-1]), view))
    elif model is not None:  # TensorDict
        for key, view in views.items():
            stores.append((partial(_td_set, model, key if len(key) > 1 else key[0]), view))
    return params, stores


# An aliased slot, bound once: the slot's views (kept, so their id is not reused), the
# binders, the copies of slices that are not one byte range (None: none), and what
# `Target.tensors` is then.
_SlotBinding = tuple[
    Mapping[Key, torch.Tensor], _Binders, "CopyPlan | None", dict[Key, torch.Tensor]
]


def _slices_of(flat: Mapping[Key, torch.Tensor], model: Any, mode: str) -> Slices | None:
    """A model's DTensors (`Slices`), or None for a plain model (one type lookup per
    tensor, at bind only).

    Raises:
        TypeError: alias mode with DTensors in something else than an nn.Module (their
            shards are rebound through the module's own objects), or as `Slices.of`.
    """
    if not any(map(is_dtensor, flat.values())):
        return None
    from ._shard_reads import Slices

    owners = None
    if mode == "alias":
        if not isinstance(model, torch.nn.Module):
            first = next(k for k, t in flat.items() if is_dtensor(t))
            raise TypeError(
                f"{'.'.join(first)!r} is a DTensor in a {type(model).__name__}: alias mode "
                "binds the DTensors of an nn.Module; pass the module, or use Copies()"
            )
        owners = flatten(model, detach=False, sharded=True)
    return Slices.of(flat, owners)


def _td_set(td: Any, key: Any, view: torch.Tensor) -> None:
    td.set(key, view)


def _buffer_setter(owner: torch.nn.Module, name: str) -> Callable[[torch.Tensor], None]:
    # A buffer is set in the module's buffer dict directly: Module.__setattr__ would
    # check parameters, modules and hooks first, per tensor and per version.
    return partial(owner._buffers.__setitem__, name)  # noqa: SLF001
