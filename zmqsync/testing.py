"""Run your own trainer and workers in a test: a bus of their own, cleaned up after.

A pytest plugin and a context manager; ``import zmqsync`` never loads this module. In a
``conftest.py``::

    pytest_plugins = ["zmqsync.testing"]

gives every test that asks for it the `zmqsync_bus` fixture, a `PrivateBus`:

* a runtime dir of its own (``ZMQSYNC_RUNTIME_DIR``: where the bus's socket files go)
  and a shm dir of its own (``ZMQSYNC_SHM_DIR``: where its segments go), set in this
  process's environment for the test and passed to every process `spawn` starts, so a
  trainer and workers started with no address find each other and nobody else;
* a unique bus name (`name`), for ``Publisher(model, name=bus.name)``;
* `spawn` (a subprocess in the bus's environment), `publisher` and `subscriber`
  (in-process objects on the bus);
* on the way out, also when the test failed: the subscribers and publishers closed, the
  processes ended (SIGTERM, then SIGKILL of their process group after `grace` seconds),
  then the socket files and segments removed. What was still there before the removal
  is kept in `leftovers`, for a test that checks that its own code cleans up.

Outside pytest, ``with zmqsync.testing.private_bus() as bus:`` does the same.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = ["PrivateBus", "private_bus", "zmqsync_bus"]

_GRACE_S = 5.0  # how long spawned processes get to end after SIGTERM


class PrivateBus:
    """A bus name with a runtime dir and a shm dir of its own (see the module doc)."""

    def __init__(self, runtime_dir: str, shm_dir: str, name: str, grace: float) -> None:
        self.runtime_dir = runtime_dir
        self.shm_dir = shm_dir
        self.name = name
        self.grace = grace
        self.leftovers: list[str] = []  # socket files and segments found at cleanup
        self._processes: list[subprocess.Popen[Any]] = []
        self._closables: list[Any] = []  # subscribers first, then publishers (see close)

    @property
    def env(self) -> dict[str, str]:
        """This process's environment with the bus's runtime and shm dirs."""
        return {
            **os.environ,
            "ZMQSYNC_RUNTIME_DIR": self.runtime_dir,
            "ZMQSYNC_SHM_DIR": self.shm_dir,
        }

    @property
    def address(self) -> str:
        """The bus's control address (what ``Publisher(name=bus.name)`` binds)."""
        return f"ipc://{os.path.join(self.runtime_dir, self.name)}.sock"

    def spawn(self, *args: str, **popen: Any) -> subprocess.Popen[Any]:
        """Start ``args`` in the bus's environment (stdout and stderr piped as text unless
        `popen` says otherwise), in a process group of its own: ended at cleanup with
        the processes it started."""
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        popen.setdefault("text", True)
        env = {**self.env, **popen.pop("env", {})}
        proc = subprocess.Popen(list(args), env=env, start_new_session=True, **popen)
        self._processes.append(proc)
        return proc

    def publisher(self, weights: Any, **options: Any) -> Any:
        """A started ``zmqsync.Publisher`` of this bus (`options` as Publisher's)."""
        import zmqsync

        pub = zmqsync.Publisher(weights, name=self.name, **options).start()
        self._closables.append(pub)
        return pub

    def subscriber(self, model: Any = None, **options: Any) -> Any:
        """A started ``zmqsync.Subscriber`` of this bus (`options` as Subscriber's)."""
        import zmqsync

        sub = zmqsync.Subscriber(name=self.name, model=model, **options)
        self._closables.insert(0, sub)  # closed before the publishers
        sub.start()
        return sub

    def close(self) -> None:
        """Close what it opened, end what it started, remove the socket files and segments.
        Idempotent."""
        while self._closables:
            with contextlib.suppress(Exception):  # the test's own error comes first
                self._closables.pop(0).close()
        for proc in self._processes:
            _end(proc, self.grace)
        self._processes.clear()
        for directory in (self.runtime_dir, self.shm_dir):
            with contextlib.suppress(FileNotFoundError):
                self.leftovers += [os.path.join(directory, e) for e in os.listdir(directory)]
            shutil.rmtree(directory, ignore_errors=True)

    def __repr__(self) -> str:
        return f"<PrivateBus {self.name!r} {self.runtime_dir} {len(self._processes)} processes>"


def _end(proc: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM, then SIGKILL to its process group (what it started too) after `grace`."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of its group, if any
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


@contextlib.contextmanager
def private_bus(name: str | None = None, *, grace: float = _GRACE_S) -> Iterator[PrivateBus]:
    """A `PrivateBus` for the block: its dirs set in ``os.environ`` while it runs (so
    that Publishers and Subscribers made without an address use them), everything it
    opened or started ended and removed after it, also when it raises."""
    # short: an ipc:// path is limited to 107 bytes
    runtime = tempfile.mkdtemp(prefix="zsbus-", dir="/tmp")
    shm_base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shm = tempfile.mkdtemp(prefix="zmqsync-test-", dir=shm_base)
    bus = PrivateBus(runtime, shm, name or f"bus-{uuid.uuid4().hex[:8]}", grace)
    saved = {k: os.environ.get(k) for k in ("ZMQSYNC_RUNTIME_DIR", "ZMQSYNC_SHM_DIR")}
    os.environ.update(ZMQSYNC_RUNTIME_DIR=runtime, ZMQSYNC_SHM_DIR=shm)
    try:
        yield bus
    finally:
        try:
            bus.close()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


try:
    import pytest
except ImportError:  # pragma: no cover - outside a test run `private_bus` is what serves
    pass
else:

    @pytest.fixture
    def zmqsync_bus() -> Iterator[PrivateBus]:
        """A `PrivateBus` for one test (see the module doc); cleaned up even if it fails."""
        with private_bus() as bus:
            yield bus
