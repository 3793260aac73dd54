"""CUDA buffers: one dedicated allocation per device, shared once through CUDA IPC.

Publisher side (`CudaBuffer`):

* The buffer is one ``torch.empty(slots * slot_bytes, dtype=uint8)`` allocated inside a
  private ``torch.cuda.MemPool``. A CUDA IPC handle names a whole ``cudaMalloc`` segment,
  not a tensor; in the default caching allocator that segment may also hold unrelated
  tensors of the trainer, which every subscriber could then read. A private pool gets
  fresh segments that hold this buffer alone (the buffer starts at offset 0, which is
  checked). Without MemPool (old torch) the buffer is not exported at all.
* Expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) are shared
  by torch through file descriptors, which cannot travel in a message. The allocation
  is made with that setting switched off for its duration; if the handle is still not a
  plain ``cudaMalloc`` one, the buffer is described without a handle and with the reason
  (`BufferInfo.ipc_note`), and every subscriber reads the CPU copy instead.
* The handle comes from torch's own CUDA IPC reduction (``storage._share_cuda_()``),
  called once. Only its 64 ``cudaIpcMemHandle_t`` bytes travel (`BufferInfo.handle`),
  with the device's UUID and the publisher's PID namespace. torch's reference-counter
  file and IPC event are deliberately not sent: the publisher synchronizes its stream
  before every RECEIVE (so no event is needed), and a subscriber never opens a shared
  memory file whose name came from the network. The price: torch keeps the allocation in
  its IPC "limbo" after the publisher closes (a subscriber may still alias it), so the
  GPU memory of a closed CUDA publisher comes back when the trainer process exits.

Subscriber side (`CudaAttachment`): the handle is opened once, at the handshake, with
``torch.UntypedStorage._new_shared_cuda`` on the local device whose UUID matches (fixed
local code, nothing unpickled), and wrapped in a flat uint8 tensor; slots are views of
it. `opens()` counts the handles this process opened, so tools can prove that no handle
is opened after the handshake. A subscriber in the publisher's own process uses the
publisher's tensor directly (a process cannot open its own IPC handle).

CUDA memory cannot be mapped read-only: an alias-mode worker that writes into its
weights changes everyone's (the CPU transport faults instead).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from .._errors import ProtocolError
from .._protocol import BufferInfo
from .base import AttachedBuffer, SharedBuffer
from .transport import (
    IPC_HANDLE_BYTES,
    expandable_segments,
    normalize_uuid,
    pid_namespace,
    raw_ipc_handle,
)

__all__ = [
    "CudaAttachment",
    "CudaBuffer",
    "IpcOpenFailed",
    "cuda_available",
    "device_uuid",
    "opens",
    "visible_uuids",
]

log = logging.getLogger(__name__)

# Handles exported by this process -> the exporting tensor: a subscriber in the same
# process (tests, notebooks) uses the tensor itself.
_LOCAL_EXPORTS: dict[bytes, torch.Tensor] = {}
_OPENS = 0
_OPENS_LOCK = threading.Lock()


class IpcOpenFailed(Exception):
    """The driver refused a CUDA IPC handle. Internal: the subscriber falls back to CPU."""


def cuda_available() -> bool:
    """``torch.cuda.is_available()`` (a seam: tests without a GPU pretend to have one)."""
    return torch.cuda.is_available()


def opens() -> int:
    """How many CUDA IPC handles this process has opened so far."""
    return _OPENS


def device_uuid(device: torch.device | int) -> str:
    """``GPU-<uuid>`` of a local CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return normalize_uuid(str(props.uuid))


def visible_uuids() -> list[str]:
    """UUIDs of ``cuda:0``, ``cuda:1``, ... as this process sees them (may be empty)."""
    if not cuda_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def _without_expandable_segments() -> Iterator[None]:
    """Switch expandable segments off around an allocation that must be IPC-shareable."""
    if not expandable_segments(os.environ):
        yield
        return
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    try:
        if settings is not None:
            settings("expandable_segments:False")
    except RuntimeError as exc:  # the handle check below reports what this means
        log.debug("could not switch expandable segments off: %s", exc)
        settings = None
    try:
        yield
    finally:
        if settings is not None:
            settings("expandable_segments:True")


def _allocate(size: int, device: torch.device) -> tuple[Any, torch.Tensor]:
    """(private pool or None, flat uint8 tensor of `size` bytes on `device`)."""
    pool_cls = getattr(torch.cuda, "MemPool", None)
    pool = pool_cls() if pool_cls is not None else None
    with _without_expandable_segments():
        if pool is None:
            flat = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            with torch.cuda.use_mem_pool(pool, device):
                flat = torch.empty(size, dtype=torch.uint8, device=device)
    return pool, flat


