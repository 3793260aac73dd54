"""The pool: worker processes started once and reused for every point of the grid.

Starting an interpreter that imports torch costs seconds, and the grid has hundreds of
phases, so each worker (`python -m tools.bench.grid.worker pool`) lives for the whole run
and takes JSON commands on stdin, one JSON reply each on stdout. Every wait has a
deadline; a worker that misses one or dies fails its phase and is replaced before the
next. Each worker reports the digest of the zmqsync sources it imported, and a digest
other than the harness's aborts the run (`SourceChanged`): one table must never mix two
versions of the library. Workers run in their own session, so Ctrl-C reaches the
harness only, and it ends them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .config import ROOT, BenchError, SourceChanged


class Worker:
    """One pool worker process: JSON commands in on stdin, one JSON reply each."""

    def __init__(self, index: int, env: dict[str, str], log_path: Path) -> None:
        self.index = index
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.grid.worker", "pool", "--index", str(index)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,  # Ctrl-C reaches the harness only; it ends us
        )
        self.log_path = log_path
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    self.replies.put(json.loads(line))
        self.replies.put(None)

    def send(self, cmd: dict[str, Any]) -> int:
        self._next += 1
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({**cmd, "id": self._next}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise BenchError(f"worker {self.index} is gone: {exc}; {self.tail()}") from None
        return self._next

    def wait(self, what: int | str, deadline: float) -> dict[str, Any]:
        """The reply with id `what` (or the event named `what`) before `deadline`."""
        while True:
            left = deadline - time.monotonic()
            try:
                reply = self.replies.get(timeout=max(0.0, left))
            except queue.Empty:
                raise BenchError(
                    f"worker {self.index} did not answer within the deadline; {self.tail()}"
                ) from None
            if reply is None:
                raise BenchError(
                    f"worker {self.index} exited (rc={self.proc.poll()}); {self.tail()}"
                )
            if reply.get("id") == what or reply.get("event") == what:
                if reply.get("ok") is False:
                    raise BenchError(f"worker {self.index}: {reply.get('error')}")
                return reply

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text()[-600:].strip()
            return f"stderr: {text}" if text else "no stderr"
        return "no stderr"

    def close(self, deadline: float) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BenchError):
                self.send({"cmd": "exit"})
            try:
                self.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._log.close()


class Pool:
    """Worker processes started once and reused for every point; grows with N."""

    def __init__(
        self, env: dict[str, str], log_dir: Path, timeout: float, source: str = ""
    ) -> None:
        self.env, self.log_dir, self.timeout = env, log_dir, timeout
        self.source = source  # the library digest every worker must have imported
        self.workers: list[Worker] = []

    def grow(self, n: int) -> float:
        """Start workers until there are `n`; returns the seconds it took."""
        t0 = time.perf_counter()
        new = [self._spawn(i) for i in range(len(self.workers), n)]
        deadline = time.monotonic() + max(self.timeout, 5.0 * len(new))
        self.workers.extend(new)  # closed with the pool even if one fails below
        for w in new:
            self._check(w, w.wait("ready", deadline))
        return time.perf_counter() - t0

    def _check(self, w: Worker, ready: dict[str, Any]) -> None:
        if self.source and ready.get("source") != self.source:
            raise SourceChanged(
                f"worker {w.index} imported zmqsync sources {ready.get('source')}, the harness "
                f"{self.source}: the library was edited during the run; run the benchmark "
                "on a tree nobody edits (e.g. a `git worktree` or `git archive` copy)"
            )

    def _spawn(self, index: int) -> Worker:
        return Worker(index, self.env, self.log_dir / f"worker-{index}.log")

    def call(
        self, n: int, cmd: dict[str, Any], timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Send `cmd` to the first `n` workers at once; their replies, in order."""
        deadline = time.monotonic() + (timeout or self.timeout)
        ids = [w.send(cmd) for w in self.workers[:n]]
        return [w.wait(i, deadline) for w, i in zip(self.workers[:n], ids, strict=True)]

    def reset(self, n: int) -> None:
        """Drop models and subscribers of the first `n` workers; restart any that fail."""
        sent: list[int | None] = []
        for w in self.workers[:n]:
            try:
                sent.append(w.send({"cmd": "drop"}))
            except BenchError:
                sent.append(None)
        deadline = time.monotonic() + 30
        for i, (w, cmd_id) in enumerate(zip(self.workers[:n], sent, strict=True)):
            try:
                if cmd_id is None:
                    raise BenchError("gone")
                w.wait(cmd_id, deadline)
            except BenchError:
                w.kill()
                self.workers[i] = self._spawn(i)
                ready = self.workers[i].wait("ready", time.monotonic() + self.timeout)
                self._check(self.workers[i], ready)

    def close(self) -> None:
        deadline = time.monotonic() + 10
        for w in self.workers:
            with contextlib.suppress(BenchError):
                w.send({"cmd": "exit"})
        for w in self.workers:
            w.close(deadline)
        self.workers = []
