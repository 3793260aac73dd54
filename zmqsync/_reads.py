"""How a `Subscriber` applies versions: `Copies` or `Aliases`, chosen once.

Each is a small frozen object holding only the options that apply to it, so a
combination that cannot work (a flat block of aliased tensors, a device for views
that live where the buffer lives) cannot be spelled at all:

    Subscriber(name="policy", model=policy)                                # Copies()
    Subscriber(name="policy", model=policy, reads=Copies(flat=True))       # many tensors
    Subscriber(name="policy", model=policy, reads=Aliases())               # zero-copy
    Subscriber(name="policy", model=policy, reads=Copies(manual=True))     # poll()
    Subscriber(name="policy", reads=Copies(device="cuda:0"))               # no model

Both take ``manual`` (the user's thread applies in `Subscriber.poll`, at a point of its
choosing, instead of the worker's thread on arrival) and ``on_update`` (a callable run
after each version is applied, before it is acked). What each costs and guarantees is in
docs/guide.md ("How a worker reads versions").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["Aliases", "Copies", "Reads"]

OnUpdate = Callable[[int], None]


class Reads:
    """What every way of applying versions is (`Copies`, `Aliases`)."""

    __slots__ = ()
    device: str | None
    manual: bool
    on_update: OnUpdate | None


def _check(manual: object, on_update: object) -> None:
    if not isinstance(manual, bool):
        raise TypeError(f"manual must be True or False, not {manual!r}")
    if on_update is not None and not callable(on_update):
        raise TypeError(f"on_update must be a callable(version) or None, not {on_update!r}")


def _check_device(device: object) -> None:
    if device is not None and not isinstance(device, str):
        raise TypeError(f'device must be a string such as "cpu" or "cuda:0", not {device!r}')


@dataclasses.dataclass(frozen=True)
class Copies(Reads):
    """Each version is copied into the model's own tensors (the default).

    The model keeps its tensors: works with torch.compile, CUDA graphs and a model on
    another device than the buffer; a version is never torn.

    Args:
        device: where the tensors live when the Subscriber has no model (None: where the
            buffer is: a GPU for the CUDA transport, else the CPU).
        flat: the model's CPU tensors move into one block laid out as a slot (Parameters
            stay the same objects): a version is one copy, whatever the number of tensors.
        manual: the user's thread applies the newest version in `Subscriber.poll()`
            (False: the worker's thread applies each version on arrival).
        on_update: callable(version) run after each apply, before the ack (it keeps the
            versions on the Python path: the native follower never runs user code).
    """

    device: str | None = None
    flat: bool = False
    manual: bool = False
    on_update: OnUpdate | None = None

    def __post_init__(self) -> None:
        _check(self.manual, self.on_update)
        _check_device(self.device)
        if not isinstance(self.flat, bool):
            raise TypeError(f"flat must be True or False, not {self.flat!r}")


@dataclasses.dataclass(frozen=True)
class Aliases(Reads):
    """The model's tensors become views of the slot a version is in (zero-copy).

    A version switch is a pointer swap; the model must be on the buffer's device. With
    ``slots=1`` on the publisher (or after this worker was evicted) a slot may be
    rewritten while it is read: `Subscriber.reading()` says when a result is torn.

    Args:
        device: without a model, which of the bus's copies the views are of: "cpu" reads
            the CPU segment even where the bus also has CUDA buffers (None: the one the
            transport chooses). With a model, the model's device decides.
        manual: the user's thread switches to the newest version in `Subscriber.poll()`.
        on_update: callable(version) run after each switch, before the ack.
    """

    device: str | None = None
    manual: bool = False
    on_update: OnUpdate | None = None

    def __post_init__(self) -> None:
        _check(self.manual, self.on_update)
        _check_device(self.device)
