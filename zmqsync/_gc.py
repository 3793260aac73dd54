"""What killed processes leave behind, and its removal: segments and ipc:// socket files.

It imports neither torch nor zmq, so that `zmqsync gc` starts at once (the
`_buffers.cpu` module, which creates segments, re-exports `collect_garbage`).

* A segment is garbage when no process holds a lock on it: every process that maps one
  holds a shared ``flock`` for as long as the mapping lives, so a segment in use is
  never removed.
* A socket file is garbage when nothing listens on it: libzmq removes its ipc:// files
  on close, but a process killed by a signal cannot. A connection to the file is then
  refused. A file younger than `SOCKET_GRACE_S` is left alone (a publisher binds, then
  listens: in between, a connection is refused too), and the file is removed only if it
  is still the one that refused (same inode), so a publisher that replaced it meanwhile
  keeps its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import stat
import time

__all__ = ["PREFIX", "collect_garbage", "collect_sockets"]

log = logging.getLogger(__name__)

PREFIX = "zmqsync-"
_TMP_GRACE_S = 60.0  # a half-created segment older than this, unlocked, is garbage
SOCKET_GRACE_S = 1.0  # a younger socket file may be one whose publisher is binding
# <bus name>.sock and its siblings (<name>.sock.events, .acks, .tap, .relay, ...)
_SOCKET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\.sock(\.[a-z]+)?$")


def collect_garbage(directory: str) -> list[str]:
    """Remove zmqsync segments in `directory` that no process holds a lock on.

    Returns the paths removed. Safe to run at any time: a segment in use is locked by
    its publisher and every subscriber, and a lock cannot be taken while it is held.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        is_tmp = name.startswith(f".{PREFIX}") and name.endswith(".tmp")
        if not (name.startswith(PREFIX) or is_tmp):
            continue
        path = os.path.join(directory, name)
        if _remove_if_unlocked(path, min_age_s=_TMP_GRACE_S if is_tmp else 0.0):
            removed.append(path)
    if removed:
        log.info("removed %d leaked segment(s) from %s", len(removed), directory)
    return removed


def _remove_if_unlocked(path: str, *, min_age_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        if time.time() - st.st_mtime < min_age_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # in use
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
                os.unlink(path)
                return True
        return False
    finally:
        os.close(fd)


def collect_sockets(directory: str, *, min_age_s: float = SOCKET_GRACE_S) -> list[str]:
    """Remove the ipc:// socket files in `directory` that no process listens on.

    Only files named like a bus's sockets, of this user, at least `min_age_s` old.
    Returns the paths removed.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if _SOCKET_NAME.match(entry.name) and _remove_if_dead(entry.path, min_age_s):
            removed.append(entry.path)
    if removed:
        log.info("removed %d dead socket file(s) from %s", len(removed), directory)
    return removed


def _remove_if_dead(path: str, min_age_s: float) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return False
    if time.time() - st.st_ctime < min_age_s or not _refused(path):
        return False
    with contextlib.suppress(FileNotFoundError):
        if os.lstat(path).st_ino == st.st_ino:
            os.unlink(path)
            return True
    return False


def _refused(path: str) -> bool:
    """Whether a connection to the socket file at `path` is refused: nobody listens.

    A listener that is busy (its backlog full) or stopped (SIGSTOP) still has its
    connections queued by the kernel: those count as alive.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # a timeout, EAGAIN (a full backlog): someone is there
            return False
    return False
