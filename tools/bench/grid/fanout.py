"""The harness's own sockets: the raw ZeroMQ floor, the naive baseline, the copy floor.

`Echoes` is the raw ZeroMQ round trip zmqsync's publish is compared with: N plain pyzmq
processes (no torch, no model, no other thread) answering one frame each. A `Fanout` is
a PUB/PULL pair the harness binds; pool workers subscribe and answer each message on
PULL, on a thread of their own: one round carries the pickled state_dict of the naive
baseline or the "go" of the N+1-copies floor. The harness talks to both without
zmqsync, so the floors measure ZeroMQ and memory, not the library.

Before the raw floor had processes of its own it was a Fanout round to the pool workers
(a thread polling, then reading and sending two-part messages, in processes holding
torch): 1.3-1.6x a round trip to plain processes (``python -m tools.bench fixed``, side
``harness``), which made every ratio over it look smaller than what a user's workers
see.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import BenchError

if TYPE_CHECKING:
    import zmq


class Fanout:
    """A PUB/PULL pair bound by the harness; N pool workers answer on it."""

    def __init__(self, ctx: zmq.Context[Any], runtime: str, tag: str) -> None:
        import zmq

        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.events = f"ipc://{runtime}/{tag}.pub"
        self.acks = f"ipc://{runtime}/{tag}.pull"
        self.pub.bind(self.events)
        self.pull.bind(self.acks)
        self.seq = 0

    def _gather(self, n: int, seq: bytes, deadline: float) -> None:
        got: set[bytes] = set()
        while len(got) < n:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.pull.poll(left_ms):
                raise BenchError(f"only {len(got)} of {n} workers answered in time")
            ident, s = self.pull.recv_multipart()
            if s == seq:
                got.add(ident)

    def round(
        self,
        kind: bytes,
        n: int,
        timeout: float,
        payload: Callable[[], bytes] | None = None,
        local: Callable[[], object] | None = None,
    ) -> float:
        """One message to every worker and all N answers back; seconds.

        `payload` (serialization) and `local` (the harness's own copy) run inside the
        timed region, as they would inside a publish.
        """
        self.seq += 1
        seq = str(self.seq).encode()
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        frames = [kind, seq] if payload is None else [kind, seq, payload()]
        self.pub.send_multipart(frames)
        if local is not None:
            local()
        self._gather(n, seq, deadline)
        return time.perf_counter() - t0

    def connected(self, n: int, timeout: float) -> None:
        """Ping until every worker's subscription is live (PUB drops before that)."""
        deadline = time.monotonic() + timeout
        heard: set[bytes] = set()
        while len(heard) < n:
            if time.monotonic() > deadline:
                raise BenchError(f"only {len(heard)} of {n} workers subscribed in time")
            self.seq += 1
            self.pub.send_multipart([b"raw", str(self.seq).encode()])
            end = time.monotonic() + 0.05
            while (left := int((end - time.monotonic()) * 1000)) > 0 and self.pull.poll(left):
                ident, _ = self.pull.recv_multipart()
                heard.add(ident)
        self.round(b"raw", n, timeout)  # and one whole round, so nothing stale is left

    def close(self) -> None:
        import zmq

        for sock in (self.pub, self.pull):
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.close()
            if endpoint.startswith("ipc://"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(endpoint[len("ipc://") :])


# The raw floor's processes: the harness's one echo worker (a plain pyzmq process, no
# torch), which dies with the harness and on b"quit".
ECHO = Path(__file__).resolve().parents[1] / "echo.py"


class Echoes:
    """The raw ZeroMQ floor: N plain pyzmq processes, each answering one frame.

    One 8-byte frame PUB -> N SUB, each process answers with it PUSH -> PULL; a round
    ends when all N answers are in. The processes import nothing but pyzmq and do
    nothing else: the floor is what ZeroMQ costs, not what a process that also holds
    torch, a model or other threads costs. They are started once and grow with N,
    like the pool.
    """

    def __init__(self, ctx: zmq.Context[Any], runtime: str, env: dict[str, str]) -> None:
        import zmq

        self.pub = ctx.socket(zmq.PUB)
        self.pub.linger = 0
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.linger = 0
        self.events, self.acks = f"ipc://{runtime}/echo.pub", f"ipc://{runtime}/echo.pull"
        self.pub.bind(self.events)
        self.pull.bind(self.acks)
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.seq = 0

    def grow(self, n: int, timeout: float) -> None:
        """Start processes until there are `n`, then wait until every one answers."""
        for _ in range(len(self.procs), n):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(ECHO), self.events, self.acks],
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    start_new_session=True,  # Ctrl-C reaches the harness only
                )
            )
        deadline = time.monotonic() + timeout
        while self._ping(n, min(0.2, timeout)) < n:
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise BenchError(f"only some of {n} raw echo processes answered in time")

    def _next(self) -> bytes:
        self.seq += 1
        return self.seq.to_bytes(8, "little")

    def _gather(self, n: int, msg: bytes, deadline: float) -> int:
        got = 0
        while got < n:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.pull.poll(left_ms):
                break
            if self.pull.recv() == msg:
                got += 1
        return got

    def _ping(self, n: int, wait: float) -> int:
        msg = self._next()
        self.pub.send(msg)
        got = self._gather(n, msg, time.monotonic() + wait)
        while self.pull.poll(0):  # late answers of an earlier ping
            self.pull.recv()
        return got

    def round(self, n: int, timeout: float) -> float:
        """One frame to the `n` processes (exactly as many as are running) and all `n`
        answers back; seconds."""
        if n != len(self.procs):
            raise BenchError(f"{len(self.procs)} raw echo processes running, {n} asked for")
        msg = self._next()
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        self.pub.send(msg)
        got = self._gather(n, msg, deadline)
        seconds = time.perf_counter() - t0
        if got < n:
            raise BenchError(f"only {got} of {n} raw echo processes answered in time")
        return seconds

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pub.send(b"quit")
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for sock in (self.pub, self.pull):
            sock.close()
        for endpoint in (self.events, self.acks):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoint[len("ipc://") :])
        self.procs = []
