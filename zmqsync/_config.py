"""Defaults (in seconds) and where things live on the host: runtime dir, shm dir.

`Publisher(model, name="policy")` and `Subscriber(name="policy")` meet at
``ipc://<runtime dir>/policy.sock`` with no other configuration. The runtime dir is
private to the user (0700): whoever can write to it can impersonate a publisher.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
import tempfile
from typing import Any

__all__ = [
    "DEFAULT",
    "XPUB_WELCOME",
    "ACK_DRAIN_MAX",
    "RELAY_CHUNK_MB",
    "CONTROL_MAX_BYTES",
    "CONTROL_RCVHWM",
    "CONTROL_CONNECTIONS",
    "DRAIN_BYTES",
    "DRAIN_MAX",
    "DRAIN_S",
    "FD_RESERVE_MIN",
    "HANDSHAKE_IVL_S",
    "SERVICE_S",
    "SUBSCRIPTION_MAX_BYTES",
    "SUBSCRIPTION_RCVHWM",
    "WORKER_MAX_BYTES",
    "WORKER_RCVHWM",
    "DEFAULT_SHM_DIR",
    "HANDSHAKE_ATTEMPTS",
    "LOST_AFTER_BEATS",
    "FIRST_WORD_PER_TENSOR_S",
    "FIRST_WORD_S",
    "REJOIN_MIN_S",
    "RESERVE_MIN_S",
    "AGENT_START_S",
    "FIRST_APPLY_S",
    "MAX_MESSAGE_BYTES",
    "check_name",
    "default_worker_id",
    "resolve_group",
    "default_address",
    "runtime_dir",
    "shm_dir",
]


class _Default:
    """Sentinel: 'use the object's configured timeout' (None means no limit), as httpx's
    `USE_CLIENT_DEFAULT`: a timeout left out and a timeout of None mean different things."""

    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()
# The first frame a new SUB gets from the events socket: its subscription is live.
XPUB_WELCOME = b"\x00zmqsync-subscribed"

DEFAULT_SHM_DIR = "/dev/shm"
HANDSHAKE_ATTEMPTS = 3  # Lazy Pirate: fresh REQ socket per attempt
LOST_AFTER_BEATS = 6  # a peer silent for this many heartbeat intervals is lost
# A worker's first word after its WELCOME may take this long at least (a handshake of
# thousands of tensors on a loaded host) before the publisher calls it silent, plus this
# much per tensor of the manifest: a worker maps, checks and views every tensor before it
# can ack, and 100,000 of them took 5-12 s on a loaded 2-core host (dropped as silent at
# a flat 5 s, it re-joined and paid it all again).
FIRST_WORD_S = 5.0
FIRST_WORD_PER_TENSOR_S = 0.0002
# A re-join's first deadline at least (then doubled while they fail; see Link).
REJOIN_MIN_S = 2.0
# A dropped worker's id is kept for its process this long at least (and as long as the
# silence limit, LOST_AFTER_BEATS heartbeats): a re-join after an eviction or a pause
# takes a few hundred ms, and seconds on a saturated host (see `_registry`).
RESERVE_MIN_S = 5.0
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the largest message of all: a WELCOME or a STATE
SERVICE_S = 0.01  # how often the publisher's agent drains acks nobody is waiting for

# What a peer may make the publisher hold, socket by socket. Inbound control traffic is
# tiny, so each bound socket accepts frames only as large as its messages can be (libzmq
# drops a peer that sends a larger one: MAXMSGSIZE) and queues only a few per connection
# (RCVHWM, in messages: bytes = HWM x the frame limit). A drain handles at most
# DRAIN_MAX messages, DRAIN_BYTES bytes and DRAIN_S seconds of one socket per wake-up, so
# a flood on one socket cannot starve the others or the heartbeats.
CONTROL_MAX_BYTES = 8 * 1024  # HELLO or INSPECT: ids, host name, a note (~2.3 KiB at most)
CONTROL_RCVHWM = 16
WORKER_MAX_BYTES = 1024  # ACK, HEARTBEAT or BYE (~250 bytes at most)
WORKER_RCVHWM = 256
# The protocol's one subscription is to everything (no prefix): a 1-byte frame, or the
# 10-byte SUBSCRIBE command of ZMTP 3.1. The limit also applies to the handshake's own
# commands, and CURVE's INITIATE is ~300 bytes.
SUBSCRIPTION_MAX_BYTES = 512
# One subscription per connection is all a subscriber sends. (Under CURVE the publisher's
# ZAP handler gives no User-Id: libzmq would otherwise take this one place for good.)
SUBSCRIPTION_RCVHWM = 1
# What a subscriber's events socket accepts is the protocol's own bound on an event,
# `_protocol.MAX_EVENT` (derived from its field table, not set here).
DRAIN_MAX = 1024
DRAIN_BYTES = 1024 * 1024
DRAIN_S = 0.002
ACK_DRAIN_MAX = DRAIN_MAX  # the relay's drains
# MiB per collective when a relay root sends a slot: the `zmqsync relay --chunk-mb`
# default, here so that building the command's parser imports no relay (nor torch).
RELAY_CHUNK_MB = 16.0
HANDSHAKE_IVL_S = 5.0  # a connection that has not finished the ZMTP handshake by then is dropped
FD_RESERVE_MIN = 64  # file descriptors kept free of connections for the process itself
CONTROL_CONNECTIONS = 64  # open at once; a new one closes the oldest (see _connections)
CLOSE_BYE_WAIT_S = 0.5  # how long close() waits for BYEs after STOP
THREAD_JOIN_S = 5.0  # how long close() waits for a background thread
AGENT_START_S = 10.0  # how long start() waits for an agent thread to bind its sockets
# A subscriber's start(): beyond its handshake deadline, how long the first apply may
# take (a big model copied or mapped and checked on a loaded host).
FIRST_APPLY_S = 30.0

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_IPC_PATH_MAX = 107  # sun_path is 108 bytes including the NUL


def check_name(name: str) -> str:
    """Bus names end up in file names: letters, digits, ``_ . -``, at most 64."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"bus name {name!r} is not allowed: use 1-64 letters, digits, '_', '.', '-', "
            "not starting with '.' or '-'"
        )
    return name


