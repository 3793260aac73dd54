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

It hooks in where torchrl's ``SharedMemWeightSyncScheme`` does. torchrl's scheme is one
object that plays sender or receiver; this one is a thin façade over two private sides,
each holding only its own state:

* **Sender** (``_sender.SchemeSender``; the process that owns the collector, or a trainer
  on its own): ``init_on_sender`` starts a `zmqsync.Publisher` over the policy — version
  0 — before torchrl starts its workers; ``send()``, which ``update_policy_weights_()``
  calls, is ``Publisher.publish()``.
* **Receivers** (``_receiver.SchemeReceiver``; each torchrl worker, or a collector started
  on its own with ``weight_recv_schemes=``): ``connect()`` starts a `zmqsync.Subscriber`
  bound to the worker's policy. What they need of the sender (``_options.Rendezvous``:
  the bus name, address, shm dir) travels in the scheme's pickled state as plain strings —
  no tensor, handle or queue is pickled — so a process torchrl did not spawn attaches the
  same way, by name.
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
* **Sharded trainers.** A policy whose tensors are DTensors (FSDP2, tensor parallel) is
  published by every rank together: each rank builds the scheme with the same ``name=``
  and ``init_on_sender(model=...)`` (a collective, as ``zmqsync.Publisher`` is), then
  calls ``send()``; the lowest rank hosts the bus and waits as ``sync`` says, the others
  write their shards and return once the version is announced. Receivers get full
  tensors. A multi-process collector holding a DTensor policy is refused (torchrl's
  workers cannot run one).
* **Lifetime.** torchrl never shuts a scheme down: a scheme dropped with its collector
  closes its buses when it is garbage-collected (reference cycles included).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