def _export(flat: torch.Tensor, dedicated: bool) -> tuple[bytes, str]:
    """(64-byte handle, "") or (b"", why the buffer is not shared)."""
    if not dedicated:
        return b"", (
            "this torch has no torch.cuda.MemPool, so the buffer cannot get a cudaMalloc "
            "segment of its own, and a handle would expose the whole segment"
        )
    try:
        fields = flat.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError) as exc:
        return b"", f"torch could not export an IPC handle: {exc}"[:256]
    handle, why = raw_ipc_handle(bytes(fields[1]))
    if why:
        return b"", why
    if int(fields[3]) != 0:
        return b"", (
            f"the buffer starts {int(fields[3])} bytes into its cudaMalloc segment; "
            "a handle would expose the memory before it"
        )
    return handle, ""


class CudaBuffer(SharedBuffer):
    """The publisher's buffer on one GPU: `slots` copies of that device's tensors."""

    kind: ClassVar[str] = "cuda"

    def __init__(self, device: str, *, slots: int, slot_bytes: int) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise ValueError(f"a CUDA buffer needs a device like 'cuda:0', not {device!r}")
        self.size = slots * slot_bytes
        self._slot_bytes = slot_bytes
        self._uuid = device_uuid(self.device)
        self._pool, flat = _allocate(self.size, self.device)
        self._handle, self._note = _export(flat, dedicated=self._pool is not None)
        self._flat: torch.Tensor | None = flat
        if self._handle:
            _LOCAL_EXPORTS[self._handle] = flat
        else:
            log.warning("CUDA buffer on %s is not shared over CUDA IPC: %s", device, self._note)
        torch.cuda.synchronize(self.device)
        self._info = BufferInfo(
            "cuda",
            str(self.device),
            "",
            self.size,
            0,
            handle=self._handle,
            device_uuid=self._uuid,
            pid_ns=pid_namespace(),
            ipc_note=self._note,
        )

    def slot(self, index: int) -> torch.Tensor:
        if self._flat is None:
            raise ValueError("buffer is closed")
        start = index * self._slot_bytes
        return self._flat[start : start + self._slot_bytes]

    def describe(self) -> BufferInfo:
        return self._info

    def close(self) -> None:
        if self._flat is None:
            return
        _LOCAL_EXPORTS.pop(self._handle, None)
        self._flat = None  # torch keeps an exported allocation while subscribers may map it
        self._pool = None

    def __repr__(self) -> str:
        state = "closed" if self._flat is None else f"{self.size} bytes"
        shared = "shared" if self._handle else "not shared"
        return f"<CudaBuffer {self.device} {self._uuid} {state} {shared}>"


class CudaAttachment(AttachedBuffer):
    """A subscriber's mapping of a publisher's CUDA buffer, opened once."""

    kind: ClassVar[str] = "cuda"

    def __init__(
        self, flat: torch.Tensor, header_bytes: int, slot_bytes: int, handle: bytes = b""
    ) -> None:
        self.handle = handle  # what it was opened from: a re-handshake reuses the mapping
        self._flat: torch.Tensor | None = flat
        self._header_bytes = header_bytes
        self._slot_bytes = slot_bytes
        self.device = flat.device

    @classmethod
    def attach(
        cls, info: BufferInfo, *, slots: int, slot_bytes: int, **options: Any
    ) -> CudaAttachment:
        """Open `info`'s handle on local device ``options["device_index"]``.

        Raises:
            ProtocolError: `info` does not describe a shareable CUDA buffer.
            IpcOpenFailed: the driver refused the handle (the caller falls back to CPU).
        """
        device_index: int = options["device_index"]
        if info.kind != "cuda" or len(info.handle) != IPC_HANDLE_BYTES:
            raise ProtocolError(f"buffer {info.device} has no {IPC_HANDLE_BYTES}-byte handle")
        if info.header_bytes + slots * slot_bytes > info.size:
            raise ProtocolError(f"buffer {info.device}: slots exceed its size")
        local = _LOCAL_EXPORTS.get(info.handle)
        if local is not None and local.numel() == info.size:
            return cls(local, info.header_bytes, slot_bytes, info.handle)
        return cls(_open(info, device_index), info.header_bytes, slot_bytes, info.handle)

    def slot(self, index: int) -> torch.Tensor:
        if self._flat is None:
            raise ValueError("buffer is closed")
        start = self._header_bytes + index * self._slot_bytes
        return self._flat[start : start + self._slot_bytes]

    def close(self) -> None:
        # Views keep the storage (and so the mapping) alive; torch closes the handle
        # when the last of them dies.
        self._flat = None


def _open(info: BufferInfo, device_index: int) -> torch.Tensor:
    global _OPENS
    try:
        # torch's own CUDA IPC reduction opens a handle this way; it has no public one
        storage = torch.UntypedStorage._new_shared_cuda(  # noqa: SLF001
            device_index, info.handle, info.size, 0, b"", 0, b"", False
        )
    except (RuntimeError, TypeError) as exc:
        raise IpcOpenFailed(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
    with _OPENS_LOCK:
        _OPENS += 1
    device = torch.device("cuda", device_index)
    flat = torch.empty(0, dtype=torch.uint8, device=device)
    return flat.set_(storage)