def runtime_dir() -> str:
    """The per-user directory for ipc:// sockets, created 0700 if missing.

    ``$ZMQSYNC_RUNTIME_DIR`` wins; then ``$XDG_RUNTIME_DIR/zmqsync``; then
    ``<tmp>/zmqsync-<uid>``. A directory owned by someone else or writable by others is
    refused: a socket there could be replaced by an impostor publisher.
    """
    path = os.environ.get("ZMQSYNC_RUNTIME_DIR")
    if not path:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = xdg if xdg and os.path.isdir(xdg) else tempfile.gettempdir()
        path = os.path.join(base, "zmqsync" if xdg else f"zmqsync-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"runtime dir {path} is owned by uid {info.st_uid}, not by you (uid "
            f"{os.getuid()}); set ZMQSYNC_RUNTIME_DIR to a directory of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"runtime dir {path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"run `chmod 700 {path}` or set ZMQSYNC_RUNTIME_DIR"
        )
    return path


def default_address(name: str) -> str:
    """``ipc://<runtime dir>/<name>.sock``: where a bus called `name` lives on this host."""
    path = os.path.join(runtime_dir(), f"{check_name(name)}.sock")
    if len(path) > _IPC_PATH_MAX - len(".events"):
        raise ValueError(
            f"socket path {path} is too long for ipc:// ({len(path)} bytes); set "
            "ZMQSYNC_RUNTIME_DIR to a shorter directory or use a shorter name"
        )
    return f"ipc://{path}"


def resolve_group(group: str | int | None) -> int | None:
    """A gid from a group name or number (None: files stay private to the user)."""
    if group is None or isinstance(group, int):
        return group
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {group!r} on this host") from None


def default_worker_id() -> str:
    """``<host>-<pid>-<6 random hex>``: unique without configuration.

    Host and pid alone collide: containers that share a network namespace share a host
    name while each numbers its own pids from 1, and one process may run two
    subscribers. The host and pid stay in front, for whoever reads `zmqsync inspect`.
    """
    return f"{socket.gethostname()[:96]}-{os.getpid()}-{secrets.token_hex(3)}"


def shm_dir(explicit: str | None = None) -> str:
    """Where CPU segments live: the argument, else ``$ZMQSYNC_SHM_DIR``, else /dev/shm."""
    return explicit or os.environ.get("ZMQSYNC_SHM_DIR") or DEFAULT_SHM_DIR
