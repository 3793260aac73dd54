"""torchrl adapter: `ZmqWeightSyncScheme`, a torchrl ``WeightSyncScheme`` on a zmqsync bus.

Change one line of a torchrl script::

    collector = MultiSyncCollector(
        [make_env] * 4, policy, frames_per_batch=256, total_frames=-1,
        weight_sync_schemes={"policy": ZmqWeightSyncScheme()},  # was SharedMemWeightSyncScheme()
        track_policy_version=True,      # optional: every frame says which version acted
    )
    for batch in collector:
        ...                                  # train `policy`
        collector.update_policy_weights_()   # publishes version v+1; every worker applied it

It hooks in where torchrl's ``SharedMemWeightSyncScheme`` does:

* **Sender** (the process that owns the collector, or a trainer on its own):
  ``init_on_sender`` starts a `zmqsync.Publisher` over the policy — version 0 — before
  torchrl starts its workers; ``send()``, which ``update_policy_weights_()`` calls, is
  ``Publisher.publish()``.
* **Receivers** (each torchrl worker, or a collector started on its own with
  ``weight_recv_schemes=``): ``connect()`` starts a `zmqsync.Subscriber` bound to the
  worker's policy. The bus name and address travel in the scheme's pickled state as
  plain strings — no tensor, handle or queue is pickled — so a process torchrl did not
  spawn attaches the same way, by name.
* **Versions** are the bus's: the sender sets the collector's ``policy_version`` to each
  published version, and a receiver sets its collector's ``PolicyVersion`` transform to
  the version it applied. With ``track_policy_version=True`` on the collector, every
  frame's ``("next", "policy_version")`` names the version whose weights chose its action
  (the root ``"policy_version"`` is stamped one step earlier, when the observation was
  made).
* **Failure** is the bus's: a dead worker is dropped after ~6 missed heartbeats, so
  ``update_policy_weights_()`` never hangs on it; a worker that joins late gets the
  current version at once.
* **Live or atomic.** torchrl's schemes share a CPU policy's tensors with the workers:
  an in-place change of the trainer's weights reaches them before
  ``update_policy_weights_()``. This scheme does the same where torchrl would (the
  collector's own CPU policy, or a ``params_map`` the caller put in shared memory): a
  live bus (``Publisher(writes=Live())``), alias workers, a publish that only notifies.
  Elsewhere, and with ``writes=Copy()`` given, versions are atomic copies.
* **Per-worker weights** (``per_worker_weights=True``, distinct policy factories, or a
  ``params_map`` of distinct TensorDicts): one bus per worker, ``<name>-<i>``.
* **Lifetime.** torchrl never shuts a scheme down: a scheme dropped with its collector
  closes its buses when it is garbage-collected (reference cycles included).
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from .._config import DEFAULT, check_name, default_address, default_worker_id
from .._config import shm_dir as resolve_shm_dir
from .._publisher import Publish, Publisher, check_options
from .._subscriber import Subscriber
from .._writes import Copy, Live

try:
    from tensordict import TensorDictBase
    from torchrl.envs.llm.transforms import PolicyVersion
    from torchrl.weight_update.utils import _resolve_model
    from torchrl.weight_update.weight_sync_schemes import (
        WeightSyncScheme,
        register_weight_sync_backend,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    from .._extras import install_hint

    raise ImportError(
        f"zmqsync.integrations.torchrl needs torchrl (>= 0.14): {install_hint('torchrl')}"
    ) from exc

from ._torchrl_weights import (  # noqa: E402 - after the check that torchrl is there
    all_on_cpu,
    check_params_map,
    find_model,
    generated_name,
    materialize,
    on_cpu,
    payload,
    per_worker,
    private_copy,
    workers_on_cpu,
)

__all__ = ["ZmqWeightSyncScheme"]

log = logging.getLogger(__name__)

# Senders a forked child inherited from its parent. They belong to the parent: closing
# them here would unlink the parent's segment, so they are kept alive, never closed.
_INHERITED_SENDERS: list[_Sender] = []

# How long a rollout's start waits for a version the publisher wrote but whose RECEIVE has
# not reached this worker yet (normally well under a millisecond).
_SAFE_POINT_WAIT_S = 1.0


def _check_bus_options(bus: Mapping[str, Any]) -> None:
    """Options for the Publisher are passed through, and checked by the Publisher's own
    check here, where the scheme is made, not later in a collector's constructor."""
    parameters = inspect.signature(Publisher).parameters
    known = set(parameters) - {"weights", "address", "name"}
    unknown = sorted(set(bus) - known)
    if unknown:
        raise TypeError(
            f"ZmqWeightSyncScheme got unknown option(s) {', '.join(unknown)}; it passes "
            f"these to zmqsync.Publisher: {', '.join(sorted(known))}"
        )
    given = {name: bus.get(name, parameters[name].default) for name in known - {"shm_dir"}}
    check_options(**given)


