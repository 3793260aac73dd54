"""The harness's own sockets: the raw ZeroMQ floor, the naive baseline, the copy floor.

A `Fanout` is a PUB/PULL pair the harness binds; pool workers subscribe and answer each
message on PULL. One round (a message out, all N answers back) is the raw ZeroMQ round
trip zmqsync's publish is compared with; the same round carries the pickled state_dict
of the naive baseline and the "go" of the N+1-copies floor. The harness talks to its
workers here without zmqsync, so the floors measure ZeroMQ and memory, not the library.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
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
