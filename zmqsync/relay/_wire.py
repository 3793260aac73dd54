"""The data plane: one version's bytes over a torch.distributed process group.

A version travels as a header tensor (magic, generation, version, bytes), then the flat
slot bytes in chunks, each a send/recv pair from rank 0 (the root) to every target rank
(tags 0 for the header, 1, 2, ... for the chunks). Point to point rather than a
broadcast: a relay posts the receives of the next version into a free slot *before* the
root announces it (a posted gloo receive has no deadline; only waiting for it has), so
the bytes move the moment the root sends them. Every wait carries a timeout.

A process group is made per generation, on a ``PrefixStore`` of the root's TCPStore
(never the global default group, which the trainer may use for its own training), and
dropped whole when the generation ends: torch.distributed cannot cancel a collective,
and a group whose collective failed is not used again.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from .._errors import ZmqSyncError
from .._layout import Key, Layout, torch_dtype
from .._protocol import TensorSpec
from .._security import is_loopback
from ._rendezvous import source_ip

__all__ = [
    "HEADER_MAGIC",
    "GroupThread",
    "Posted",
    "Wire",
    "WireError",
    "check_backend",
    "flat_slot",
    "gloo_devices",
    "layout_of",
    "new_process_group",
    "on_cpu",
    "payload_bytes",
    "release",
    "views_of",
]

HEADER_MAGIC = 0x59414C4552535A  # b"ZSRELAY" little-endian: first word of every header
OPS_IN_FLIGHT = 2  # chunk collectives posted ahead (gloo runs them on its own threads)


class WireError(ZmqSyncError):
    """A collective failed or timed out, or brought a header for another version."""


# --- slots as bytes ------------------------------------------------------------------------


def _template(manifest: Sequence[TensorSpec]) -> dict[Key, torch.Tensor]:
    """Zero-memory tensors with the manifest's keys, dtypes and shapes (stride-0 views)."""
    return {
        spec.key: torch.empty((), dtype=torch_dtype(spec.dtype)).expand(spec.shape)
        for spec in manifest
    }