class ZmqWeightSyncScheme(WeightSyncScheme):  # type: ignore[misc]
    """Synchronize one model of a torchrl collector through a zmqsync bus.

    Args:
        name: bus name. None: a unique name is chosen by the sender and handed to
            torchrl's workers; give one to let collectors started elsewhere attach
            (``ZmqWeightSyncScheme(name="policy")`` on both sides).
        address: control address; None: ``ipc://<runtime dir>/<name>.sock``.
        mode: receivers' apply mode, "copy" (the policy keeps its tensors) or "alias"
            (its parameters become read-only views into the shared buffer; CPU only).
            None: "alias" on a live bus, else "copy".
        apply: "background" (a thread applies each version on arrival, as torchrl's
            schemes do) or "manual" (a worker applies the newest version at the start of
            its next rollout, or when ``collector.receive_weights()`` is called, so a
            rollout never mixes two versions).
        sync: whether ``update_policy_weights_()`` waits until every worker applied the
            version. None: True with apply="background", False with "manual" (a manual
            worker applies at its next rollout, which a sync collector starts only after
            the update returns).
        max_lag: bounded staleness (instead of `sync`): ``update_policy_weights_()``
            returns once every worker applied at least the version ``max_lag`` before the
            one it publishes (``Publisher.publish(max_lag=)``; 0 is ``sync=True``, None
            ``sync=False``). A copying bus needs ``slots >= max_lag + 1`` (checked when
            the sender starts); a live bus has no such limit.
        attach: the bus is published elsewhere (by a trainer's scheme or a
            `zmqsync.Publisher` named `name`): a collector given this scheme starts no
            bus; its workers join that one, and its ``update_policy_weights_()`` does
            nothing (the trainer publishes).
        worker_id: a receiver's id on the bus; for torchrl's worker ``i`` the prefix of
            ``<worker_id>-w<i>``. None: ``<name>-w<i>`` (``<host>-<pid>-w<i>`` with
            attach=True), and ``<host>-<pid>`` for a collector started on its own.
        strategy: torchrl's weight format for ``apply_weights``; kept for compatibility.
        per_worker_weights: each torchrl worker gets weights of its own (one bus per
            worker); set by itself for distinct policy factories or a ``params_map`` of
            distinct TensorDicts. ``send({i: weights_i})`` updates worker ``i``.
        **bus: options of `zmqsync.Publisher`, passed to it as they are: ``slots``,
            ``timeout``, ``on_timeout``, ``heartbeat``, ``writes``, ``security``,
            ``shm_dir``. ``writes`` is also the one knob for a live bus:
            ``writes=Live()``: the trainer's tensors move into the bus's segment and the
            workers alias them, as torchrl's schemes share a CPU policy (versions are not
            atomic: see the zmqsync guide); any other ``writes`` (``Copy()``): atomic
            versions, copied at each publish; left out: live where torchrl's semantics
            require it (the collector's own CPU policy, or a ``params_map`` already in
            shared memory) unless ``mode="copy"`` or ``apply="manual"`` asks for copies.
            Receivers use ``timeout`` for their handshake and the sender's ``shm_dir``.
            Their names are checked here, their values by the Publisher when the sender
            starts.
    """

    def __init__(
        self,
        name: str | None = None,
        address: str | None = None,
        *,
        mode: str | None = None,
        apply: str = "background",
        sync: bool | None = None,
        max_lag: int | None = DEFAULT,
        attach: bool = False,
        worker_id: str | None = None,
        strategy: str = "tensordict",
        per_worker_weights: bool = False,
        **bus: Any,
    ) -> None:
        self._sender: _Sender | None = None
        self._worker_senders: dict[int, _Sender] = {}  # per-worker weights: bus per worker
        self._worker_buses: dict[int, tuple[str, str]] = {}  # worker -> (name, address)
        self._closers: list[weakref.finalize[..., Any]] = []  # close the buses when collected
        self._receiver_closer: weakref.finalize[..., Any] | None = None
        self._broadcast: Any = None  # per-worker weights: what send(None) publishes to all
        self._subscriber: Subscriber | None = None
        self._bound_model: Any = None
        self._hooked_context: Any = None
        self._version_lock = threading.Lock()
        self.last_publish: Publish | None = None
        super().__init__(strategy)
        if mode not in (None, "copy", "alias"):
            raise ValueError(f'mode must be "copy" or "alias", not {mode!r}')
        if apply not in ("background", "manual"):
            raise ValueError(f'apply must be "background" or "manual", not {apply!r}')
        _check_bus_options(bus)
        # one knob for a live bus: writes=Live() asks for it, any other writes= for atomic
        # copies; left out, the sender decides (see `_start`)
        live = isinstance(bus["writes"], Live) if "writes" in bus else None
        if attach and name is None and address is None:
            raise ValueError("attach=True needs the name (or address) of the bus to join")
        if live and (mode == "copy" or apply == "manual"):
            raise ValueError(
                "writes=Live() shares the trainer's tensors with alias workers: not with "
                'mode="copy" or apply="manual"'
            )
        if per_worker_weights and address is not None:
            raise ValueError(
                "per_worker_weights=True names one bus per worker: give name=, not address="
            )
        self._name = None if name is None else check_name(name)
        self._address = address
        self._mode_arg = mode
        self._mode = mode or "copy"  # resolved by the sender (live: "alias")
        self._live_arg = live
        self._live = bool(live)
        self.per_worker_weights = per_worker_weights
        self._apply = apply
        self._max_lag = _resolve_lag(apply, sync, max_lag)
        self._bus = {k: v for k, v in bus.items() if k != "writes"}
        self._writes = bus.get("writes", Copy())
        self._timeout = bus.get("timeout", 10.0)
        self._attach_only = attach
        self._worker_id = worker_id
        self._shm_dir = self._bus.pop("shm_dir", None)

    # --- what users look at ----------------------------------------------------------

    @property
    def name(self) -> str | None:
        """The bus name (chosen by the sender when None was given)."""
        return self._name

    @property
    def address(self) -> str | None:
        """The bus's control address, once the sender started it (or as given)."""
        return self._address

    @property
    def publisher(self) -> Publisher | None:
        """The sender's `zmqsync.Publisher` (``.workers``, ``.version``), else None."""
        return self._sender.publisher if self._sender is not None else None

    @property
    def publishers(self) -> dict[int, Publisher]:
        """Per-worker weights: each torchrl worker's `zmqsync.Publisher`, by index."""
        return {i: sender.publisher for i, sender in self._worker_senders.items()}

    @property
    def live(self) -> bool:
        """Whether the bus is live (the trainer's tensors are the shared buffer)."""
        return self._live

    @property
    def max_lag(self) -> int | None:
        """The bound ``update_policy_weights_()`` waits for (0: every worker applied the
        version; None: it does not wait)."""
        return self._max_lag

    @property
    def sync(self) -> bool:
        """Whether ``update_policy_weights_()`` waits until every worker applied the
        version (torchrl's schemes name this ``sync``; here it is ``max_lag == 0``)."""
        return self._max_lag == 0

    @property
    def subscriber(self) -> Subscriber | None:
        """A receiver's `zmqsync.Subscriber` (``.version``, ``.connected``), else None."""
        return self._subscriber

    @property
    def version(self) -> int:
        """Sender: the last published version. Receiver: the version its policy computes
        with. -1 before either side is set up."""
        if self._sender is not None:
            return self._sender.publisher.version
        if self._worker_senders:
            return max(sender.publisher.version for sender in self._worker_senders.values())
        if self._subscriber is not None:
            return self._subscriber.version
        return -1

    def __enter__(self) -> ZmqWeightSyncScheme:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        sending = self._sender or self._worker_senders
        side = "sender" if sending else "receiver" if self._subscriber else "idle"
        options = f"{self._mode}/{self._apply}{'/live' if self._live else ''}"
        return f"<ZmqWeightSyncScheme {self._name!r} {side} v{self.version} {options}>"

    # --- sender side -------------------------------------------------------------------

    def _init_on_sender_impl(
        self,
        *,
        model_id: str | None = None,
        context: Any = None,
        model: Any = None,
        weights: Any = None,
        params_map: Any = None,
        **_ignored: Any,
    ) -> None:
        """Start the bus (one per worker with per-worker weights) over the model, at
        version 0, before torchrl starts its workers.

        ``devices``, ``num_workers`` and ``ctx`` are accepted and ignored: the buffer is
        on the CPU and each worker copies to its own device.

        Raises:
            ValueError: nothing to publish was given, or ``params_map`` is not a
                ``{worker_idx: TensorDict}`` alone.
        """
        if self._sender is not None or self._worker_senders:
            return
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
        if self._attach_only:  # workers join the bus by its address, resolved here
            self._address = self._address or default_address(self._name or "weights")
            self._shm_dir = resolve_shm_dir(self._shm_dir)
            self._worker_id = self._worker_id or default_worker_id()
            return
        if params_map is not None and (model is not None or weights is not None):
            raise ValueError("params_map= gives the weights: no model= or weights= with it")
        source, shared = self._sources(context, model, weights, params_map)
        self._name = self._name or generated_name(self.model_id)
        self._shm_dir = resolve_shm_dir(self._shm_dir)
        if isinstance(source, dict):  # per-worker weights: a bus of its own for each
            self.per_worker_weights = True
            for idx, worker_source in sorted(source.items()):
                sender = self._start(worker_source, f"{self._name}-{idx}", None, shared=False)
                self._worker_senders[idx] = sender
                self._worker_buses[idx] = (sender.publisher.name, sender.publisher.address)
        else:
            self._sender = self._start(source, self._name, self._address, shared=shared)
            self._address = self._sender.publisher.address
        self._sync_tracker(0)

    def _check_lag(self, publisher: Publisher) -> None:
        """Refuse, where the bus starts, a bound its slots cannot hold (not at the first
        ``update_policy_weights_()``)."""
        allowed, lag = publisher.max_lag_allowed, self._max_lag
        if lag is not None and allowed is not None and lag > allowed:
            raise ValueError(
                f"max_lag={lag} needs slots >= {lag + 1} on bus {publisher.name!r} (it has "
                f"{allowed + 1}): pass slots={lag + 1} to ZmqWeightSyncScheme"
            )

    def _sources(self, context: Any, model: Any, weights: Any, params_map: Any) -> tuple[Any, bool]:
        """What the buses publish: one source, or ``{worker_idx: source}``; and whether
        torchrl would share it with the workers (the collector's own policy, or weights
        the caller put in shared memory)."""
        shared = False
        if params_map is not None:
            workers = check_params_map(params_map)
            if len({id(td) for td in workers.values()}) > 1 or self.per_worker_weights:
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
            found = find_model(context, self.model_id)
            if isinstance(found, dict):  # distinct policy factories
                return found, False
            if not isinstance(found, nn.Module | TensorDictBase):
                raise TypeError(
                    f"model {self.model_id!r} of {type(context).__name__} is a "
                    f"{type(found).__name__}, not a module with weights; a policy without "
                    "weights (e.g. RandomPolicy) needs no weight sync scheme"
                )
            source, shared = found, workers_on_cpu(context)
        if not self.per_worker_weights:
            return source, shared
        count = getattr(context, "num_workers", None)
        if not isinstance(count, int):
            raise ValueError(
                "per_worker_weights=True needs the collector (context=) or a params_map= "
                "to know how many workers there are"
            )
        self._broadcast = source  # send() without per-worker weights publishes it to all
        return {i: private_copy(source) for i in range(count)}, False

    def _start(self, source: Any, name: str, address: str | None, *, shared: bool) -> _Sender:
        """Start one bus over `source` (live where torchrl shares it, see `live`)."""
        cpu_only = all_on_cpu(source)
        if self._live_arg is None:
            live = shared and cpu_only and self._mode_arg != "copy" and self._apply == "background"
        else:
            live = self._live_arg
        if live and not cpu_only:
            raise ValueError("writes=Live() shares CPU tensors: these weights are on a GPU")
        self._live = live
        self._mode = "alias" if live else self._mode_arg or "copy"
        publisher = Publisher(
            on_cpu(source),
            address,
            name=name,
            writes=Live() if live else self._writes,
            shm_dir=self._shm_dir,
            **self._bus,
        )
        self._check_lag(publisher)
        sender = _Sender(source, publisher)
        # torchrl never shuts a scheme down: its buses close when it is collected
        self._closers.append(weakref.finalize(self, _close_sender, sender))
        return sender

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        """Workers fetch the current version when they join; explicit weights are published."""
        if weights is not None:
            self._send(weights, None, max_lag=None)

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Publish a new version; with ``sync`` wait until every worker applied it (with
        ``max_lag=k``, until none is more than k versions behind it).

        Args:
            weights: None (re-read the model the bus was started over), a module, a
                TensorDict or a state_dict with the same keys, shapes and dtypes, or the
                name of a model of the collector; with per-worker weights also
                ``{worker_idx: weights}`` (each listed worker gets its own).
            worker_ids: torchrl worker indices (or zmqsync worker ids) that must apply
                this version before ``send`` returns; the others receive it too.

        Raises:
            PublishTimeout: with on_timeout="raise", workers did not apply the version
                within ``timeout`` (``.missing`` names them).
            LayoutMismatch: ``weights`` differ from the bus's keys, shapes or dtypes.
        """
        if self._attach_only:
            log.debug("update_policy_weights_() on an attached bus: the trainer publishes")
            return
        self._send(weights, worker_ids, max_lag=self._max_lag)

    def _send(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> None:
        if isinstance(weights, str):
            weights = _resolve_model(self.context, weights)
        if self._worker_senders:
            self._publishper_worker(weights, worker_ids, max_lag=max_lag)
        elif per_worker(weights):
            if len({id(w) for w in weights.values()}) > 1:
                raise ValueError(
                    "weights for each worker ({worker_idx: weights}) need a scheme with "
                    "per_worker_weights=True (or distinct policy factories)"
                )
            self._publish(next(iter(weights.values())), worker_ids, max_lag=max_lag)
        else:
            self._publish(weights, worker_ids, max_lag=max_lag)

    def _publishper_worker(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> None:
        """Publish on each worker's bus: its own weights, or the same to every one."""
        if per_worker(weights):
            plan = {int(i): payload(w) for i, w in weights.items()}
            if worker_ids is not None:
                chosen = set(self._indices(worker_ids))
                plan = {i: w for i, w in plan.items() if i in chosen}
        else:
            every = payload(weights) if weights is not None else self._broadcast
            plan = dict.fromkeys(self._indices(worker_ids), every)
        unknown = sorted(set(plan) - set(self._worker_senders))
        if unknown:
            raise ValueError(f"no torchrl worker {unknown} on this scheme's buses")
        handles = [
            self._worker_senders[i].publish(w, workers=None, max_lag=None) for i, w in plan.items()
        ]
        if max_lag is not None:  # one deadline each, all running at once
            for handle in handles:
                handle.wait(max_lag=max_lag)
        if handles:
            self.last_publish = handles[-1]
            self._sync_tracker(max(h.version for h in handles))

    def _indices(self, worker_ids: Any) -> list[int]:
        if worker_ids is None:
            return sorted(self._worker_senders)
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("worker_ids of a per-worker scheme are torchrl worker indices")
        return ids

    def _publish(self, weights: Any, worker_ids: Any, *, max_lag: int | None) -> Publish:
        if self._sender is None:
            raise RuntimeError("ZmqWeightSyncScheme.send() needs init_on_sender() first")
        publish = self._sender.publish(
            None if weights is None else payload(weights),
            workers=self._targets(worker_ids),
            max_lag=max_lag,
        )
        self.last_publish = publish
        self._sync_tracker(publish.version)
        return publish

    def _targets(self, worker_ids: Any) -> list[str] | None:
        if worker_ids is None:
            return None
        ids = [worker_ids] if isinstance(worker_ids, int | str) else list(worker_ids)
        names = []
        for worker in ids:
            if isinstance(worker, bool) or not isinstance(worker, int | str):
                raise TypeError(
                    f"worker_ids must be torchrl worker indices or zmqsync worker ids, "
                    f"not {type(worker).__name__}"
                )
            names.append(self._worker_name(worker) if isinstance(worker, int) else worker)
        return names

    def _worker_name(self, worker_idx: int) -> str:
        return f"{self._worker_id or self._name or 'weights'}-w{worker_idx}"

    # --- receiver side -----------------------------------------------------------------

    def _init_on_receiver_impl(
        self,
        model_id: str,
        context: Any = None,
        *,
        model: Any = None,
        worker_idx: int | None = None,
        **_ignored: Any,
    ) -> None:
        self.model_id = model_id
        if context is not None:
            model = find_model(context, model_id) if model is None else model
            worker_idx = getattr(context, "worker_idx", worker_idx)
            self.context = context
        if model is not None:
            self.model = model
        self.worker_idx = worker_idx

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        """Join the bus: the policy gets the current version before this returns.

        Raises:
            ConnectTimeout: no sender answered at the bus's address within ``timeout``.
            LayoutMismatch: the policy's weights differ from what the bus carries.
        """
        if self._name is None and self._address is None:
            raise ValueError(
                "this ZmqWeightSyncScheme was not set up by a sender: pass the bus's name "
                '(ZmqWeightSyncScheme(name="policy")) to attach to a bus started elsewhere'
            )
        if worker_idx is not None:
            self.worker_idx = worker_idx
        model = self.model
        if model is None:
            raise ValueError(f"no model to update for {self.model_id!r}")
        self._join(model)

    def _join(self, model: Any) -> None:
        materialize(model, self._strategy)
        worker_id = self._worker_id
        if self.worker_idx is not None:
            worker_id = self._worker_name(self.worker_idx)
        name, address = self._name or "weights", self._address
        if self._worker_buses:  # per-worker weights: this worker's own bus
            if self.worker_idx not in self._worker_buses:
                raise ValueError(f"no bus for torchrl worker {self.worker_idx} on this scheme")
            name, address = self._worker_buses[self.worker_idx]
        self._bound_model = model
        self._subscriber = Subscriber(
            address,
            model,
            name=name,
            mode=self._mode,
            apply=self._apply,
            worker_id=worker_id,
            timeout=self._timeout,
            on_update=self._sync_tracker,  # after each apply, before the ack
            shm_dir=self._shm_dir,
        ).start()
        # closed when this scheme is collected, or at exit (torchrl never shuts it down)
        self._receiver_closer = weakref.finalize(self, self._subscriber.close)
        if self.context is not None:
            self._adopt(self.context)

    def receive(self, timeout: float | None = None) -> Any:
        """Manual apply: apply the newest version now, if one arrived.

        ``collector.receive_weights()`` calls this. In background mode versions apply by
        themselves and this returns None.

        Args:
            timeout: seconds to wait for a version to arrive; None: do not wait.

        Returns:
            The applied weights (a TensorDict), or None when nothing new was applied.
        """
        sub = self._subscriber
        if sub is None:
            raise RuntimeError("receive() is for a receiver, after connect()")
        if self._apply != "manual" or not sub.poll(0.0 if timeout is None else timeout):
            return None
        return sub.weights

    def _adopt(self, context: Any) -> None:
        """The receiver's collector is known: align its version, hook manual applies."""
        assert self._subscriber is not None
        self._sync_tracker(self._subscriber.version)
        if self._apply != "manual" or self._hooked_context is context:
            return
        from torchrl.collectors import BaseCollector  # loaded already: context is a collector

        if not isinstance(context, BaseCollector):
            raise TypeError(
                f'apply="manual" needs a torchrl collector with pre_collect_hook, '
                f"not {type(context).__name__}; call scheme.receive() at your safe points"
            )
        context.pre_collect_hook = _SafePoint(self, context.pre_collect_hook)
        self._hooked_context = context

    def _rebind(self, model: Any) -> None:
        """torchrl replaced the worker's policy (e.g. a copy on the policy device)."""
        log.info("policy of %s replaced: re-attaching to bus %r", self.worker_idx, self._name)
        if self._subscriber is not None:
            self._subscriber.close()
            self._subscriber = None
        self._join(model)

    def _close_receiver(self) -> None:
        sub, self._subscriber = self._subscriber, None
        self._bound_model = None
        closer, self._receiver_closer = self._receiver_closer, None
        if closer is not None:
            closer.detach()
        if sub is not None:
            sub.close()

    # --- torchrl's hooks into the scheme -------------------------------------------------

    @property
    def context(self) -> Any:
        return WeightSyncScheme.context.fget(self)

    @context.setter
    def context(self, context: Any) -> None:
        WeightSyncScheme.context.fset(self, context)
        if context is not None and self._subscriber is not None:
            self._adopt(context)

    @property
    def model(self) -> Any:
        return WeightSyncScheme.model.fget(self)

    @model.setter
    def model(self, model: Any) -> None:
        WeightSyncScheme.model.fset(self, model)
        if self._subscriber is not None and model is not None and model is not self._bound_model:
            self._rebind(model)

    def _sync_tracker(self, version: int) -> None:
        """Make the collector's PolicyVersion (if any) say the bus version."""
        context = self.context
        tracker = getattr(context, "policy_version_tracker", None)
        if isinstance(tracker, PolicyVersion) and tracker.version_type in (int, "int"):
            with self._version_lock:
                tracker.version = version

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: the zmqsync bus is the transport."""
        raise NotImplementedError("ZmqWeightSyncScheme moves weights through its zmqsync bus")

    def shutdown(self) -> None:
        """Close the bus (sender) or leave it (receiver). Idempotent.

        torchrl's collectors do not shut their schemes down: call this (or use the scheme
        as a context manager) after ``collector.shutdown()``.
        """
        closers, self._closers = getattr(self, "_closers", []), []
        self._sender, self._worker_senders = None, {}
        for closer in closers:
            closer()  # closes the bus once; a forked child's inherited bus is left alone
        if getattr(self, "_subscriber", None) is not None:
            self._close_receiver()
        super().shutdown()

    def __getstate__(self) -> dict[str, Any]:
        """What torchrl pickles to its workers: options, bus name and address — strings."""
        state: dict[str, Any] = super().__getstate__()
        state.update(
            _sender=None,
            _worker_senders={},
            _closers=[],
            _receiver_closer=None,
            _broadcast=None,
            _subscriber=None,
            _bound_model=None,
            _hooked_context=None,
            _version_lock=None,
            last_publish=None,
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        inherited = self.__dict__.get("_sender")
        if inherited is not None and inherited.pid != os.getpid():
            _INHERITED_SENDERS.append(inherited)  # forked child: the parent's, never closed here
        super().__setstate__(state)
        self._version_lock = threading.Lock()


class _Sender:
    """The trainer's side: a started Publisher, and what publish() re-reads by default."""

    def __init__(self, source: Any, publisher: Publisher) -> None:
        self.pid = os.getpid()
        self.publisher = publisher.start()
        # A model on another device is staged through a CPU copy: re-read it each time.
        self._staged = None if all_on_cpu(source) else source

    def publish(self, weights: Any, *, workers: list[str] | None, max_lag: int | None) -> Publish:
        if weights is None:
            weights = self._staged
        return self.publisher.publish(weights, workers=workers, max_lag=max_lag)


