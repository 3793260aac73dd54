"""Apply a version to what the worker computes with: `copy` into it, or `alias` it.

* copy: the model keeps its own tensors; bytes are copied from the slot (works with
  torch.compile, CUDA graphs and a model on another device than the buffer).
* alias: the model's parameters and buffers become views into the slot (zero-copy;
  switching version is a pointer swap). Parameter objects keep their identity; only
  their ``.data`` changes, so references held elsewhere stay valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ._errors import LayoutMismatch
from ._layout import Key, Layout, flatten, to_tensordict, torch_dtype

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

    def copy_from(self, views: Mapping[Key, torch.Tensor]) -> None:
        with torch.no_grad():
            for key, dst in self.tensors.items():
                dst.copy_(views[key], non_blocking=False)

    def alias_to(self, views: Mapping[Key, torch.Tensor]) -> None:
        if isinstance(self.model, torch.nn.Module):
            for key, view in views.items():
                _set_module_tensor(self.model, key, view)
        elif self.model is not None:  # TensorDict
            for key, view in views.items():
                self.model.set(key if len(key) > 1 else key[0], view)
        self.tensors = dict(views)

    def weights(self) -> Any:
        return to_tensordict(self.tensors)


def _home(key: Key, mode: str, device: str | None, views: Mapping[Key, torch.device]) -> Any:
    """Where a fresh tensor lives: `device`, else where the buffer it reads lives (an alias
    of GPU memory starts as a "meta" placeholder: the first apply replaces it)."""
    view = views.get(key, torch.device("cpu"))
    if mode == "copy":
        return torch.device(device) if device else view
    return view if view.type == "cpu" else torch.device("meta")


def _set_module_tensor(module: torch.nn.Module, key: Key, view: torch.Tensor) -> None:
    owner = module.get_submodule(".".join(key[:-1])) if len(key) > 1 else module
    name = key[-1]
    param = owner._parameters.get(name)
    if param is not None:
        param.data = view
    else:
        owner._buffers[name] = view
