"""The sender's side of a `ZmqWeightSyncScheme`: the process that owns the collector (or
a trainer on its own) starts a bus over the policy, one per torchrl worker with per-worker
weights, and publishes a version at each ``update_policy_weights_()``."""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase
from torch import nn

from ..._config import shm_dir as resolve_shm_dir
from ..._publisher import Publish, Publisher
from ..._writes import Copy, Live
from ._options import Options, Rendezvous
from ._weights import (
    all_on_cpu,
    check_params_map,
    find_model,
    generated_name,
    on_cpu,
    payload,
    per_worker,
    private_copy,
    refuse_sharded,
    sharded,
    workers_on_cpu,
)

__all__ = ["SchemeSender"]

log = logging.getLogger(__name__)


class _Bus:
    """One started Publisher, and what a publish without weights re-reads."""

    def __init__(self, source: Any, publisher: Publisher) -> None:
        self.pid = os.getpid()
        self.publisher = publisher.start()
        # A model on another device is staged through a CPU copy: re-read it each time.
        self._staged = None if all_on_cpu(source) else source

    def publish(self, weights: Any, *, workers: list[str] | None, max_lag: int | None) -> Publish:
        if weights is None:
            weights = self._staged
        return self.publisher.publish(weights, workers=workers, max_lag=max_lag)


def _close_buses(buses: list[_Bus]) -> None:
    """Close a scheme's buses, in the process that started them (never in a forked child:
    closing there would unlink the parent's segments)."""
    for bus in buses:
        if bus.pid == os.getpid():
            bus.publisher.close()
    buses.clear()