def _resolve_lag(apply: str, sync: bool | None, max_lag: int | None) -> int | None:
    """The bound ``update_policy_weights_()`` waits for, from `sync` or `max_lag`."""
    if max_lag is DEFAULT:
        return 0 if (apply == "background" if sync is None else sync) else None
    if sync is not None and sync != (max_lag is not None):
        raise ValueError(f"sync={sync} contradicts max_lag={max_lag}: give one of them")
    if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int)):
        raise ValueError(f"max_lag must be an int >= 0 or None, not {max_lag!r}")
    if max_lag is not None and max_lag < 0:
        raise ValueError(f"max_lag must be an int >= 0 or None, not {max_lag!r}")
    return max_lag


def _close_sender(sender: _Sender) -> None:
    """Close a scheme's bus, in the process that started it (never in a forked child)."""
    if sender.pid == os.getpid():
        sender.publisher.close()


class _SafePoint:
    """A collector's pre_collect_hook that first applies the newest version (manual mode)."""

    def __init__(self, scheme: ZmqWeightSyncScheme, previous: Callable[[], None] | None) -> None:
        self.scheme = scheme
        self.previous = previous

    def __call__(self) -> None:
        sub = self.scheme.subscriber
        if sub is not None:
            self.scheme.receive()
            if sub.connected and (lag := sub.lag):
                # Written (the header names it) but not arrived yet: a worker of a
                # multi-process collector starts a rollout only when the trainer asks,
                # and the trainer's update may be waiting, under max_lag, for this version.
                sub.wait_for_version(sub.version + lag, timeout=_SAFE_POINT_WAIT_S)
        if self.previous is not None:
            self.previous()


# ``WeightSyncScheme.from_backend("zmq", **options)`` builds this scheme once this module
# is imported (torchrl looks backends up by name in its own registry; it has no entry points).
register_weight_sync_backend("zmq")(ZmqWeightSyncScheme)
