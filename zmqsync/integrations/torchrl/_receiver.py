"""The receiver's side of a `ZmqWeightSyncScheme`: each torchrl worker (or a collector
started on its own) joins the bus with a `zmqsync.Subscriber` bound to its policy, follows
the policy when torchrl replaces it, and with manual apply takes the newest version at the
start of each rollout."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from ..._reads import Aliases, Copies, Reads
from ..._subscriber import Subscriber
from ._options import Options, Rendezvous
from ._weights import materialize

__all__ = ["SchemeReceiver", "start_subscriber"]

log = logging.getLogger(__name__)

# How long a rollout's start waits for a version the publisher wrote but whose RECEIVE has
# not reached this worker yet (normally well under a millisecond).
_SAFE_POINT_WAIT_S = 1.0


def start_subscriber(
    model: Any,
    *,
    name: str,
    address: str | None,
    worker_id: str | None,
    mode: str,
    apply: str,
    timeout: float | None,
    shm_dir: str | None,
    on_update: Callable[[int], None],
) -> Subscriber:
    """The one place the scheme makes a `zmqsync.Subscriber`, so that a change of its
    constructor is a change here.

    Raises:
        ConnectTimeout: no publisher answered at the address within `timeout`.
        LayoutMismatch: `model`'s weights differ from what the bus carries.
    """
    manual = apply == "manual"  # on_update: after each apply, before the ack
    reads: Reads = (
        Aliases(manual=manual, on_update=on_update)
        if mode == "alias"
        else Copies(manual=manual, on_update=on_update)
    )
    return Subscriber(
        address,
        model,
        name=name,
        reads=reads,
        worker_id=worker_id,
        timeout=timeout,
        shm_dir=shm_dir,
    ).start()


class SchemeReceiver:
    """A worker's membership of the bus: one Subscriber, bound to the worker's policy.

    Args:
        options: the scheme's options (``apply``, ``timeout``).
        rendezvous: where the bus is, as the sender left it in the pickled scheme.
        worker_idx: torchrl's worker index (None: a collector started on its own).
        on_version: called with the version the policy computes with, after each apply
            (on the Subscriber's thread with background apply).

    Raises:
        ValueError: no sender set this scheme up, and it names no bus to join.
    """

    def __init__(
        self,
        options: Options,
        rendezvous: Rendezvous,
        worker_idx: int | None,
        on_version: Callable[[int], None],
    ) -> None:
        if rendezvous.name is None and rendezvous.address is None:
            raise ValueError(
                "this ZmqWeightSyncScheme was not set up by a sender: pass the bus's name "
                '(ZmqWeightSyncScheme(name="policy")) to attach to a bus started elsewhere'
            )
        self.worker_idx = worker_idx
        self._options = options
        self._rendezvous = rendezvous
        self._on_version = on_version
        self._subscriber: Subscriber | None = None
        self._bound_model: Any = None
        self._hooked_context: Any = None
        self._closer: weakref.finalize[..., Any] | None = None

    @property
    def subscriber(self) -> Subscriber | None:
        return self._subscriber

    @property
    def manual(self) -> bool:
        return self._options.apply == "manual"

    def join(self, model: Any, strategy: Any, context: Any) -> None:
        """Join the bus: the policy gets the current version before this returns.

        Args:
            model: the worker's policy; meta-device parameters (torchrl ships workers a
                stateless policy) get CPU storage first.
            strategy: torchrl's weight strategy, to fill a stateless policy.
            context: the worker's collector, if known (see `adopt`).

        Raises:
            ConnectTimeout: no sender answered at the bus's address within ``timeout``.
            LayoutMismatch: the policy's weights differ from what the bus carries.
        """
        materialize(model, strategy)
        rendezvous = self._rendezvous
        worker_id = rendezvous.worker_id
        if self.worker_idx is not None:
            worker_id = rendezvous.worker(self.worker_idx)
        name, address = rendezvous.bus_of(self.worker_idx)
        self._bound_model = model
        self._subscriber = start_subscriber(
            model,
            name=name,
            address=address,
            worker_id=worker_id,
            mode=rendezvous.mode,
            apply=self._options.apply,
            timeout=self._options.timeout,
            shm_dir=rendezvous.shm_dir,
            on_update=self._on_version,
        )
        # closed when the scheme is collected, or at exit (torchrl never shuts it down)
        self._closer = weakref.finalize(self, self._subscriber.close)
        if context is not None:
            self.adopt(context)

    def adopt(self, context: Any) -> None:
        """The worker's collector is known: align its version; with manual apply, take
        the newest version at the start of each of its rollouts.

        Raises:
            TypeError: manual apply, and `context` is not a torchrl collector.
        """
        assert self._subscriber is not None
        self._on_version(self._subscriber.version)
        if not self.manual or self._hooked_context is context:
            return
        from torchrl.collectors import BaseCollector  # loaded already: context is a collector

        if not isinstance(context, BaseCollector):
            raise TypeError(
                f'apply="manual" needs a torchrl collector with pre_collect_hook, '
                f"not {type(context).__name__}; call scheme.receive() at your safe points"
            )
        context.pre_collect_hook = _SafePoint(self, context.pre_collect_hook)
        self._hooked_context = context

    def rebind(self, model: Any, strategy: Any, context: Any) -> None:
        """torchrl replaced the worker's policy (e.g. a copy on the policy device)."""
        if model is self._bound_model:
            return
        log.info(
            "policy of worker %s replaced: re-attaching to bus %r",
            self.worker_idx,
            self._rendezvous.name,
        )
        self.close()
        self.join(model, strategy, context)

    def receive(self, timeout: float | None) -> Any:
        """Manual apply: apply the newest version now, if one arrived (see the scheme's
        ``receive``); background apply: None."""
        sub = self._subscriber
        if sub is None:
            raise RuntimeError("receive() is for a receiver, after connect()")
        if not self.manual or not sub.poll(0.0 if timeout is None else timeout):
            return None
        return sub.weights

    @property
    def version(self) -> int:
        return self._subscriber.version if self._subscriber is not None else -1

    def close(self) -> None:
        """Leave the bus. Idempotent."""
        sub, self._subscriber = self._subscriber, None
        self._bound_model = None
        closer, self._closer = self._closer, None
        if closer is not None:
            closer.detach()
        if sub is not None:
            sub.close()


class _SafePoint:
    """A collector's pre_collect_hook that first applies the newest version (manual mode)."""

    def __init__(self, receiver: SchemeReceiver, previous: Callable[[], None] | None) -> None:
        self.receiver = receiver
        self.previous = previous

    def __call__(self) -> None:
        sub = self.receiver.subscriber
        if sub is not None:
            self.receiver.receive(None)
            if sub.connected and (lag := sub.lag):
                # Written (the header names it) but not arrived yet: a worker of a
                # multi-process collector starts a rollout only when the trainer asks,
                # and the trainer's update may be waiting, under sync=k, for this version.
                sub.wait_for_version(sub.version + lag, timeout=_SAFE_POINT_WAIT_S)
        if self.previous is not None:
            self.previous()
