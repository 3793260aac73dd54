"""Which buffer transport a subscriber uses, and why. Pure decisions, tested without a GPU.

A bus whose weights live on a GPU offers two ways to read a version:

* ``cuda``: the subscriber maps the publisher's dedicated CUDA allocation once, at the
  handshake, from a CUDA IPC handle carried as plain msgpack bytes, and aliases it
  (zero-copy, same GPU) or copies it device-to-device into its own tensors;
* ``cpu``: the subscriber reads the CPU segment and copies the bytes where its model
  lives (host-to-device when that is a GPU). For CUDA weights the publisher keeps that
  CPU copy current (device-to-host) while at least one ``cpu`` subscriber is on the bus.

`choose_transport` decides from facts gathered at the handshake (`Facts`); it does no
I/O, so every fallback (no GPU, GPU not visible, other PID namespace, no handle offered,
handle refused by the driver) is unit-tested on machines without a GPU. The same
module holds the other pure pieces of the CUDA transport: reading torch's IPC handle
format (`raw_ipc_handle`), spotting expandable segments in the allocator settings
(`expandable_segments`) and matching devices by UUID whatever ``CUDA_VISIBLE_DEVICES``
says (`normalize_uuid`, `local_index`).

Both sides agree on what a HELLO registers through `registered`: the publisher records
a worker's transport with it, and a subscriber whose decision after WELCOME differs
from what its HELLO registered says so in a second HELLO (see ``_subscriber.py``). It
lives in ``zmqsync/_registration.py`` (re-exported here), outside this package, whose
``__init__`` loads torch: the publisher's role loads no tensors.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._registration import CPU_PUBLISHER, NOTE_MAX, Decision, clip_note, registered

__all__ = [
    "CPU_PUBLISHER",
    "DISABLED",
    "IPC_HANDLE_BYTES",
    "NOTE_MAX",
    "NO_GPU",
    "Decision",
    "Facts",
    "choose_transport",
    "expandable_segments",
    "initial_transport",
    "ipc_disabled",
    "local_index",
    "normalize_uuid",
    "pid_namespace",
    "raw_ipc_handle",
    "registered",
]

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_SHAREABLE_CUDA_MALLOC = ord("c")  # torch's handle type byte for a plain cudaMalloc block
_SHAREABLE_EXPANDABLE = ord("e")  # ... and for an expandable segment (file descriptors)

NO_GPU = "no GPU visible in this process (torch.cuda.is_available() is False)"
DISABLED = "CUDA IPC disabled by ZMQSYNC_CUDA_IPC=0"


@dataclass(frozen=True)
class Facts:
    """Everything the transport decision depends on, gathered at the handshake.

    Attributes:
        prefers: where the worker computes: "cuda" (its model is on a GPU), "cpu" (on
            the CPU) or "any" (no model and no device given: as the publisher).
        cuda_available: ``torch.cuda.is_available()`` in the subscriber.
        ipc_disabled: ``ZMQSYNC_CUDA_IPC=0`` in the subscriber's environment.
        publisher_cuda: the bus has a CUDA buffer.
        has_handle: the publisher offers a CUDA IPC handle for it.
        ipc_note: why the publisher offers none (expandable segments, ...).
        device_uuid: UUID of the publisher's GPU.
        local_index: that GPU's index in this process, None if it is not visible.
        pid_ns, publisher_pid_ns: PID namespace inodes (0: unknown).
        open_error: what opening the handle raised ("" before trying, or on success).
    """

    prefers: str
    cuda_available: bool
    ipc_disabled: bool = False
    publisher_cuda: bool = False
    has_handle: bool = False
    ipc_note: str = ""
    device_uuid: str = ""
    local_index: int | None = None
    pid_ns: int = 0
    publisher_pid_ns: int = 0
    open_error: str = ""


def initial_transport(prefers: str, cuda_available: bool, ipc_disabled: bool = False) -> Decision:
    """What a HELLO asks for, before the subscriber knows anything of the bus."""
    if prefers not in ("cuda", "cpu", "any"):
        raise ValueError(f"prefers must be 'cuda', 'cpu' or 'any', not {prefers!r}")
    if prefers == "cpu":
        return Decision("cpu", "")
    if not cuda_available:
        return Decision("cpu", NO_GPU)
    if ipc_disabled:
        return Decision("cpu", DISABLED)
    return Decision("cuda", "")


def choose_transport(facts: Facts) -> Decision:
    """The transport a subscriber uses for a bus, and why it falls back when it does.

    Checked in this order, the first failure deciding: the worker computes on the CPU or
    has no GPU; IPC disabled; the bus has no CUDA buffer; the publisher offers no
    handle; its GPU is not visible here; another PID namespace; the driver refused the
    handle (``open_error``).
    """
    transport, note = initial_transport(facts.prefers, facts.cuda_available, facts.ipc_disabled)
    if not facts.publisher_cuda:
        return registered(transport, note, bus_has_cuda=False)
    if transport == "cpu":
        return Decision("cpu", note)
    if not facts.has_handle:
        why = facts.ipc_note or "no reason given"
        return Decision("cpu", clip_note(f"the publisher offers no CUDA IPC handle: {why}"))
    if facts.local_index is None:
        return Decision(
            "cpu",
            clip_note(
                f"the publisher's GPU {facts.device_uuid or '(no uuid)'} is not visible in "
                "this process (CUDA_VISIBLE_DEVICES, or the container's device list)"
            ),
        )
    if facts.pid_ns and facts.publisher_pid_ns and facts.pid_ns != facts.publisher_pid_ns:
        return Decision(
            "cpu",
            clip_note(
                f"the publisher runs in another PID namespace (pid:[{facts.publisher_pid_ns}], "
                f"here pid:[{facts.pid_ns}]); CUDA IPC needs a shared one "
                "(docker --pid=host, or pid: service:<trainer>)"
            ),
        )
    if facts.open_error:
        return Decision("cpu", clip_note(f"opening the CUDA IPC handle failed: {facts.open_error}"))
    return Decision("cuda", "")


# --- torch's IPC handle, allocator settings ------------------------------------------------


def raw_ipc_handle(torch_handle: bytes) -> tuple[bytes, str]:
    """The 64-byte ``cudaIpcMemHandle_t`` inside the handle ``_share_cuda_()`` returned.

    torch writes ``[version][type][payload]`` (type ``c``: a cudaMalloc block followed
    by the 64-byte handle; ``e``: an expandable segment, shared through file descriptors)
    or, before it versioned the format, the 64 bytes alone. Only the bytes of a ``c``
    handle travel: every torch opens a bare 64-byte handle as a cudaMalloc block, so the
    two sides need not share a torch version.

    Returns:
        (handle, "") or (b"", why it cannot be shared as plain bytes).
    """
    data = bytes(torch_handle)
    if len(data) == IPC_HANDLE_BYTES:
        return data, ""
    if len(data) >= 2 and data[1] == _SHAREABLE_EXPANDABLE:
        return b"", (
            "the buffer was allocated in an expandable segment "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), whose handles are file "
            "descriptors that cannot travel in a message"
        )
    if len(data) == IPC_HANDLE_BYTES + 2 and data[1] == _SHAREABLE_CUDA_MALLOC:
        return data[2:], ""
    kind = chr(data[1]) if len(data) >= 2 and 32 < data[1] < 127 else "?"
    return b"", f"unknown torch IPC handle format ({len(data)} bytes, type {kind!r})"


_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(environ: Mapping[str, str]) -> bool:
    """True if the allocator settings in `environ` turn expandable segments on.

    The settings are ``key:value`` pairs separated by commas, e.g.
    ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128,expandable_segments:True``.
    """
    enabled = False
    for var in _CONF_VARS:
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                enabled = value.strip().lower() in ("true", "1")
    return enabled


def ipc_disabled(environ: Mapping[str, str]) -> bool:
    """``ZMQSYNC_CUDA_IPC=0`` (or false/off/no): never map CUDA buffers, read the CPU copy."""
    return environ.get("ZMQSYNC_CUDA_IPC", "").strip().lower() in ("0", "false", "off", "no")


# --- devices by UUID -------------------------------------------------------------------------

_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")


def normalize_uuid(text: str) -> str:
    """``GPU-<uuid>`` in lower case, whatever form torch, nvidia-smi or a user wrote.

    Accepts ``GPU-8b1c...``, the bare UUID, upper case, with or without dashes. Strings
    that are not a GPU UUID (a MIG device name, say) come back stripped, compared as is.
    """
    raw = text.strip()
    lowered = raw.lower()
    body = lowered[4:] if lowered.startswith("gpu-") else lowered
    hex_digits = body.replace("-", "")
    if not _HEX32.match(hex_digits):
        return raw
    return f"GPU-{uuid.UUID(hex=hex_digits)}"


def local_index(device_uuid: str, visible: Sequence[str]) -> int | None:
    """The index, in this process, of the GPU with `device_uuid`; None if not visible.

    `visible` lists the UUIDs of ``cuda:0``, ``cuda:1``, ... here: with
    ``CUDA_VISIBLE_DEVICES=3,1`` the publisher's ``cuda:3`` is this process's ``cuda:0``,
    which is why devices are matched by UUID and never by index.
    """
    if not device_uuid:
        return None
    wanted = normalize_uuid(device_uuid)
    for index, candidate in enumerate(visible):
        if normalize_uuid(candidate) == wanted:
            return index
    return None


def pid_namespace(path: str = "/proc/self/ns/pid") -> int:
    """The inode of this process's PID namespace; 0 when it cannot be read."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0
