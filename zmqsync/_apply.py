"""Apply a version to what the worker computes with: `copy` into it, or `alias` it.

* copy: the model keeps its own tensors; bytes are copied from the slot (works with
  torch.compile, CUDA graphs and a model on another device than the buffer).
* alias: the model's parameters and buffers become views into the slot (zero-copy;
  switching version is a pointer swap). Parameter objects keep their identity; only
  their ``.data`` changes, so references held elsewhere stay valid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch

from ._copy import CopyPlan
from ._errors import LayoutMismatch
from ._layout import (
    Key,
    Layout,
    flatten,
    to_tensordict,
    torch_dtype,
)

__all__ = ["Target"]


class Target:
    """The tensors a subscriber updates, bound once to a model (or to nothing)."""

    def __init__(
        self,
        model: Any,
        layout: Layout,
        mode: str,
        device: str | None,
        view_devices: Mapping[Key, torch.device] | None = None,
    ) -> None:
        """Bind `model` (or fresh tensors when it is None) to `layout`.

        Args:
            device: where fresh tensors live in copy mode (default: where the buffer they
                are read from lives: a GPU for the CUDA transport, else the CPU).
            view_devices: the device of each slot view (default: all on the CPU). In
                alias mode the model's tensors must already be there.
        """
        self.mode = mode
        self.model = model
        self._layout = layout
        cpu = torch.device("cpu")
        where = view_devices or {}
        if model is None:
            self.tensors: dict[Key, torch.Tensor] = {
                s.key: torch.zeros(
                    s.shape, dtype=torch_dtype(s.dtype), device=_home(s.key, mode, device, where)
                )
                for s in layout.specs
            }
        else:
            self.tensors = flatten(model)
            try:
                layout.check(self.tensors)
            except LayoutMismatch as exc:
                raise LayoutMismatch(
                    f"the model does not match the bus: {exc}".replace("publish() got", "it has")
                ) from None
        # per slot view mapping (kept alive in the tuple, so its id is not reused)
        self._copy_plans: dict[int, tuple[Mapping[Key, torch.Tensor], CopyPlan]] = {}
        self._subset_plans: dict[
            tuple[int, frozenset[Key]], tuple[Mapping[Key, torch.Tensor], CopyPlan]
        ] = {}
        self._binders: dict[int, tuple[Mapping[Key, torch.Tensor], list[_Binder]]] = {}
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
        plan = self._copy_plans.get(id(views))
        if plan is None or plan[0] is not views or not plan[1].still_valid():
            plan = (views, CopyPlan.of(self.tensors, views))
            self._copy_plans[id(views)] = plan
        plan[1].run()

    def _copy_subset(self, views: Mapping[Key, torch.Tensor], keys: frozenset[Key]) -> None:
        cached = self._subset_plans.get((id(views), keys))
        if cached is None or cached[0] is not views or not cached[1].still_valid():
            if len(self._subset_plans) > 64:  # the few subsets a trainer publishes
                self._subset_plans.clear()
            mine = {k: t for k, t in self.tensors.items() if k in keys}
            cached = (views, CopyPlan.of(mine, views))
            self._subset_plans[(id(views), keys)] = cached
        cached[1].run()

    def alias_to(self, views: dict[Key, torch.Tensor]) -> None:
        """Point the model's tensors at one slot: one ``.data`` or dict store per tensor.

        The owners (parameter objects, buffer dicts) are found once per slot, not on
        every version: `get_submodule` was most of a worker's CPU on a 2,000-tensor model.
        """
        binders = self._binders.get(id(views))
        if binders is None or binders[0] is not views:
            binders = (views, _binders(self.model, views))
            self._binders[id(views)] = binders
        for bind, view in binders[1]:
            bind(view)
        self.tensors = views  # the slot's views, built once and never changed: no copy

    def forget_views(self) -> None:
        """Drop what was prepared for the old slot views (they pin the old mapping)."""
        self._copy_plans.clear()
        self._subset_plans.clear()
        self._binders.clear()

    def weights(self) -> Any:
        return to_tensordict(self.tensors)


def _home(key: Key, mode: str, device: str | None, views: Mapping[Key, torch.device]) -> Any:
    """Where a fresh tensor lives: `device`, else where the buffer it reads lives (an alias
    of GPU memory starts as a "meta" placeholder: the first apply replaces it)."""
    view = views.get(key, torch.device("cpu"))
    if mode == "copy":
        return torch.device(device) if device else view
    return view if view.type == "cpu" else torch.device("meta")


_Binder = tuple[Callable[[torch.Tensor], None], torch.Tensor]


def _binders(model: Any, views: Mapping[Key, torch.Tensor]) -> list[_Binder]:
    """How to point each tensor of `model` at its view: a bound setter per key."""
    if isinstance(model, torch.nn.Module):
        return [(_module_setter(model, key), view) for key, view in views.items()]
    if model is not None:  # TensorDict
        return [
            (partial(_td_set, model, key if len(key) > 1 else key[0]), view)
            for key, view in views.items()
        ]
    return []


def _td_set(td: Any, key: Any, view: torch.Tensor) -> None:
    td.set(key, view)


def _module_setter(module: torch.nn.Module, key: Key) -> Callable[[torch.Tensor], None]:
    owner = module.get_submodule(".".join(key[:-1])) if len(key) > 1 else module
    name = key[-1]
    param = dict(owner.named_parameters(recurse=False)).get(name)
    if param is not None:  # keep the Parameter object: optimizers and hooks hold it
        return partial(setattr, param, "data")
    # A buffer is set in the module's buffer dict directly: Module.__setattr__ would
    # check parameters, modules and hooks first, per tensor and per version.
    return partial(owner._buffers.__setitem__, name)  # noqa: SLF001
