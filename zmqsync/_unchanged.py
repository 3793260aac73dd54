"""Which tensors changed since they were last published (`skip_unchanged`).

torch bumps a tensor's version counter on every in-place write it sees; a tensor whose
storage and counter are where they were at the last publish was not written through
torch since. Writes behind torch's back (``.data``, numpy views, another process) do not
move the counter: "verify" compares the skipped tensors byte for byte to catch them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from ._layout import Key
from ._text import printable

__all__ = ["Unchanged"]

log = logging.getLogger(__name__)


class Unchanged:
    """Tracks, per tensor, where it was and its version counter when last published."""

    def __init__(self, name: str, verify: bool) -> None:
        self._name = name
        self._verify = verify
        self._published_at: dict[Key, tuple[int, int]] = {}

    def written_since(
        self,
        flat: Mapping[Key, torch.Tensor],
        latest: Callable[[], Mapping[Key, torch.Tensor]],
    ) -> frozenset[Key] | None:
        """The tensors written since they were last published (None: all of them).
        `latest()`: the latest version's slot views, for "verify" (called under the
        caller's write lock)."""
        seen = self._published_at
        moved = {k for k, t in flat.items() if seen.get(k) != _stamp(t)}
        if self._verify and len(moved) < len(flat):
            views = latest()
            missed = sorted(k for k, t in flat.items() if k not in moved and not _same(t, views[k]))
            if missed:
                names = ", ".join(printable(".".join(k)) for k in missed[:5])
                log.warning(
                    "publisher %r: %d tensors changed without their version counter moving "
                    "(%s%s); published them anyway. Written through .data or a numpy view? "
                    "skip_unchanged=True would have missed them",
                    self._name, len(missed), names, ", ..." if len(missed) > 5 else "",
                )  # fmt: skip
                moved.update(missed)
        return None if len(moved) == len(flat) else frozenset(moved)

    def note(self, flat: Mapping[Key, torch.Tensor], named: frozenset[Key] | None) -> None:
        """`flat` (its `named` tensors) went out in a version."""
        for key in flat if named is None else named:
            self._published_at[key] = _stamp(flat[key])


def _stamp(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's bytes are and how often torch saw them written in place."""
    return tensor.data_ptr(), tensor._version  # noqa: SLF001 - torch's version counter


def _same(source: torch.Tensor, slot_view: torch.Tensor) -> bool:
    """Whether `source` holds, byte for byte, what the slot holds (cast as the slot is);
    a CUDA tensor counts as changed (its slot copy is on the device)."""
    if source.device.type != "cpu" or slot_view.device.type != "cpu":
        return False
    value = source.detach().to(slot_view.dtype).reshape(-1)
    if value.dtype == torch.bool:
        return torch.equal(value, slot_view.reshape(-1))
    return torch.equal(value.view(torch.uint8), slot_view.reshape(-1).view(torch.uint8))
