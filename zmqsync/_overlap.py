"""Publishing off the training loop's critical path.

A version is a copy of every tensor into a free slot, and that copy is the price of
atomic versions: 64 MB costs ~5 ms, 1 GB ~60-90 ms here, per publish. With the trainer's
optimizer known, most of it moves off the training thread:

* The tensors the optimizer writes (its parameters) change only in ``step()``. A
  `Writer` thread copies them into the slot while the trainer runs its next forward and
  backward passes, then the publisher announces the version (RECEIVE goes out only once
  every byte is in place, so no worker can see a half-written version).
* The other tensors (buffers: BatchNorm statistics change during forward) are copied
  before ``publish()`` returns.
* A `StepGuard` hooks every optimizer's ``step()``: it waits, only if the copy of the
  version before is unfinished, and the time it waits is the training thread's cost.
* CUDA parameters are copied on a side stream, after an event the trainer's streams
  recorded at ``publish()``; ``step()`` then makes its own streams wait for the copy's
  events (the GPU waits, the host does not) once the copy is queued.

What this cannot see: a parameter written outside ``optimizer.step()`` between a
publish and the end of its copy (``p.data.copy_(...)``, an EMA update, loading a
checkpoint) may tear that version. Publish after such writes, or write with ``Copy()``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._errors import ZmqSyncError

__all__ = ["Pending", "SideStreams", "StepGuard", "Writer"]

log = logging.getLogger(__name__)


class Pending:
    """A version whose optimizer-written tensors are still being copied.

    CUDA tensors (`on_gpu`): the writer thread queues their copy on a side stream and
    sets `queued` with an event per device in `copied`; a step then waits for those
    events on its own streams (on the GPU), not for the copy on the host.
    """

    __slots__ = ("copied", "done", "error", "guard_wait", "on_gpu", "queued", "written_at")

    def __init__(self, on_gpu: bool = False) -> None:
        self.done = threading.Event()
        self.queued = threading.Event()
        self.on_gpu = on_gpu
        self.copied: list[torch.cuda.Event] = []
        self.error: BaseException | None = None
        self.guard_wait = 0.0  # seconds optimizer steps waited for this copy
        self.written_at: float | None = None  # perf_counter when it was announced

    def wait(self, timeout: float | None) -> None:
        """Block until the copy ended (raising its error) or `timeout` passed."""
        if not self.done.wait(timeout):
            raise TimeoutError("the background copy of a version did not end in time")
        if self.error is not None:
            raise ZmqSyncError(f"publishing in the background failed: {self.error!r}") from (
                self.error
            )

    def wait_queued(self, timeout: float | None) -> None:
        """Block until the GPU copy is queued (or the job ended), raising its error."""
        if not self.queued.wait(timeout):
            raise TimeoutError("the background copy of a version was not queued in time")
        if self.error is not None:
            self.wait(0)


class Writer:
    """The thread that finishes versions: one at a time, in order.

    It holds no reference to the publisher between jobs (a job is a callable that the
    publisher hands over and the queue drops once run), so a publisher collected
    without close() is not kept alive by it.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[Pending], None], Pending] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=f"zmqsync-write-{name}")
        self._thread.daemon = True
        self._thread.start()

    def submit(self, job: Callable[[Pending], None], *, on_gpu: bool = False) -> Pending:
        """Run `job(pending)` on the writer thread after the jobs before it."""
        pending = Pending(on_gpu)
        self._jobs.put((job, pending))
        return pending

    def close(self, timeout: float = 10.0) -> None:
        """Finish what was submitted, then stop."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the publisher's writer thread did not stop within %.0f s", timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, pending = item
            try:
                job(pending)
            except BaseException as exc:  # reported where the version is waited for
                log.exception("publishing a version in the background failed")
                pending.error = exc
            finally:
                pending.written_at = time.perf_counter()
                pending.queued.set()
                pending.done.set()
            del job, item  # nothing of the publisher's stays referenced while idle


class StepGuard:
    """A pre-hook on each optimizer's ``step()``: wait for the pending copy, if any.

    `on_wait(seconds)` hears each wait (for the metrics), once it ended.
    """

    def __init__(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        timeout: float | None,
        on_wait: Callable[[float], None] | None = None,
    ):
        self.pending: Pending | None = None
        self._timeout = timeout
        self._on_wait = on_wait
        self._optimizers = list(optimizers)
        self._hooks = [opt.register_step_pre_hook(self._before_step) for opt in self._optimizers]

    def owned(self) -> set[int]:
        """The ids of the tensors the optimizers write (their parameters)."""
        return {id(p) for opt in self._optimizers for g in opt.param_groups for p in g["params"]}

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        pending = self.pending
        if pending is None or pending.done.is_set():
            return
        started = time.perf_counter()
        try:
            if pending.on_gpu:  # the step's kernels wait for the copy, the host does not
                pending.wait_queued(self._timeout)
                for event in pending.copied:
                    torch.cuda.current_stream(event.device).wait_event(event)
            else:
                pending.wait(self._timeout)
        finally:
            waited = time.perf_counter() - started
            pending.guard_wait += waited
            if self._on_wait is not None:
                self._on_wait(waited)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


class SideStreams:
    """The writer thread's CUDA work goes to one side stream per device (made once), so
    the copy runs beside the trainer's next forward and backward."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    @staticmethod
    def events(devices: Iterable[torch.device]) -> list[torch.cuda.Event]:
        """An event on each device's current stream now: recorded by the trainer, the
        writer's copy starts after the kernels queued before publish(); recorded by the
        writer, a step's kernels start after the copy."""
        events = []
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events

    @contextlib.contextmanager
    def on(self, devices: list[torch.device], after: list[torch.cuda.Event]) -> Iterator[None]:
        """Run the block's CUDA work on the side streams, after the events `after`."""
        with contextlib.ExitStack() as stack:
            for device in devices:
                stream = self._streams.get(device)
                if stream is None:
                    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                    self._streams[device] = stream
                stack.enter_context(torch.cuda.stream(stream))
            for event in after:
                torch.cuda.current_stream(event.device).wait_event(event)
            yield
