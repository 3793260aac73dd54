"""What both sides of a `ZmqWeightSyncScheme` read: the options it was made with, checked
once, and the rendezvous, where the bus is, which the sender fills in and torchrl pickles
to the receivers as plain strings."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from ..._config import check_name, default_address, default_worker_id
from ..._config import shm_dir as resolve_shm_dir
from ..._publisher import Publisher, check_options
from ..._writes import Live, Writes

__all__ = ["Options", "Rendezvous", "lag_of"]


def lag_of(sync: bool | int | None, apply: str) -> int | None:
    """The ``max_lag`` each publish waits for (None: it does not wait), from `sync`.

    ``sync=0`` is refused rather than read: as a number it would mean "every worker
    applied the version" (``True``), as a flag it reads ``False``; either reading
    surprises someone.
    """
    if sync is None:  # a manual worker applies at its next rollout: waiting could deadlock
        return 0 if apply == "background" else None
    if isinstance(sync, bool):
        return 0 if sync else None
    if not isinstance(sync, int):
        raise TypeError(
            f"sync must be True, False or an int >= 1 (the most versions a worker may lag), "
            f"not {sync!r}"
        )
    if sync == 0:
        raise ValueError(
            "sync=0 is ambiguous: sync=True waits until every worker applied the version, "
            "sync=False does not wait, sync=k (k >= 1) until none is more than k behind"
        )
    if sync < 0:
        raise ValueError(f"sync=k bounds how many versions a worker may lag: k >= 1, not {sync}")
    return sync


def _check_bus_options(bus: Mapping[str, Any]) -> None:
    """Options for the Publisher are passed through, and checked by the Publisher's own
    check here, where the scheme is made, not later in a collector's constructor."""
    parameters = inspect.signature(Publisher).parameters
    known = set(parameters) - {"weights", "address", "name"}
    unknown = sorted(set(bus) - known)
    if unknown:
        lag = "; its bound on the workers' lag is sync=k" if "max_lag" in unknown else ""
        raise TypeError(
            f"ZmqWeightSyncScheme got unknown option(s) {', '.join(unknown)}; it passes "
            f"these to zmqsync.Publisher: {', '.join(sorted(known))}{lag}"
        )
    given = {name: bus.get(name, parameters[name].default) for name in known - {"shm_dir"}}
    check_options(**given)


@dataclasses.dataclass(frozen=True)
class Options:
    """The scheme's options, checked where they were given.

    Attributes:
        mode: the receivers' apply mode as given ("copy", "alias"; None: the sender
            decides, "alias" on a live bus).
        apply: "background" or "manual".
        lag: what each publish waits for, from ``sync`` (see `lag_of`).
        attach: the bus is published elsewhere; this scheme starts none.
        writes: the Publisher's ``writes=``; None: left out, the sender decides (live
            where torchrl shares the policy, else `Copy()`).
        bus: the Publisher's other options, as given (not ``writes`` or ``shm_dir``).
        timeout: the Publisher's deadline, also the receivers' handshake deadline.
    """

    mode: str | None
    apply: str
    lag: int | None
    attach: bool
    writes: Writes | None
    bus: Mapping[str, Any]
    timeout: float | None

    @classmethod
    def of(
        cls,
        *,
        mode: str | None,
        apply: str,
        sync: bool | int | None,
        attach: bool,
        bus: Mapping[str, Any],
    ) -> Options:
        """Check the constructor's arguments, each where it is given.

        Raises:
            ValueError: a value out of range, or two options that contradict each other.
            TypeError: an option the scheme and the Publisher do not know, or ``sync`` of
                the wrong type.
        """
        if mode not in (None, "copy", "alias"):
            raise ValueError(f'mode must be "copy" or "alias", not {mode!r}')
        if apply not in ("background", "manual"):
            raise ValueError(f'apply must be "background" or "manual", not {apply!r}')
        _check_bus_options(bus)
        writes = bus.get("writes")
        if isinstance(writes, Live) and (mode == "copy" or apply == "manual"):
            raise ValueError(
                "writes=Live() shares the trainer's tensors with alias workers: not with "
                'mode="copy" or apply="manual"'
            )
        return cls(
            mode=mode,
            apply=apply,
            lag=lag_of(sync, apply),
            attach=attach,
            writes=writes,
            bus={k: v for k, v in bus.items() if k not in ("writes", "shm_dir")},
            timeout=bus.get("timeout", 10.0),
        )

    @property
    def live(self) -> bool | None:
        """A live bus asked for (True), refused (False: other ``writes``), or left out."""
        return None if self.writes is None else isinstance(self.writes, Live)

    @property
    def sync(self) -> bool | int:
        """``sync`` as torchrl's schemes expose it: True, False, or the bound k."""
        return True if self.lag == 0 else False if self.lag is None else self.lag


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where the bus is and how its workers read it: what a receiver needs to join.

    Made from the constructor's arguments; the sender fills in what it decides (a
    generated name, the address it bound, the shm dir, live or not, a bus per worker), and
    torchrl pickles it to the receivers with the scheme. Strings and numbers only.
    """

    name: str | None
    address: str | None
    shm_dir: str | None
    worker_id: str | None
    mode: str
    live: bool
    worker_buses: Mapping[int, tuple[str, str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def given(
        cls,
        name: str | None,
        address: str | None,
        worker_id: str | None,
        shm_dir: str | None,
        options: Options,
    ) -> Rendezvous:
        """What the constructor's arguments say; the sender fills in the rest."""
        return cls(
            name=None if name is None else check_name(name),
            address=address,
            shm_dir=shm_dir,
            worker_id=worker_id,
            mode=options.mode or "copy",
            live=bool(options.live),
        )

    def attached(self) -> Rendezvous:
        """A bus published elsewhere: resolve its address and shm dir here, in the
        collector's process, and one worker-id prefix for all of its workers."""
        return dataclasses.replace(
            self,
            address=self.address or default_address(self.name or "weights"),
            shm_dir=resolve_shm_dir(self.shm_dir),
            worker_id=self.worker_id or default_worker_id(),
        )

    def worker(self, worker_idx: int) -> str:
        """torchrl's worker ``worker_idx`` as a zmqsync worker id."""
        return f"{self.worker_id or self.name or 'weights'}-w{worker_idx}"

    def bus_of(self, worker_idx: int | None) -> tuple[str, str | None]:
        """(name, address) of the bus torchrl's worker ``worker_idx`` joins.

        Raises:
            ValueError: per-worker buses, and none for this worker.
        """
        if not self.worker_buses:
            return self.name or "weights", self.address
        if worker_idx is None or worker_idx not in self.worker_buses:
            raise ValueError(f"no bus for torchrl worker {worker_idx} on this scheme")
        return self.worker_buses[worker_idx]