class SchemeSender:
    """The buses a scheme started, and the publishes that ``send()`` makes on them.

    Args:
        options: the scheme's options (``writes``, the Publisher's, ``lag``).
        on_version: called with each version published (the collector's tracker).
    """

    def __init__(self, options: Options, on_version: Callable[[int], None]) -> None:
        self.pid = os.getpid()
        self.last_publish: Publish | None = None
        self._options = options
        self._on_version = on_version
        self._rendezvous: Rendezvous | None = None
        self._bus: _Bus | None = None
        self._worker_buses: dict[int, _Bus] = {}
        self._broadcast: Any = None  # per-worker buses: what send(None) publishes to all
        self._buses: list[_Bus] = []
        self._closer: weakref.finalize[..., Any] | None = None
        self._live = False  # whether the buses started are live (the last one's)

    @property
    def publisher(self) -> Publisher | None:
        return self._bus.publisher if self._bus is not None else None

    @property
    def publishers(self) -> dict[int, Publisher]:
        return {i: bus.publisher for i, bus in self._worker_buses.items()}

    @property
    def version(self) -> int:
        if self._bus is not None:
            return self._bus.publisher.version
        return max((b.publisher.version for b in self._worker_buses.values()), default=-1)

    def start(
        self,
        owner: object,
        rendezvous: Rendezvous,
        *,
        model_id: str,
        context: Any,
        model: Any,
        weights: Any,
        params_map: Any,
        per_worker_weights: bool,
    ) -> Rendezvous:
        """Start the bus (one per worker with per-worker weights) at version 0.

        Args:
            owner: the scheme: its buses close when it is garbage-collected, since
                torchrl never shuts a scheme down.

        Returns:
            The rendezvous the receivers need: the name (generated if none was given),
            the address bound, the shm dir, live or not, the per-worker buses.

        Raises:
            ValueError: nothing to publish was given, or ``params_map`` is not a
                ``{worker_idx: TensorDict}`` alone; a bound the slots cannot hold.
        """
        if params_map is not None and (model is not None or weights is not None):
            raise ValueError("params_map= gives the weights: no model= or weights= with it")
        self._closer = weakref.finalize(owner, _close_buses, self._buses)
        try:
            source, shared = self._sources(
                context, model_id, model, weights, params_map, per_worker_weights
            )
            self._rendezvous = self._start_buses(source, shared, rendezvous, model_id)
        except BaseException:
            self.close()  # the buses started before the failure
            raise
        return self._rendezvous

    def _start_buses(
        self, source: Any, shared: bool, rendezvous: Rendezvous, model_id: str
    ) -> Rendezvous:
        self._check_sharded(source, rendezvous)
        name = rendezvous.name or generated_name(model_id)
        shm_dir = resolve_shm_dir(rendezvous.shm_dir)
        if isinstance(source, dict):  # per-worker weights: a bus of its own for each
            for idx, worker_source in sorted(source.items()):
                bus = self._start(worker_source, f"{name}-{idx}", None, shm_dir, shared=False)
                self._worker_buses[idx] = bus
            buses = {
                i: (b.publisher.name, b.publisher.address) for i, b in self._worker_buses.items()
            }
            address = rendezvous.address
        else:
            self._bus = self._start(source, name, rendezvous.address, shm_dir, shared=shared)
            buses, address = {}, self._bus.publisher.address
        live = self._live
        return dataclasses.replace(
            rendezvous,
            name=name,
            address=address,
            shm_dir=shm_dir,
            mode="alias" if live else self._options.mode or "copy",
            live=live,
            worker_buses=buses,
        )

    @staticmethod
    def _check_sharded(source: Any, rendezvous: Rendezvous) -> None:
        """A sharded policy's bus is one Publisher built by every rank together: one name
        for all of them, and no per-worker buses (each would be a collective of its own,
        over copies that are not the trainer's shards).

        Raises:
            TypeError: per-worker weights that hold DTensors.
            ValueError: DTensor weights and no ``name=`` (a generated name differs on
                each rank).
        """
        if isinstance(source, dict):
            if any(sharded(s) for s in source.values()):
                raise TypeError(
                    "per-worker weights hold DTensors: a sharded policy is published by "
                    "every rank on one bus; leave per_worker_weights out and give each "
                    "worker the same weights"
                )
        elif sharded(source) and rendezvous.name is None:
            raise ValueError(
                "the policy holds DTensors: every rank builds the scheme and they publish "
                "on one bus; give ZmqWeightSyncScheme(name=...) the same name on every rank"
            )

    def _sources(
        self,
        context: Any,
        model_id: str,
        model: Any,
        weights: Any,
        params_map: Any,
        per_worker_weights: bool,
    ) -> tuple[Any, bool]:
        """What the buses publish: one source, or ``{worker_idx: source}``; and whether
        torchrl would share it with the workers (the collector's own policy, or weights
        the caller put in shared memory)."""
        shared = False
        if params_map is not None:
            workers = check_params_map(params_map)
            if len({id(td) for td in workers.values()}) > 1 or per_worker_weights:
                return {i: payload(td) for i, td in workers.items()}, False
            first = next(iter(workers.values()))
            source, shared = payload(first), bool(first.is_shared())
        elif weights is not None:
            source = payload(weights)
        elif model is not None:
            source = model
        elif context is None:
            raise ValueError("init_on_sender() needs context=, model=, weights= or params_map=")
        else:
            found = find_model(context, model_id)
            if isinstance(found, dict):  # distinct policy factories
                return found, False
            if not isinstance(found, nn.Module | TensorDictBase):
                raise TypeError(
                    f"model {model_id!r} of {type(context).__name__} is a "
                    f"{type(found).__name__}, not a module with weights; a policy without "
                    "weights (e.g. RandomPolicy) needs no weight sync scheme"
                )
            refuse_sharded(found, context, model_id)
            source, shared = found, workers_on_cpu(context)
        if not per_worker_weights:
            return source, shared
        count = getattr(context, "num_workers", None)
        if not isinstance(count, int):
            raise ValueError(
                "per_worker_weights=True needs the collector (context=) or a params_map= "
                "to know how many workers there are"
            )
        self._broadcast = source  # send() without per-worker weights publishes it to all
        return {i: private_copy(source) for i in range(count)}, False

    def _start(
        self, source: Any, name: str, address: str | None, shm_dir: str, *, shared: bool
    ) -> _Bus:
        """Start one bus over `source`: live where asked, or, left out, where torchrl
        would share the policy with CPU workers that alias it."""
        options = self._options
        cpu_only = all_on_cpu(source)
        live = options.live
        if live is None:  # a sharded bus is written by copies, each rank its shards
            live = (
                shared
                and cpu_only
                and not sharded(source)
                and options.mode != "copy"
                and options.apply == "background"
            )
        if live and not cpu_only:
            raise ValueError("writes=Live() shares CPU tensors: these weights are on a GPU")
        publisher = Publisher(
            on_cpu(source),
            address,
            name=name,
            writes=Live() if live else options.writes or Copy(),
            shm_dir=shm_dir,
            **options.bus,
        )
        self._check_lag(publisher)
        self._live = live
        bus = _Bus(source, publisher)
        self._buses.append(bus)
        return bus

    def _check_lag(self, publisher: Publisher) -> None:
        """Refuse, where the bus starts, a bound its slots cannot hold (not at the first
        ``update_policy_weights_()``)."""
        allowed, lag = publisher.max_lag_allowed, self._options.lag
        if lag is not None and allowed is not None and lag > allowed:
            raise ValueError(
                f"sync={lag} needs slots >= {lag + 1} on bus {publisher.name!r} (it has "
                f"{allowed + 1}): pass slots={lag + 1} to ZmqWeightSyncScheme"
            )

    def send(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> None:
        """Publish a version: `weights` (None: re-read the source) to every worker, or,
        with per-worker buses, ``{worker_idx: weights}`` to those listed."""
        if self._worker_buses:
            self._publish_per_worker(weights, worker_ids, max_lag=max_lag)
        elif per_worker(weights):
            if len({id(w) for w in weights.values()}) > 1:
                raise ValueError(
                    "weights for each worker ({worker_idx: weights}) need a scheme with "
                    "per_worker_weights=True (or distinct policy factories)"
                )
            self._publish(next(iter(weights.values())), worker_ids, max_lag=max_lag)
        else:
            self._publish(weights, worker_ids, max_lag=max_lag)

    def _publish_per_worker(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> None:
        """Publish on each worker's bus: its own weights, or the same to every one."""
        if per_worker(weights):
            plan = {int(i): payload(w) for i, w in weights.items()}
            if worker_ids is not None:
                chosen = set(self._indices(worker_ids))
                plan = {i: w for i, w in plan.items() if i in chosen}
        else:
            every = payload(weights) if weights is not None else self._broadcast
            plan = dict.fromkeys(self._indices(worker_ids), every)
        unknown = sorted(set(plan) - set(self._worker_buses))
        if unknown:
            raise ValueError(f"no torchrl worker {unknown} on this scheme's buses")
        handles = [
            self._worker_buses[i].publish(w, workers=None, max_lag=None) for i, w in plan.items()
        ]
        if max_lag is not None:  # one deadline each, all running at once
            for handle in handles:
                handle.wait(max_lag=max_lag)
        if handles:
            self.last_publish = handles[-1]
            self._on_version(max(h.version for h in handles))

    def _indices(self, worker_ids: Any) -> list[int]:
        if worker_ids is None:
            return sorted(self._worker_buses)
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("worker_ids of a per-worker scheme are torchrl worker indices")
        return ids

    def _publish(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> None:
        assert self._bus is not None  # start() made one bus, or per-worker buses
        publish = self._bus.publish(
            None if weights is None else payload(weights),
            workers=self._targets(worker_ids),
            max_lag=max_lag,
        )
        self.last_publish = publish
        self._on_version(publish.version)

    def _targets(self, worker_ids: Any) -> list[str] | None:
        """torchrl worker indices (or zmqsync worker ids) as zmqsync worker ids."""
        if worker_ids is None:
            return None
        assert self._rendezvous is not None
        ids = [worker_ids] if isinstance(worker_ids, int | str) else list(worker_ids)
        names = []
        for worker in ids:
            if isinstance(worker, bool) or not isinstance(worker, int | str):
                raise TypeError(
                    f"worker_ids must be torchrl worker indices or zmqsync worker ids, "
                    f"not {type(worker).__name__}"
                )
            names.append(self._rendezvous.worker(worker) if isinstance(worker, int) else worker)
        return names

    def close(self) -> None:
        """Close the buses (in the process that started them). Idempotent."""
        closer, self._closer = self._closer, None
        if closer is not None:
            closer()
        self._bus, self._worker_buses = None, {}