try:
    from torchrl.envs.llm.transforms import PolicyVersion
    from torchrl.weight_update.utils import _resolve_model
    from torchrl.weight_update.weight_sync_schemes import (
        WeightSyncScheme,
        register_weight_sync_backend,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    from ..._extras import install_hint

    raise ImportError(
        f"zmqsync.integrations.torchrl needs torchrl (>= 0.14): {install_hint('torchrl')}"
    ) from exc

# after the check that torchrl is there
from ..._publisher import Publish, Publisher  # noqa: E402
from ..._subscriber import Subscriber  # noqa: E402
from ._options import Options, Rendezvous  # noqa: E402
from ._receiver import SchemeReceiver  # noqa: E402
from ._sender import SchemeSender  # noqa: E402
from ._weights import find_model  # noqa: E402

__all__ = ["ZmqWeightSyncScheme"]

log = logging.getLogger(__name__)

# Senders a forked child inherited from its parent. They belong to the parent: closing
# them here would unlink the parent's segment, so they are kept alive, never closed.
_INHERITED_SENDERS: list[SchemeSender] = []


class ZmqWeightSyncScheme(WeightSyncScheme):  # type: ignore[misc]
    """Synchronize one model of a torchrl collector through a zmqsync bus.

    **How long an update waits is one knob, ``sync``**, the name torchrl's own schemes,
    their configs and ``WeightSyncScheme.from_backend(backend, sync=...)`` use, so code
    written for torchrl's schemes passes it unchanged. torchrl's values keep their
    meaning (``True``: wait until every worker applied the version; ``False``: do not
    wait), and an int ``k`` adds what torchrl has no word for: bounded staleness, where
    ``update_policy_weights_()`` returns once no worker is more than ``k`` versions behind
    the one it publishes (``Publisher.publish(max_lag=k)``). ``scheme.sync`` reads it back
    (True, False or k), as torchrl's schemes expose ``.sync``.

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
        sync: how long ``update_policy_weights_()`` waits. True: until every worker
            applied the version. False: it does not wait. An int ``k >= 1``: until every
            worker applied at least the version ``k`` before the one it publishes; a
            copying bus needs ``slots >= k + 1`` (checked when the sender starts), a live
            bus has no such limit. ``0`` is refused: as a number it reads True, as a flag
            False. None: True with apply="background", False with "manual" (a manual
            worker applies at its next rollout, which a sync collector starts only after
            the update returns).
        attach: the bus is published elsewhere (by a trainer's scheme or a
            `zmqsync.Publisher` named `name`): a collector given this scheme starts no
            bus; its workers join that one, and its ``update_policy_weights_()`` does
            nothing (the trainer publishes).
        worker_id: a receiver's id on the bus; for torchrl's worker ``i`` the prefix of
            ``<worker_id>-w<i>``. None: ``<name>-w<i>`` (``<host>-<pid>-w<i>`` with
            attach=True), and ``<host>-<pid>`` for a collector started on its own.
        strategy: torchrl's weight format ("tensordict" or "state_dict"), which torchrl's
            base class takes; used here to fill the stateless policy torchrl ships.
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

    Raises:
        ValueError: an option out of range, or two that contradict each other.
        TypeError: an option neither the scheme nor the Publisher knows, or ``sync``
            neither a bool nor an int.
    """

    def __init__(
        self,
        name: str | None = None,
        address: str | None = None,
        *,
        mode: str | None = None,
        apply: str = "background",
        sync: bool | int | None = None,
        attach: bool = False,
        worker_id: str | None = None,
        strategy: str = "tensordict",
        per_worker_weights: bool = False,
        **bus: Any,
    ) -> None:
        self._sender: SchemeSender | None = None
        self._receiver: SchemeReceiver | None = None
        self._version_lock = threading.Lock()
        super().__init__(strategy)
        self._options = Options.of(mode=mode, apply=apply, sync=sync, attach=attach, bus=bus)
        if attach and name is None and address is None:
            raise ValueError("attach=True needs the name (or address) of the bus to join")
        if per_worker_weights and address is not None:
            raise ValueError(
                "per_worker_weights=True names one bus per worker: give name=, not address="
            )
        self._rendezvous = Rendezvous.given(
            name, address, worker_id, bus.get("shm_dir"), self._options
        )
        self.per_worker_weights = per_worker_weights

    # --- what users look at ----------------------------------------------------------

    @property
    def name(self) -> str | None:
        """The bus name (chosen by the sender when None was given)."""
        return self._rendezvous.name

    @property
    def address(self) -> str | None:
        """The bus's control address, once the sender started it (or as given)."""
        return self._rendezvous.address

    @property
    def sync(self) -> bool | int:
        """How long ``update_policy_weights_()`` waits: True (every worker applied the
        version), False (no wait) or k (no worker more than k versions behind)."""
        return self._options.sync

    @property
    def live(self) -> bool:
        """Whether the bus is live (the trainer's tensors are the shared buffer)."""
        return self._rendezvous.live

    @property
    def publisher(self) -> Publisher | None:
        """The sender's `zmqsync.Publisher` (``.workers``, ``.version``), else None."""
        return self._sender.publisher if self._sender is not None else None

    @property
    def publishers(self) -> dict[int, Publisher]:
        """Per-worker weights: each torchrl worker's `zmqsync.Publisher`, by index."""
        return self._sender.publishers if self._sender is not None else {}

    @property
    def last_publish(self) -> Publish | None:
        """The sender's last update (``.acked``, ``.missing``, ``.lags``), else None."""
        return self._sender.last_publish if self._sender is not None else None

    @property
    def subscriber(self) -> Subscriber | None:
        """A receiver's `zmqsync.Subscriber` (``.version``, ``.connected``), else None."""
        return self._receiver.subscriber if self._receiver is not None else None

    @property
    def version(self) -> int:
        """Sender: the last published version. Receiver: the version its policy computes
        with. -1 before either side is set up."""
        if self._sender is not None:
            return self._sender.version
        if self._receiver is not None:
            return self._receiver.version
        return -1

    def __enter__(self) -> ZmqWeightSyncScheme:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        side = "sender" if self._sender else "receiver" if self.subscriber else "idle"
        live = "/live" if self.live else ""
        options = f"{self._rendezvous.mode}/{self._options.apply}{live}"
        return f"<ZmqWeightSyncScheme {self.name!r} {side} v{self.version} {options}>"

    # --- sender side: torchrl's calls, handed to the SchemeSender ------------------------

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

        A model (or weights) holding DTensors starts a collective bus: every rank of the
        trainer calls this at the same moment, with the same ``name=``.

        Raises:
            ValueError: nothing to publish was given, or ``params_map`` is not a
                ``{worker_idx: TensorDict}`` alone; DTensor weights and no ``name=``.
            TypeError: a multi-process collector whose policy holds DTensors, or
                per-worker weights that do.
        """
        if self._sender is not None:
            return
        self.model_id = model_id or "policy"
        if context is not None:
            self.context = context
        if self._options.attach:  # workers join the bus by its address, resolved here
            self._rendezvous = self._rendezvous.attached()
            return
        sender = SchemeSender(self._options, self._sync_tracker)
        self._rendezvous = sender.start(
            self,
            self._rendezvous,
            model_id=self.model_id,
            context=context,
            model=model,
            weights=weights,
            params_map=params_map,
            per_worker_weights=self.per_worker_weights,
        )
        self._sender = sender
        self.per_worker_weights = self.per_worker_weights or bool(self._rendezvous.worker_buses)
        self._sync_tracker(0)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        """Workers fetch the current version when they join; explicit weights are published."""
        if weights is not None and self._sender is not None:
            self._sender.send(self._resolved(weights), None, max_lag=None)

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Publish a new version; wait as ``sync`` says (every worker applied it, none
        more than k versions behind it, or no wait).

        Args:
            weights: None (re-read the model the bus was started over), a module, a
                TensorDict or a state_dict with the same keys, shapes and dtypes, or the
                name of a model of the collector; with per-worker weights also
                ``{worker_idx: weights}`` (each listed worker gets its own).
            worker_ids: torchrl worker indices (or zmqsync worker ids) that must apply
                this version before ``send`` returns; the others receive it too.

        A sharded policy (DTensors): every rank calls ``send()`` as often as the others.
        The host rank (the lowest) waits as ``sync`` says and its ``last_publish`` has
        the acks; another rank writes its shards and returns once the version is
        announced, its ``last_publish`` with the version and no acks (``sync`` and
        ``worker_ids`` wait nowhere there).

        Raises:
            PublishTimeout: with on_timeout="raise", workers did not apply the version
                within ``timeout`` (``.missing`` names them).
            LayoutMismatch: ``weights`` differ from the bus's keys, shapes or dtypes.
            RuntimeError: no ``init_on_sender()`` before.
            ZmqSyncError: a sharded policy, and another rank died, stalled past
                ``timeout`` or failed its own ``send()`` (every rank is told; workers keep
                the last complete version).
        """
        if self._options.attach:
            log.debug("update_policy_weights_() on an attached bus: the trainer publishes")
            return
        if self._sender is None:
            raise RuntimeError("ZmqWeightSyncScheme.send() needs init_on_sender() first")
        self._sender.send(self._resolved(weights), worker_ids, max_lag=self._options.lag)

    def _resolved(self, weights: Any) -> Any:
        """torchrl may name a model of the collector instead of giving its weights."""
        return _resolve_model(self.context, weights) if isinstance(weights, str) else weights

    # --- receiver side: torchrl's calls, handed to the SchemeReceiver --------------------

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
            ValueError: no sender set this scheme up and it names no bus, or no model.
        """
        if worker_idx is not None:
            self.worker_idx = worker_idx
        receiver = SchemeReceiver(
            self._options, self._rendezvous, self.worker_idx, self._sync_tracker
        )
        model = self.model
        if model is None:
            raise ValueError(f"no model to update for {self.model_id!r}")
        receiver.join(model, self._strategy, self.context)
        self._receiver = receiver

    def receive(self, timeout: float | None = None) -> Any:
        """Manual apply: apply the newest version now, if one arrived.

        ``collector.receive_weights()`` calls this. In background mode versions apply by
        themselves and this returns None.

        Args:
            timeout: seconds to wait for a version to arrive; None: do not wait.

        Returns:
            The applied weights (a TensorDict), or None when nothing new was applied.

        Raises:
            RuntimeError: not a receiver (no ``connect()`` after ``init_on_receiver``).
        """
        if self._receiver is None:
            raise RuntimeError("receive() is for a receiver, after connect()")
        return self._receiver.receive(timeout)

    # --- torchrl's hooks into the scheme -------------------------------------------------

    @property
    def context(self) -> Any:
        return WeightSyncScheme.context.fget(self)

    @context.setter
    def context(self, context: Any) -> None:
        WeightSyncScheme.context.fset(self, context)
        if context is not None and self.subscriber is not None:
            assert self._receiver is not None
            self._receiver.adopt(context)

    @property
    def model(self) -> Any:
        return WeightSyncScheme.model.fget(self)

    @model.setter
    def model(self, model: Any) -> None:
        WeightSyncScheme.model.fset(self, model)
        if model is not None and self.subscriber is not None:
            assert self._receiver is not None
            self._receiver.rebind(model, self._strategy, self.context)

    def _sync_tracker(self, version: int) -> None:
        """Make the collector's PolicyVersion (if any) say the bus version."""
        tracker = getattr(self.context, "policy_version_tracker", None)
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
        sender, self._sender = getattr(self, "_sender", None), None
        if sender is not None:
            sender.close()  # closes the bus once; a forked child's inherited bus is left alone
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()
        super().shutdown()

    def __getstate__(self) -> dict[str, Any]:
        """What torchrl pickles to its workers: the options and the rendezvous (the bus's
        name, address and shm dir: strings), neither side's running state."""
        state: dict[str, Any] = super().__getstate__()
        state.update(_sender=None, _receiver=None, _version_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        inherited = self.__dict__.get("_sender")
        if inherited is not None and inherited.pid != os.getpid():
            _INHERITED_SENDERS.append(inherited)  # forked child: the parent's, never closed here
        super().__setstate__(state)
        self._version_lock = threading.Lock()


# ``WeightSyncScheme.from_backend("zmq", **options)`` builds this scheme once this module
# is imported (torchrl looks backends up by name in its own registry; it has no entry points).
register_weight_sync_backend("zmq")(ZmqWeightSyncScheme)