def on_cpu(manifest: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """The manifest of a CPU bus with the same bytes: every buffer uses the same offsets,
    and the root sends the CPU segment's slot (which holds a copy of GPU tensors while a
    CPU-transport worker, the relay root, is on the bus)."""
    return tuple(spec if spec.buffer == 0 else replace(spec, buffer=0) for spec in manifest)


def layout_of(manifest: Sequence[TensorSpec]) -> Layout:
    """The layout a Publisher builds for these tensors; it must equal the root's.

    Raises:
        ZmqSyncError: the root lays its tensors out differently (another zmqsync).
    """
    layout = Layout.of(_template(manifest))
    if layout.specs != tuple(manifest):
        raise ZmqSyncError(
            "the root's manifest is not laid out the way this zmqsync lays it out (offsets "
            "differ); run the same zmqsync version on every host"
        )
    return layout


def payload_bytes(manifest: Sequence[TensorSpec]) -> int:
    """The bytes of a slot that travel: from its start to the end of its last tensor.

    The rest of a slot is alignment padding, and a subscriber's alias storage may end
    where the last tensor does (one storage per slot, its pointer swapped per version).
    """
    return max(spec.offset + spec.nbytes for spec in manifest)


def flat_slot(view: torch.Tensor, first: TensorSpec, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of the slot that `view` (the tensor of `first`) lives in, as
    flat uint8 (`nbytes`: its `payload_bytes`).

    Raises:
        ZmqSyncError: `view` is not a view into a slot that holds `nbytes` bytes.
    """
    storage = view.untyped_storage()
    start = view.storage_offset() * view.element_size() - first.offset
    if start < 0 or start + nbytes > storage.nbytes():
        raise ZmqSyncError("the tensors are not views into one shared slot")
    flat: torch.Tensor = torch.empty(0, dtype=torch.uint8).set_(storage, start, (nbytes,), (1,))
    return flat


def views_of(manifest: Sequence[TensorSpec], flat: torch.Tensor) -> dict[Key, torch.Tensor]:
    """The manifest's tensors as views of `flat`, bytes laid out as in a slot."""
    return {
        spec.key: flat[spec.offset : spec.offset + spec.nbytes]
        .view(torch_dtype(spec.dtype))
        .view(spec.shape)
        for spec in manifest
    }


# --- process groups ------------------------------------------------------------------------


def check_backend(backend: str, device: str | None) -> torch.device | None:
    """The CUDA device of the NCCL staging buffer; None for gloo.

    Raises:
        ValueError: an unknown backend, or NCCL without CUDA and NCCL here.
    """
    if backend == "gloo":
        return None
    if backend != "nccl":
        raise ValueError(f'backend must be "gloo" or "nccl", not {backend!r}')
    if not dist.is_nccl_available() or not torch.cuda.is_available():
        raise ValueError(
            'backend="nccl" needs a CUDA build of torch with NCCL and a GPU on this host; '
            'use backend="gloo"'
        )
    return torch.device(device or f"cuda:{torch.cuda.current_device()}")


def gloo_devices(host: str) -> list[Any]:
    """The network devices gloo uses in a group whose rendezvous is at `host`.

    ``GLOO_SOCKET_IFNAME`` (torch's variable: interface names, comma-separated) wins; a
    loopback rendezvous keeps gloo on 127.0.0.1; else gloo binds the address this host
    reaches `host` from (the route to the root). Not torch's default device, which
    binds the address the host name resolves to: on Debian that is 127.0.1.1, in a
    container or a network namespace often nothing (then loopback), and the other
    hosts cannot connect to either. A group made by hand ignores GLOO_SOCKET_IFNAME
    unless it is read here (only ``init_process_group`` reads it).

    Raises:
        ValueError: no route from this host to `host`.
    """
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return [dist.ProcessGroupGloo.create_device(interface=name) for name in names]
    if is_loopback(f"tcp://{host}:0"):
        return [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return [dist.ProcessGroupGloo.create_device(hostname=source_ip(host))]


def new_process_group(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    *,
    backend: str,
    host: str,
    form_timeout: float,
    op_timeout: float,
) -> Any:
    """A process group of its own (not the global default group) for one generation."""
    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
    timeout = datetime.timedelta(seconds=form_timeout)
    pg: Any
    # torch has no public way to give a group its own timeout and (gloo) network device
    # without the global default group: its option objects are the only way in
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # noqa: SLF001 (see above)
        opts._timeout = timeout  # noqa: SLF001 (see above)
        opts._devices = gloo_devices(host)  # noqa: SLF001 (see above)
        pg = dist.ProcessGroupGloo(prefixed, rank, world, opts)
    else:
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = timeout  # noqa: SLF001 (see above)
        pg = dist.ProcessGroupNCCL(prefixed, rank, world, nccl_opts)
    pg.set_timeout(datetime.timedelta(seconds=op_timeout))
    return pg


def release() -> None:
    """Collect now: a dropped process group must close its sockets at once (peers blocked
    in a receive then fail immediately instead of at their timeout)."""
    gc.collect()


# --- one version on the wire ---------------------------------------------------------------


class Wire:
    """The transfer of one version on a generation's group (see the module doc).

    gloo moves the slot bytes directly; NCCL moves them through a CUDA staging buffer of
    one chunk (the buses are CPU buffers) and cannot post ahead.
    """

    def __init__(
        self,
        pg: Any,
        backend: str,
        chunk_bytes: int,
        op_timeout: float,
        device: torch.device | None,
    ) -> None:
        self.pg, self.backend, self.chunk = pg, backend, chunk_bytes
        self.timeout = datetime.timedelta(seconds=op_timeout)
        self.device = device
        self._stage: torch.Tensor | None = None

    def header(self, gen: int, version: int, nbytes: int) -> torch.Tensor:
        return torch.tensor([HEADER_MAGIC, gen, version, nbytes], dtype=torch.int64)

    def post_send(
        self, flat: torch.Tensor, header: torch.Tensor, ranks: Sequence[int]
    ) -> Callable[[], None]:
        """Root side: post the first sends of `header`, then `flat`, to every rank in
        `ranks` now (posting never blocks); the returned call posts the rest chunk by
        chunk and waits (on the group's executor thread: waiting may block)."""
        tensors = [header, *self._chunks(flat)]
        if self.device is not None:
            return partial(self._run_staged, tensors, ranks, send=True)
        ops = [(t, rank, tag) for tag, t in enumerate(tensors) for rank in ranks]
        return _Ops(self, ops, send=True, window=OPS_IN_FLIGHT * len(ranks)).finish

    def post_receive(self, into: torch.Tensor, slot: int | None = None) -> Posted:
        """Relay side: post the receives of a header and of `into` (local bus slot `slot`,
        or a staging buffer), all at once with gloo; NCCL receives them in `finish`."""
        got = torch.zeros(4, dtype=torch.int64)
        tensors = [got, *self._chunks(into)]
        if self.device is not None:
            wait: Callable[[], None] = partial(self._run_staged, tensors, (0,), send=False)
        else:
            ops = [(t, 0, tag) for tag, t in enumerate(tensors)]
            wait = _Ops(self, ops, send=False, window=len(ops)).finish
        return Posted(self, into, slot, got, wait)

    def op(self, tensor: torch.Tensor, peer: int, tag: int, *, send: bool) -> Any:
        """Post one send or receive; its work object is waited for with `timeout`."""
        if send:
            return self.pg.send([tensor], peer, tag)
        return self.pg.recv([tensor], peer, tag)

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off : off + self.chunk] for off in range(0, flat.numel(), self.chunk)]

    def _run_staged(self, tensors: list[torch.Tensor], ranks: Sequence[int], *, send: bool) -> None:
        for tag, tensor in enumerate(tensors):
            stage = self._staging(tensor)
            if send:
                stage.copy_(tensor)
            for rank in ranks:
                self.op(stage, rank, tag, send=send).wait(self.timeout)
            if not send:
                tensor.copy_(stage)

    def _staging(self, like: torch.Tensor) -> torch.Tensor:
        """A CUDA buffer of one chunk, as bytes (the header fits in it too)."""
        if self._stage is None:
            self._stage = torch.empty(self.chunk, dtype=torch.uint8, device=self.device)
        return self._stage.view(torch.uint8)[: like.numel() * like.element_size()].view(like.dtype)


class _Ops:
    """Operations (tensor, peer, tag) in order, at most `window` outstanding; the first
    `window` are posted at once. Each wait carries the wire's timeout."""

    def __init__(
        self, wire: Wire, ops: list[tuple[torch.Tensor, int, int]], *, send: bool, window: int
    ) -> None:
        self.wire, self.ops, self.send, self.window = wire, ops, send, max(1, window)
        self.pending: list[Any] = []
        self.posted = 0
        self._post()

    def _post(self) -> None:
        while self.posted < len(self.ops) and len(self.pending) < self.window:
            tensor, peer, tag = self.ops[self.posted]
            self.pending.append(self.wire.op(tensor, peer, tag, send=self.send))
            self.posted += 1

    def finish(self) -> None:
        while self.pending:
            self.pending.pop(0).wait(self.wire.timeout)
            self._post()


@dataclass
class Posted:
    """A relay's receives of one version, posted (gloo) or to run (NCCL) into `into`."""

    wire: Wire
    into: torch.Tensor
    slot: int | None  # the local bus slot `into` is, if it is one
    got: torch.Tensor  # the header lands here
    wait: Callable[[], None]

    def finish(self, gen: int, version: int, nbytes: int) -> None:
        """Wait for the bytes, then check that the header names this version.

        Raises:
            WireError: the header names another generation, version or size, or the
                transfer failed or timed out.
        """
        try:
            self.wait()
        except RuntimeError as exc:  # torch.distributed: error or timeout
            raise WireError(str(exc)) from None
        expect = self.wire.header(gen, version, nbytes)
        if not torch.equal(self.got, expect):
            raise WireError(
                f"header {self.got.tolist()} does not match the announced {expect.tolist()}"
            )


class GroupThread:
    """A generation's process group on the root and the thread that runs its collectives.

    The executor thread is the only one that blocks inside torch.distributed; others wait
    on the `Future` with a deadline. `close()` never blocks: the thread drops the process
    group as soon as its current operation returns (gloo then closes its sockets).
    """

    def __init__(self, thread_name: str) -> None:
        self.pg: Any = None
        self.wire: Wire | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)
        pg = self.pg
        if pg is not None and pg.name() == "nccl":
            with contextlib.suppress(Exception):  # unblocks a stuck NCCL collective
                pg.abort()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # reported to the waiting thread, without
                    future.set_exception(exc.with_traceback(None))  # frames that hold the pg
            del job, fn, future
        self.pg = self.wire = None
        release()  # no cycle keeps the group alive: gloo closes its sockets now
