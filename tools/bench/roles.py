"""What every process the harness starts shares: its death with its parent, its reports,
the order of a round's sides, and the one place that builds a ``Subscriber``.

A scenario's role processes (a trainer, its workers, a storm) are often scripts started
by path from ``/tmp``, so that ``PYTHONPATH`` alone decides which ``zmqsync`` they
import; they reach this file with ``sys.path.insert(0, <tools/bench>)`` and ``import
roles``. So it imports nothing of ``tools`` and nothing heavy at module level: a raw
ZeroMQ worker that imports it must not pay for torch.

`subscriber` is the only ``zmqsync.Subscriber(...)`` call under tools/bench: how a
worker reads a version (``reads=``) is spelled in one place, so a change of the
constructor is one edit here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import zmqsync

T = TypeVar("T")


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphan keeps sockets)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def say(**record: Any) -> None:
    """One JSON line on stdout: how a role process reports to the process that drives it."""
    print(json.dumps(record), flush=True)


def rotated(items: Sequence[T], i: int) -> list[T]:
    """Round `i`'s order: the sides rotate, so none is always first or last."""
    k = i % len(items) if items else 0
    return [*items[k:], *items[:k]]


def subscriber(
    address: str | None = None,
    model: Any = None,
    *,
    mode: str = "copy",
    apply: str = "background",
    flat: bool = False,
    device: str | None = None,
    on_update: Callable[[int], None] | None = None,
    **options: Any,
) -> zmqsync.Subscriber:
    """A ``zmqsync.Subscriber`` (not started) as the harness's workers read versions.

    The harness names a worker's way of reading as its tables do (mode copy or alias,
    background or manual apply); this turns it into the constructor's ``reads=``.

    Args:
        address: the bus's control address; None: the library's default for ``name``.
        model: what the versions are applied to; None: the subscriber's own tensors.
        mode: "copy" (``Copies``) or "alias" (``Aliases``).
        apply: "background" (the worker's thread applies) or "manual" (``poll()`` does).
        flat: a copy worker's model in one block (an alias worker has no such choice).
        device: where the worker's tensors live; None: the library's choice.
        on_update: called with each version applied, before the ack.
        **options: every other constructor option (name, worker_id, timeout, shm_dir,
            security), passed as they are.
    """
    import zmqsync

    if mode not in ("copy", "alias") or apply not in ("background", "manual"):
        raise ValueError(f"mode copy|alias and apply background|manual, not {mode!r} {apply!r}")
    manual = apply == "manual"
    reads: zmqsync.Copies | zmqsync.Aliases = (
        zmqsync.Aliases(device=device, manual=manual, on_update=on_update)
        if mode == "alias"
        else zmqsync.Copies(device=device, flat=flat, manual=manual, on_update=on_update)
    )
    return zmqsync.Subscriber(address, model, reads=reads, **options)
