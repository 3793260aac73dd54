"""How a `Publisher` writes versions: one of `Copy`, `Overlapped` or `Live`, chosen once.

Each is a small frozen object holding only the options that apply to it, so a
combination that cannot work (a live bus cast to bf16, a live bus with an optimizer's
background copy) cannot be spelled at all, instead of failing at run time:

    Publisher(model)                                              # Copy()
    Publisher(model, writes=Copy(dtype=torch.bfloat16))
    Publisher(model, writes=Copy(flat=True))                      # many tensors
    Publisher(model, writes=Overlapped(optimizer, skip_unchanged=True))
    Publisher(model, writes=Live())

What each costs and guarantees is in docs/guide.md ("How versions are written").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

import torch

__all__ = ["Copy", "Live", "Overlapped", "Writes"]

SkipUnchanged = bool | Literal["verify"]


def _check(dtype: torch.dtype | None, skip_unchanged: object) -> None:
    if skip_unchanged not in (False, True, "verify"):
        raise ValueError(f'skip_unchanged must be False, True or "verify", not {skip_unchanged!r}')
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (torch.bfloat16...), not {dtype!r}")


class Writes:
    """What every way of writing versions is (`Copy`, `Overlapped`, `Live`)."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class Copy(Writes):
    """Each publish copies the weights into a free slot, then announces it (the default).

    Args:
        dtype: the dtype the slots hold floating-point tensors in (e.g. torch.bfloat16
            for a float32 trainer: half the bytes written, mapped and copied); the
            trainer's tensors are cast on the way. None: as they are.
        skip_unchanged: False: a publish without ``keys=`` writes every tensor. True:
            only tensors whose torch version counter moved since the last publish (a
            partial publish chosen for you); writes that bypass the counter (through
            ``.data``, numpy views, another process) are not seen. "verify": the same,
            and every skipped tensor is compared byte for byte with the last version;
            one that differs is published anyway, with a warning.
        flat: the flat layout, for CPU models (of many tensors above all): at start
            the trainer's tensors move into one block laid out as a slot and kept in the
            segment, the trainer's home slot (each becomes a view of its place; a
            ``Parameter`` stays the same object, as with `Live`). A publish of every
            tensor, checked by one address per tensor instead of shape and dtype,
            announces the home slot as written, then copies it into the next free slot
            while the workers read it, and the tensors follow there by one storage
            pointer swap: their addresses change at every publish (see docs/guide.md).
            The segment holds one slot more than asked. A tensor the trainer
            re-allocates (``load_state_dict(assign=True)``, ``.data = ...``, a round
            trip through another dtype) leaves the layout: publishes then copy tensor
            by tensor, with a warning. CPU tensors only, no `dtype`; weights that cannot
            move (on a GPU, not contiguous) keep publishing tensor by tensor, with a
            warning.
    """

    dtype: torch.dtype | None = None
    skip_unchanged: SkipUnchanged = False
    flat: bool = False

    def __post_init__(self) -> None:
        _check(self.dtype, self.skip_unchanged)
        if self.flat and self.dtype is not None:
            raise ValueError("Copy(flat=True) writes the trainer's own bytes: no dtype=")


@dataclasses.dataclass(frozen=True, eq=False)
class Overlapped(Writes):
    """Copy the optimizer's tensors in the background, beside the next forward/backward.

    A publish copies now what the optimizer does not write (buffers), and returns; a
    writer thread copies the rest and announces the version. The next
    ``optimizer.step()`` waits only while that copy is unfinished (`Publish.blocked`
    says how long). A parameter written outside ``step()`` between a publish and the
    end of its copy may tear that version (see docs/guide.md).

    Args:
        optimizer: the optimizer (or several) whose ``step()`` writes the tensors.
        dtype, skip_unchanged: as for `Copy`.
    """

    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]
    dtype: torch.dtype | None = None
    skip_unchanged: SkipUnchanged = False

    def __post_init__(self) -> None:
        _check(self.dtype, self.skip_unchanged)
        given = self.optimizer
        found = (given,) if isinstance(given, torch.optim.Optimizer) else tuple(given)
        if not found or not all(isinstance(o, torch.optim.Optimizer) for o in found):
            raise TypeError(f"Overlapped needs torch optimizers, not {given!r}")
        object.__setattr__(self, "optimizer", found)

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers, as a tuple (one given alone included)."""
        return self.optimizer  # type: ignore[return-value]  # a tuple since __post_init__


@dataclasses.dataclass(frozen=True)
class Live(Writes):
    """The trainer's tensors move into the shared segment (one slot) and stay there.

    Their storage becomes a view of the segment: alias-mode workers see every in-place
    change at once, and a publish only announces a version (no copy, at any size).
    Versions are then not atomic (see docs/guide.md). CPU tensors only. On close the
    trainer gets private copies back; the `Parameter` objects stay the same throughout.
    """
