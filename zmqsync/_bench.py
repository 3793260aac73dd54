"""`zmqsync bench`: zmqsync next to its floors, torchrl and a naive pickle, in one run.

For each point of the grid (workers N × model size × mode copy/alias) it measures, on
the same machine state, interleaved iteration by iteration:

* **zmqsync**: ``Publisher.publish()`` wall time, from the call to its return (every
  worker applied the version and acked), with N independent worker processes.
* **raw ZeroMQ floor**: a tiny message PUB→SUB to the same N processes, then
  PUSH→PULL back from each (ipc://, as zmqsync's default address).
* **memcpy floor**: one torch ``copy_`` of the model's bytes into shared memory, with
  1 thread and with torch's default threads; the floor is the faster of the two.
* **copy floor (copy mode)**: N+1 concurrent copies: the harness sends a tiny "go",
  every worker copies the bytes from shared memory into its own model, the harness
  copies the trainer's bytes into shared memory; from "go" to the last "done".

And, per (N, size), in separate phases: **naive** (``pickle.dumps(model.state_dict())``
on a PUB socket, each worker unpickles, ``load_state_dict`` and acks) and **torchrl**'s
``SharedMemWeightSyncScheme`` sync ``send()``, in a subprocess killed on a deadline (a
dead receiver blocks its ``send()`` forever), in two set-ups: ``collector`` (what its
collectors do with a CPU policy: the trained module's own tensors are the shared buffer)
and ``own`` (the scheme owns a buffer: ``send()`` copies the trainer's weights into it).
Per worker memory is PSS from ``/proc/PID/smaps_rollup``; the part that maps the shared
segment is split out from ``/proc/PID/smaps``. A late-join measurement times a new
worker's ``Subscriber.start()`` (handshake and apply) against a 1 GB model.

Workers are started once (a pool that grows with N) and reused for every size, mode and
baseline; each run has its own runtime dir (under /tmp) and shm dir (under /dev/shm),
both removed at the end, and every process is ended even on Ctrl-C. Points that do not
fit the memory budget are skipped and say why. Heavy imports (matplotlib, torchrl) are
made only by the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import json
import logging
import math
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import zmq

__all__ = [
    "BenchConfig",
    "QUICK",
    "SIZES",
    "add_arguments",
    "evaluate_targets",
    "markdown_report",
    "plot",
    "run_bench",
    "run_from_args",
]

log = logging.getLogger(__name__)

KiB, MiB, GiB = 1024, 2**20, 2**30
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Size:
    key: str
    kind: str  # "mlp" | "many"
    target: int  # bytes asked for; the model's real size is in the results
    label: str
    iters: int  # timed publishes at this size (before --iters-scale and volume caps)
    warmup: int


SIZES: dict[str, Size] = {
    s.key: s
    for s in (
        Size("4K", "mlp", 4 * KiB, "4 KB", 200, 5),
        Size("4M", "mlp", 4 * MiB, "4 MB", 100, 5),
        Size("many", "many", 4 * MiB, "2000 × 2 KB", 100, 5),
        Size("64M", "mlp", 64 * MiB, "64 MB", 30, 2),
        Size("512M", "mlp", 512 * MiB, "512 MB", 10, 1),
        Size("1G", "mlp", 1 * GiB, "1 GB", 6, 1),
    )
}
MODES = ("copy", "alias")
SLOTS = 2


@dataclass
class BenchConfig:
    """What to run. The defaults are the full grid (docs/benchmarks.md)."""

    workers: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    sizes: tuple[str, ...] = ("4K", "4M", "many", "64M", "512M", "1G")
    modes: tuple[str, ...] = MODES
    iters_scale: float = 1.0
    min_iters: int = 5
    torchrl: bool = True
    torchrl_max_workers: int = 64
    torchrl_start_method: str = "forkserver"
    torchrl_many_max_workers: int = 16  # the 2,000-tensor model costs torchrl ~0.2 s/worker
    naive: bool = True
    late_join: str | None = "1G"
    late_join_rounds: int = 15
    mem_budget: int = 0  # bytes; 0: min(14 GiB, 60% of MemAvailable at start)
    volume_budget: int = 24 * GiB  # bytes copied per phase (caps iterations)
    naive_volume_cap: int = 8 * GiB  # bytes moved per naive publish
    torchrl_volume_cap: int = 8 * GiB  # bytes copied per torchrl "own" send
    phase_seconds: float = 5.0  # stop measuring a phase after this, once min_iters are in
    timeout: float = 120.0  # deadline of every single operation (s)
    worker_threads: int | None = None  # torch threads in workers (None: torch's default)
    out: Path = Path("zmqsync-bench")
    plot: bool = False
    quick: bool = False


QUICK = BenchConfig(
    workers=(1, 4),
    sizes=("4K", "4M", "many", "64M"),
    iters_scale=0.3,
    min_iters=3,
    late_join="1G",
    late_join_rounds=6,
    phase_seconds=2.0,
    quick=True,
)


class BenchError(Exception):
    """One phase of the benchmark failed (recorded in its row; the run goes on)."""


class SourceChanged(Exception):
    """zmqsync's sources changed during the run: the results would mix two versions."""


# --- statistics ---------------------------------------------------------------------


def p50(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def p99(xs: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile (the maximum below 100 samples)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# --- results ------------------------------------------------------------------------


@dataclass
class Row:
    """One grid point: N workers, one model size, one zmqsync mode, and its baselines."""

    n: int
    size: str
    label: str
    mode: str
    nbytes: int = 0  # bytes of the model's tensors (what one publish moves)
    tensors: int = 0
    status: str = "ok"  # "ok" | "skipped: ..." | "error: ..."
    iters: int = 0
    zmqsync_p50: float | None = None
    zmqsync_p99: float | None = None
    zmqsync_lib_p50: float | None = None  # Publish.seconds as the library reports it
    raw_p50: float | None = None
    raw_p99: float | None = None
    memcpy1_p50: float | None = None
    memcpyd_p50: float | None = None
    copyn_p50: float | None = None
    naive_p50: float | None = None
    naive_p99: float | None = None
    naive_status: str = ""
    torchrl_p50: float | None = None
    torchrl_p99: float | None = None
    torchrl_status: str = ""
    torchrl_own_p50: float | None = None
    torchrl_own_p99: float | None = None
    torchrl_own_status: str = ""
    join_p50: float | None = None
    pss_delta: float | None = None  # per worker, mean: after - before (anon + shmem PSS)
    seg_pss: float | None = None  # per worker, mean: PSS of the shared segment
    extra: float | None = None  # per worker, max: pss_delta - seg_pss
    segment_bytes: int | None = None
    seconds: float | None = None  # wall time of this row's phase, set-up included
    naive_seconds: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def memcpy_floor(self) -> float | None:
        vals = [v for v in (self.memcpy1_p50, self.memcpyd_p50) if v is not None]
        return min(vals) if vals else None

    def ratios(self) -> dict[str, float | None]:
        floor = self.memcpy_floor
        alias_floor = None if floor is None or self.raw_p50 is None else floor + self.raw_p50
        return {
            "x_raw": _div(self.zmqsync_p50, self.raw_p50),
            "x_floor": _div(
                self.zmqsync_p50, self.copyn_p50 if self.mode == "copy" else alias_floor
            ),
            "x_torchrl": _div(self.zmqsync_p50, self.torchrl_p50),
            "x_torchrl_own": _div(self.zmqsync_p50, self.torchrl_own_p50),
            "x_naive": _div(self.zmqsync_p50, self.naive_p50),
            "gbps": _div(self.nbytes / 1e9, self.zmqsync_p50),
            "extra_frac": _div(self.extra, self.nbytes),
            "segment_frac": _div(self.segment_bytes, SLOTS * self.nbytes),
        }

    def flat(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "samples"}
        d.update(memcpy_floor=self.memcpy_floor, **self.ratios())
        return d


@dataclass
class Results:
    config: dict[str, Any]
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    late_join: dict[str, Any] = field(default_factory=dict)
    torchrl_runs: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    interrupted: bool = False
    aborted: str = ""
    command: str = ""

    def row(self, n: int, size: str, mode: str) -> Row | None:
        for r in self.rows:
            if (r.n, r.size, r.mode) == (n, size, mode):
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "config": self.config,
            "machine": self.machine,
            "started": self.started,
            "seconds": self.seconds,
            "interrupted": self.interrupted,
            "aborted": self.aborted,
            "rows": [{**r.flat(), "samples": r.samples} for r in self.rows],
            "late_join": self.late_join,
            "torchrl_runs": self.torchrl_runs,
            "targets": evaluate_targets(self),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Results:
        names = {f.name for f in dataclasses.fields(Row)}
        res = cls(config=data["config"], machine=data["machine"])
        res.command = data.get("command", "")
        res.started, res.seconds = data.get("started", 0.0), data.get("seconds", 0.0)
        res.interrupted = data.get("interrupted", False)
        res.aborted = data.get("aborted", "")
        res.rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
        res.late_join = data.get("late_join", {})
        res.torchrl_runs = data.get("torchrl_runs", [])
        return res


# --- the machine --------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def _available() -> int | None:
    """MemAvailable now (the pool and anything else on the host already counted)."""
    return _meminfo().get("MemAvailable")


def describe_machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch
    import zmq

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _meminfo()
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    git = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "zmqsync"], cwd=ROOT, capture_output=True, text=True
        ).stdout.split("\n")
        changed = sorted(line[3:] for line in dirty if line.strip())
        git = head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    return {
        "git": os.environ.get("ZMQSYNC_BENCH_REVISION") or git,
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total": mem.get("MemTotal"),
        "mem_available": mem.get("MemAvailable"),
        "shm_size": shm.f_blocks * shm.f_frsize if shm else None,
        "loadavg_start": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "tensordict": _version("tensordict"),
        "torchrl": _version("torchrl"),
        "msgpack": _version("msgpack"),
        "zmqsync": _version("zmqsync"),
    }


# --- the worker pool ----------------------------------------------------------------


class _Worker:
    """One pool worker process: JSON commands in on stdin, one JSON reply each."""

    def __init__(self, index: int, env: dict[str, str], log_path: Path) -> None:
        self.index = index
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zmqsync._bench_worker", "pool", "--index", str(index)],
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
        self.workers: list[_Worker] = []

    def grow(self, n: int) -> float:
        """Start workers until there are `n`; returns the seconds it took."""
        t0 = time.perf_counter()
        new = [self._spawn(i) for i in range(len(self.workers), n)]
        deadline = time.monotonic() + max(self.timeout, 5.0 * len(new))
        self.workers.extend(new)  # closed with the pool even if one fails below
        for w in new:
            self._check(w, w.wait("ready", deadline))
        return time.perf_counter() - t0

    def _check(self, w: _Worker, ready: dict[str, Any]) -> None:
        if self.source and ready.get("source") != self.source:
            raise SourceChanged(
                f"worker {w.index} imported zmqsync sources {ready.get('source')}, the harness "
                f"{self.source}: the library was edited during the run; run the benchmark "
                "on a tree nobody edits (e.g. a `git worktree` or `git archive` copy)"
            )

    def _spawn(self, index: int) -> _Worker:
        return _Worker(index, self.env, self.log_dir / f"worker-{index}.log")

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


# --- the harness's own sockets: raw floor, naive, copy floor -----------------------


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


# --- planning -----------------------------------------------------------------------


def _fmt_gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def _padded(size: Size) -> int:
    from ._bench_worker import MODEL_ALIGN, model_shapes

    shapes = model_shapes(size.kind, size.target)
    return sum(-(-math.prod(s) * 4 // MODEL_ALIGN) * MODEL_ALIGN for s in shapes)


def _iters(cfg: BenchConfig, size: Size, volume_per_iter: float) -> tuple[int, int]:
    base = max(cfg.min_iters, round(size.iters * cfg.iters_scale))
    by_volume = int(cfg.volume_budget / max(volume_per_iter, 1))
    return max(cfg.min_iters, min(base, by_volume)), size.warmup


def _need(what: str, n: int, s: int) -> int:
    """Bytes a phase holds at once (data only; the workers' interpreters aside)."""
    if what == "copy":  # trainer, 2 slots, floor src + dst, one model per worker
        return (n + 5) * s
    if what == "alias":  # trainer, 2 slots, floor dst
        return 4 * s
    if what == "naive":  # trainer, pickle; per worker: model, message, unpickled copy
        return (3 * n + 2) * s
    raise ValueError(what)


SAFETY = 3 * GiB  # kept free for everything else on the host


def _skip_reason(cfg: BenchConfig, what: str, n: int, s: int, available: int | None = None) -> str:
    """Why a phase cannot run ('' if it can): memory budget, free memory, volume cap."""
    need = _need(what, n, s)
    if need > cfg.mem_budget:
        return f"skipped: needs {_fmt_gib(need)} (budget {_fmt_gib(cfg.mem_budget)})"
    if available is not None and need > available - SAFETY:
        return f"skipped: needs {_fmt_gib(need)}, {_fmt_gib(available)} available"
    if what == "naive" and (n + 1) * s > cfg.naive_volume_cap:
        cap = _fmt_gib(cfg.naive_volume_cap)
        return f"skipped: moves {_fmt_gib((n + 1) * s)} per publish (cap {cap})"
    return ""


def _data(mem: dict[str, int]) -> int:
    """PSS of a worker's data: anonymous + shared memory (file-backed code excluded)."""
    return mem.get("pss_anon", 0) + mem.get("pss_shmem", 0)


class _Stopwatch:
    """Ends a measuring loop early: `min_iters` samples and `phase_seconds` spent, or at
    least one sample and three times `phase_seconds` (one publish may take seconds)."""

    def __init__(self, cfg: BenchConfig, warmup: int) -> None:
        self.cfg, self.warmup, self.t0 = cfg, warmup, time.perf_counter()

    def enough(self, i: int) -> bool:
        samples, spent = i - self.warmup, time.perf_counter() - self.t0
        limit = self.cfg.phase_seconds
        return (samples >= self.cfg.min_iters and spent > limit) or (
            samples >= 1 and spent > 3 * limit
        )


# --- the run ------------------------------------------------------------------------


class _Run:
    """State of one benchmark run: dirs, pool, sockets; `close()` ends all of it."""

    def __init__(self, cfg: BenchConfig, results: Results, console: Any) -> None:
        import zmq

        self.cfg, self.results, self.console = cfg, results, console
        self.runtime = tempfile.mkdtemp(prefix="zsb", dir="/tmp")
        self.shm = os.path.join("/dev/shm", f"zmqsync-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.shm, mode=0o700)
        self.log_dir = Path(self.runtime) / "logs"
        self.log_dir.mkdir()
        env = dict(os.environ)
        env.update(ZMQSYNC_RUNTIME_DIR=self.runtime, ZMQSYNC_SHM_DIR=self.shm)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if cfg.worker_threads:
            env["ZMQSYNC_BENCH_THREADS"] = str(cfg.worker_threads)
        self.env = env
        from ._bench_worker import source_digest

        self.source = source_digest()
        self.pool = Pool(env, self.log_dir, cfg.timeout, self.source)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.torchrl_proc: subprocess.Popen[str] | None = None
        self.publisher: Any = None
        self.phase = 0

    def close(self) -> None:
        if self.publisher is not None:
            with contextlib.suppress(Exception):
                self.publisher.close()
            self.publisher = None
        if self.torchrl_proc is not None and self.torchrl_proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.torchrl_proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.torchrl_proc.wait(10)
        self.pool.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)

    # --- helpers ---

    def name(self) -> str:
        self.phase += 1
        return f"b{self.phase}"

    def address(self, name: str) -> str:
        return f"ipc://{self.runtime}/{name}.sock"

    def shm_file(self, tag: str, nbytes: int) -> tuple[str, torch.Tensor]:
        """A file of `nbytes` in the run's shm dir, mapped writable and pre-faulted."""
        import mmap

        import torch

        path = os.path.join(self.shm, f"floor-{tag}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        t.fill_(1)
        return path, t

    @property
    def segment_prefix(self) -> str:
        """Paths of zmqsync's segments in the run's shm dir (the floor files excluded)."""
        return os.path.join(self.shm, "zmqsync-")

    def segment_bytes(self) -> int | None:
        sizes = [e.stat().st_size for e in os.scandir(self.shm) if e.name.startswith("zmqsync-")]
        return sum(sizes) if sizes else None

    # --- phases ---

    def zmqsync_phase(self, row: Row, size: Size, fan: Fanout) -> None:
        """Publishes interleaved with the raw, memcpy and (copy mode) N+1-copies floors."""
        import torch

        from ._bench_worker import make_model
        from ._publisher import Publisher

        cfg, pool, n, timeout = self.cfg, self.pool, row.n, self.cfg.timeout
        s = _padded(size)
        volume = (n + 1) * s * (2 if row.mode == "copy" else 1) + 2 * s
        iters, warmup = _iters(cfg, size, volume)
        trainer, tflat = make_model(size.kind, size.target, fill=True, grad=True)
        row.tensors = len(list(trainer.parameters()))
        row.nbytes = sum(p.numel() * 4 for p in trainer.parameters())
        _, dst = self.shm_file("dst", tflat.numel())
        floor_src = ""
        if row.mode == "copy":
            floor_src, src = self.shm_file("src", tflat.numel())
            src.copy_(tflat)
            del src
        before = pool.call(n, {"cmd": "mem", "under": self.segment_prefix})
        pool.call(n, {"cmd": "model", "kind": size.kind, "nbytes": size.target})
        pool.call(
            n,
            {
                "cmd": "respond",
                "events": fan.events,
                "acks": fan.acks,
                "floor": floor_src,
                "floor_bytes": tflat.numel(),
            },
        )
        fan.connected(n, timeout)
        name = self.name()
        pub = self.publisher = Publisher(
            trainer, self.address(name), name=name, slots=SLOTS, timeout=timeout, shm_dir=self.shm
        )
        pub.start()
        row.segment_bytes = self.segment_bytes()
        joins = pool.call(
            n,
            {
                "cmd": "join",
                "address": pub.address,
                "name": name,
                "mode": row.mode,
                "timeout": timeout,
                "shm_dir": self.shm,
            },
        )
        row.join_p50 = p50([j["seconds"] for j in joins])
        if not pub.wait_for_workers(n, timeout=timeout):
            raise BenchError(f"only {len(pub.workers)} of {n} workers joined in time")
        default_threads = torch.get_num_threads()
        samples: dict[str, list[float]] = {
            k: [] for k in ("zmqsync", "lib", "raw", "memcpy1", "memcpyd", "copyn")
        }

        def timed(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t

        def memcpy(threads: int) -> float:
            torch.set_num_threads(threads)
            try:
                return timed(lambda: dst.copy_(tflat))
            finally:
                torch.set_num_threads(default_threads)

        stop = _Stopwatch(cfg, warmup)
        for i in range(warmup + iters):
            if stop.enough(i):
                break
            # raw first, after the last publish; the copies round (same responder thread
            # as raw) next, not straight before raw: a thread woken twice in a row
            # answers faster, and raw read 10-30% lower in copy mode than in alias mode.
            got: dict[str, float] = {"raw": fan.round(b"raw", n, timeout)}
            if row.mode == "copy":
                got["copyn"] = fan.round(b"copy", n, timeout, local=lambda: memcpy(1))
            t = time.perf_counter()
            handle = pub.publish()
            got["zmqsync"] = time.perf_counter() - t
            got["lib"] = handle.seconds
            got["memcpy1"] = memcpy(1)
            got["memcpyd"] = memcpy(default_threads)
            if i >= warmup:
                for k, v in got.items():
                    samples[k].append(v)
        pool.call(n, {"cmd": "unrespond"})  # unmaps the floor buffer
        pool.call(n, {"cmd": "touch"})
        after = pool.call(n, {"cmd": "mem", "under": self.segment_prefix})
        pool.call(n, {"cmd": "leave"})
        pub.close()
        self.publisher = None
        row.iters = len(samples["zmqsync"])
        row.samples = {k: v for k, v in samples.items() if v}
        row.zmqsync_p50, row.zmqsync_p99 = p50(samples["zmqsync"]), p99(samples["zmqsync"])
        row.zmqsync_lib_p50 = p50(samples["lib"])
        row.raw_p50, row.raw_p99 = p50(samples["raw"]), p99(samples["raw"])
        row.memcpy1_p50, row.memcpyd_p50 = p50(samples["memcpy1"]), p50(samples["memcpyd"])
        row.copyn_p50 = p50(samples["copyn"])
        deltas = [_data(a) - _data(b) for a, b in zip(after, before, strict=True)]
        segs = [a["seg_pss"] - b["seg_pss"] for a, b in zip(after, before, strict=True)]
        row.pss_delta = statistics.mean(deltas)
        row.seg_pss = statistics.mean(segs)
        row.extra = max(d - g for d, g in zip(deltas, segs, strict=True))

    def naive_phase(self, rows: list[Row], size: Size, fan: Fanout) -> None:
        """A pickled state_dict on a PUB socket; each worker unpickles, loads, acks."""
        import pickle

        from ._bench_worker import make_plain_model

        n, timeout = rows[0].n, self.cfg.timeout
        s = _padded(size)
        iters, _ = _iters(self.cfg, size, 3 * (n + 1) * s)
        warmup = 1
        stop_cfg = dataclasses.replace(self.cfg, min_iters=min(3, self.cfg.min_iters))
        trainer = make_plain_model(size.kind, size.target)
        self.pool.call(n, {"cmd": "model", "kind": size.kind, "nbytes": size.target})
        self.pool.call(n, {"cmd": "respond", "events": fan.events, "acks": fan.acks})
        fan.connected(n, timeout)
        lat: list[float] = []
        stop = _Stopwatch(stop_cfg, warmup)
        for i in range(warmup + iters):
            if stop.enough(i):
                break
            t = fan.round(b"naive", n, timeout, payload=lambda: pickle.dumps(trainer.state_dict()))
            if i >= warmup:
                lat.append(t)
        for row in rows:
            row.naive_p50, row.naive_p99, row.naive_status = p50(lat), p99(lat), "ok"
            row.samples["naive"] = lat

    def point(self, n: int, size: Size) -> None:
        """Every mode and baseline of one (N, size) point."""
        cfg, results = self.cfg, self.results
        s = _padded(size)
        rows = []
        for mode in cfg.modes:
            row = Row(n=n, size=size.key, label=size.label, mode=mode)
            row.status = _skip_reason(cfg, mode, n, s, _available()) or "ok"
            results.rows.append(row)
            rows.append(row)
        naive_skip = (
            _skip_reason(cfg, "naive", n, s, _available()) if cfg.naive else "skipped: --no-naive"
        )
        for row in rows:
            row.naive_status = naive_skip
        jobs: list[tuple[str, Callable[[Fanout], None]]] = [
            (row.mode, functools.partial(self.zmqsync_phase, row, size))
            for row in rows
            if row.status == "ok"
        ]
        if not naive_skip:
            jobs.append(("naive", functools.partial(self.naive_phase, rows, size)))
        self.advance(len(cfg.modes) + int(cfg.naive) - len(jobs))  # the skipped ones
        for what, job in jobs:
            self.progress_note(f"N={n} {size.label} {what}")
            fan = Fanout(self.ctx, self.runtime, f"f{self.name()}")
            t_job = time.perf_counter()
            try:
                job(fan)
            except (BenchError, TimeoutError, OSError, RuntimeError) as exc:
                log.warning("N=%d %s %s failed: %s", n, size.key, what, exc)
                msg = f"error: {type(exc).__name__}: {exc}"[:300]
                for row in rows:
                    if what == "naive":
                        row.naive_status = msg
                    elif row.mode == what:
                        row.status = msg
            finally:
                if self.publisher is not None:
                    with contextlib.suppress(Exception):
                        self.publisher.close()
                    self.publisher = None
                self.pool.reset(n)
                fan.close()
                for tag in ("src", "dst"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.shm, f"floor-{tag}"))
                spent = time.perf_counter() - t_job
                for row in rows:
                    if what == "naive":
                        row.naive_seconds = spent
                    elif row.mode == what:
                        row.seconds = spent
                self.advance()
        for row in rows:
            self.report_row(row)

    # --- torchrl ---

    def torchrl_plan(self, n: int) -> list[dict[str, Any]]:
        cfg = self.cfg
        points: list[dict[str, Any]] = []
        held = 0
        for key in cfg.sizes:
            size = SIZES[key]
            s = _padded(size)
            for variant in ("collector", "own"):
                reason = ""
                if size.kind == "many" and n > cfg.torchrl_many_max_workers:
                    reason = (
                        f"skipped: above {cfg.torchrl_many_max_workers} workers "
                        "(--torchrl-many-max-workers): seconds per send, minutes to connect"
                    )
                elif variant == "own" and (n + 1) * s > cfg.torchrl_volume_cap:
                    reason = (
                        f"skipped: copies {_fmt_gib((n + 1) * s)} per send "
                        f"(cap {_fmt_gib(cfg.torchrl_volume_cap)})"
                    )
                elif held + (1 if variant == "collector" else 2) * s > cfg.mem_budget:
                    budget = _fmt_gib(cfg.mem_budget)
                    reason = f"skipped: torchrl holds every size at once; over {budget}"
                if reason:
                    self.set_torchrl(n, key, variant, status=reason)
                    continue
                held += (1 if variant == "collector" else 2) * s
                iters, _ = _iters(cfg, size, (n + 1) * s if variant == "own" else s)
                points.append(
                    {
                        "key": key,
                        "kind": size.kind,
                        "nbytes": size.target,
                        "variant": variant,
                        "iters": iters,
                        "warmup": 1,
                        "min_iters": min(3, cfg.min_iters),
                        "max_seconds": cfg.phase_seconds,
                    }
                )
        return points

    def set_torchrl(
        self, n: int, key: str, variant: str, status: str, lat: Sequence[float] = ()
    ) -> None:
        for row in self.results.rows:
            if row.n == n and row.size == key:
                suffix = "_own" if variant == "own" else ""
                setattr(row, f"torchrl{suffix}_status", status)
                if lat:
                    setattr(row, f"torchrl{suffix}_p50", p50(lat))
                    setattr(row, f"torchrl{suffix}_p99", p99(lat))
                    row.samples[f"torchrl{suffix}"] = list(lat)

    def torchrl_for(self, n: int) -> None:
        """torchrl's SharedMemWeightSyncScheme with n receivers, in a killable subprocess."""
        points = self.torchrl_plan(n)
        if not points:
            return
        self.progress_note(f"N={n} torchrl")
        spec = {
            "workers": n,
            "points": points,
            "start_method": self.cfg.torchrl_start_method,
            "connect_timeout": self.cfg.timeout,
        }
        # Deadline per point (a dead receiver blocks send() forever): receivers connect,
        # then sends for 3 × phase_seconds at most, the last one at a pessimistic
        # 0.5 GB/s per copy; the clock restarts at each point's result line.
        biggest = max(_padded(SIZES[p["key"]]) for p in points)
        per_point = (
            self.cfg.timeout + 30.0 + 4 * self.cfg.phase_seconds + 2 * (n + 1) * biggest / 1e9
        )
        budget = 60.0 + per_point
        log_path = self.log_dir / f"torchrl-{n}.log"
        run: dict[str, Any] = {"workers": n, "status": "ok", "deadline_per_point_s": per_point}
        t_run = time.perf_counter()
        done: set[tuple[str, str]] = set()
        with open(log_path, "w") as err:
            proc = self.torchrl_proc = subprocess.Popen(
                [sys.executable, "-m", "zmqsync._bench_worker", "torchrl", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,
            )
            lines: queue.Queue[str | None] = queue.Queue()

            def read() -> None:
                assert proc.stdout is not None
                for line in proc.stdout:
                    lines.put(line)
                lines.put(None)

            threading.Thread(target=read, daemon=True).start()
            deadline = time.monotonic() + budget
            try:
                while True:
                    try:
                        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                    except queue.Empty:
                        run["status"] = f"killed: no result within {per_point:.0f} s (deadline)"
                        break
                    if line is None:
                        break
                    if not line.startswith("{"):
                        continue
                    rec = json.loads(line)
                    if rec.get("event") == "started":
                        run.update(start_method=rec["start_method"], torchrl=rec["torchrl"])
                    elif rec.get("event") == "point":
                        deadline = time.monotonic() + per_point  # the next point's turn
                        done.add((rec["key"], rec["variant"]))
                        key = f"{rec['key']}/{rec['variant']}"
                        if "error" in rec:
                            self.set_torchrl(
                                n, rec["key"], rec["variant"], f"error: {rec['error']}"
                            )
                            run.setdefault("errors", {})[key] = rec["error"]
                            continue
                        self.set_torchrl(n, rec["key"], rec["variant"], "ok", rec["lat"])
                        run.setdefault("receivers_start_s", {})[key] = rec["start_s"]
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # forkserver children, if any
                if proc.stdout is not None:
                    proc.stdout.close()
                self.torchrl_proc = None
        if proc.returncode not in (0, None) and run["status"] == "ok":
            run["status"] = f"exited {proc.returncode}"
        if run["status"] != "ok":
            tail = log_path.read_text()[-800:].strip().splitlines()
            run["stderr_tail"] = tail[-6:]
        for p in points:
            if (p["key"], p["variant"]) not in done:
                why = run["status"] if run["status"] != "ok" else "no result"
                self.set_torchrl(n, p["key"], p["variant"], f"error: {why}"[:300])
        run["seconds"] = time.perf_counter() - t_run
        self.results.torchrl_runs.append(run)
        self.advance()

    # --- late join ---

    def late_join(self, key: str) -> None:
        """A new worker's Subscriber(...).start() against a model of `key` (alias, copy)."""
        from ._bench_worker import make_model
        from ._publisher import Publisher

        size, timeout = SIZES[key], self.cfg.timeout
        s = _padded(size)
        out: dict[str, Any] = {"size": key, "label": size.label}
        if 4 * s > self.cfg.mem_budget:
            out["status"] = f"skipped: needs {_fmt_gib(4 * s)}"
            self.results.late_join = out
            self.advance()
            return
        self.progress_note(f"late join {size.label}")
        self.pool.grow(max(1, len(self.pool.workers)))
        trainer, _ = make_model(size.kind, size.target, fill=True, grad=True)
        out["nbytes"] = sum(p.numel() * 4 for p in trainer.parameters())
        name = self.name()
        pub = self.publisher = Publisher(
            trainer, self.address(name), name=name, slots=SLOTS, timeout=timeout, shm_dir=self.shm
        )
        try:
            pub.start()
            pub.publish()  # the bus is at version 1: not the trivial first version
            workers = min(4, len(self.pool.workers))
            for mode, rounds in (("alias", self.cfg.late_join_rounds), ("copy", 3)):
                secs: list[float] = []
                for r in range(rounds):
                    w = self.pool.workers[r % workers]
                    w.wait(
                        w.send({"cmd": "model", "kind": size.kind, "nbytes": size.target}),
                        time.monotonic() + timeout,
                    )
                    reply = w.wait(
                        w.send(
                            {
                                "cmd": "join",
                                "address": pub.address,
                                "name": name,
                                "mode": mode,
                                "timeout": timeout,
                                "shm_dir": self.shm,
                            }
                        ),
                        time.monotonic() + timeout,
                    )
                    secs.append(reply["seconds"])
                    w.wait(w.send({"cmd": "drop"}), time.monotonic() + timeout)
                out[mode] = {"samples": secs, "p50": p50(secs), "max": max(secs), "first": secs[0]}
            out["status"] = "ok"
        except (BenchError, TimeoutError, OSError, RuntimeError) as exc:
            out["status"] = f"error: {type(exc).__name__}: {exc}"[:300]
        finally:
            pub.close()
            self.publisher = None
            self.pool.reset(len(self.pool.workers))
        self.results.late_join = out
        self.advance()

    # --- progress ---

    progress: Any = None
    task: Any = None

    def progress_note(self, what: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=what)

    def advance(self, steps: int = 1) -> None:
        if self.progress is not None and steps > 0:
            self.progress.advance(self.task, steps)

    def report_row(self, row: Row) -> None:
        if self.console is None:
            return
        if row.status != "ok":
            self.console.print(f"  N={row.n:<3} {row.label:<20} {row.mode:<5} [dim]{row.status}[/]")
            return
        r = row.ratios()
        self.console.print(
            f"  N={row.n:<3} {row.label:<20} {row.mode:<5} p50 {_ms(row.zmqsync_p50)}  "
            f"raw {_ms(row.raw_p50)} ({_x(r['x_raw'])})  floor {_x(r['x_floor'])}"
        )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms" if x < 0.01 else f"{x * 1e3:.1f} ms"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}×"


def _pct(frac: float | None, nbytes: int) -> str:
    """A share of the model's bytes; meaningless (n/a) for models under 1 MiB."""
    if frac is None:
        return "-"
    return "n/a (< 1 MB)" if nbytes < MiB else f"{frac * 100:.2f}%"


def _human(nbytes: float) -> str:
    for unit, scale in (("GB", GiB), ("MB", MiB), ("KB", KiB)):
        if nbytes >= scale * 0.9:
            return f"{nbytes / scale:.0f} {unit}"
    return f"{nbytes:.0f} B"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def _steps(cfg: BenchConfig) -> int:
    steps = len(cfg.workers) * len(cfg.sizes) * (len(cfg.modes) + int(cfg.naive))
    if cfg.torchrl:
        steps += sum(1 for n in cfg.workers if n <= cfg.torchrl_max_workers)
    return steps + (1 if cfg.late_join else 0)


def torchrl_available() -> str:
    """'' when torchrl can be used here, else why not."""
    try:
        metadata.version("torchrl")
    except metadata.PackageNotFoundError:
        return "torchrl is not installed: pip install 'zmqsync[torchrl]'"
    return ""


def run_bench(cfg: BenchConfig, console: Any = None, command: str = "") -> Results:
    """Run the grid of `cfg`; always ends every process and removes every file it made.

    Returns the results (partial, with ``interrupted`` set, if Ctrl-C stopped it: then
    KeyboardInterrupt is raised again after the files are written).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not cfg.mem_budget:
        avail = _meminfo().get("MemAvailable", 8 * GiB)
        cfg = dataclasses.replace(cfg, mem_budget=min(14 * GiB, int(avail * 0.6)))
    if cfg.torchrl and (why := torchrl_available()):
        if console is not None:
            console.print(f"[yellow]torchrl baseline off[/]: {why}")
        cfg = dataclasses.replace(cfg, torchrl=False)
    conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    results = Results(config=conf, machine=describe_machine())
    from ._bench_worker import source_digest
    from ._publisher import Publisher  # noqa: F401 - the code the digest describes

    results.machine["source_digest"] = source_digest()
    results.command = command
    run = _Run(cfg, results, console)
    t0 = time.perf_counter()
    interrupted: BaseException | None = None
    columns = (
        TextColumn("[bold]{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=console, transient=True, disable=console is None) as pr:
            run.progress, run.task = pr, pr.add_task("starting workers", total=_steps(cfg))
            run.console = pr.console if console is not None else None
            for n in sorted(cfg.workers):
                run.progress_note(f"starting {n} workers")
                started = run.pool.grow(n)
                results.machine.setdefault("pool_start_s", {})[str(n)] = started
                for key in cfg.sizes:
                    run.point(n, SIZES[key])
                if cfg.torchrl and n <= cfg.torchrl_max_workers:
                    run.torchrl_for(n)
            if cfg.late_join:
                run.late_join(cfg.late_join)
    except SourceChanged as exc:
        results.aborted = str(exc)
        if console is not None:
            console.print(f"[red]aborted[/]: {exc}")
    except KeyboardInterrupt as exc:
        interrupted = exc
        results.interrupted = True
    finally:
        run.close()
        results.seconds = time.perf_counter() - t0
        results.machine["loadavg_end"] = os.getloadavg()
        if cfg.torchrl:
            results.machine["torchrl_skipped_above"] = cfg.torchrl_max_workers
    write_results(results, cfg.out)
    if interrupted is not None:
        raise interrupted
    return results


# --- targets ------------------------------------------------------------------------


def evaluate_targets(res: Results) -> list[dict[str, Any]]:
    """The six targets (docs/benchmarks.md), each named for what it measures: met / not
    met / not measured, with the ratios."""
    ok = [r for r in res.rows if r.status == "ok" and r.zmqsync_p50 is not None]
    out: list[dict[str, Any]] = []

    def add(tid: str, text: str, met: bool | None, measured: str) -> None:
        out.append({"id": tid, "target": text, "met": met, "measured": measured})

    # 1. fixed overhead
    parts, verdicts = [], []
    for n in (8, 64):
        for r in ok:
            if r.size == "4K" and r.n == n and (x := r.ratios()["x_raw"]) is not None:
                parts.append(f"{n} workers {r.mode}: {x:.2f}×")
                verdicts.append(x <= 1.5)
    add(
        "fixed cost",
        "4 KB model, 8 and 64 workers: p50 publish ≤ 1.5× the raw ZeroMQ round trip",
        all(verdicts) if verdicts else None,
        "; ".join(parts) or "not measured",
    )
    # 2. alias 512 MB 8 workers
    r2 = next((r for r in ok if (r.n, r.size, r.mode) == (8, "512M", "alias")), None)
    x2 = r2.ratios()["x_floor"] if r2 else None
    add(
        "big alias",
        "alias, 512 MB, 8 workers: p50 ≤ 1.2× (memcpy floor + raw round trip)",
        None if x2 is None else x2 <= 1.2,
        "not measured"
        if x2 is None or r2 is None
        else f"{x2:.2f}× ({_ms(r2.zmqsync_p50)} vs {_ms(r2.memcpy_floor)} + {_ms(r2.raw_p50)})",
    )
    # 3. copy mode vs N+1 copies
    copies: list[tuple[Row, float]] = []
    for r in ok:
        if r.mode == "copy" and (xf := r.ratios()["x_floor"]) is not None:
            copies.append((r, xf))
    if copies:
        worst = max(copies, key=lambda rx: rx[1])
        bad = [rx for rx in copies if rx[1] > 1.3]
        measured = (
            f"{len(copies) - len(bad)} of {len(copies)} points ≤ 1.3×; worst "
            f"{worst[1]:.2f}× (N={worst[0].n}, {worst[0].label})"
        )
        add(
            "copy floor",
            "copy mode, any N: p50 ≤ 1.3× the N+1-concurrent-copies floor",
            not bad,
            measured,
        )
    else:
        add(
            "copy floor",
            "copy mode, any N: p50 ≤ 1.3× the N+1-concurrent-copies floor",
            None,
            "not measured",
        )
    # 4. faster than torchrl
    alias = [r for r in ok if r.mode == "alias"]
    parts, verdicts = [], []
    for attr, what in (("torchrl_p50", "collector"), ("torchrl_own_p50", "own buffer")):
        pairs: list[tuple[Row, float]] = [
            (r, getattr(r, attr)) for r in alias if getattr(r, attr) is not None
        ]
        if not pairs:
            continue
        wins = [r for r, t in pairs if r.zmqsync_p50 is not None and r.zmqsync_p50 < t]
        losses = [r for r, t in pairs if r not in wins]
        worst = max(pairs, key=lambda rt: (rt[0].zmqsync_p50 or 0) / rt[1])
        parts.append(
            f"vs torchrl ({what}): faster at {len(wins)} of {len(pairs)} points"
            + (
                f"; slower at e.g. N={worst[0].n} {worst[0].label} "
                f"({(worst[0].zmqsync_p50 or 0) / worst[1]:.2f}×)"
                if losses
                else ""
            )
        )
        verdicts.append(not losses)
    add(
        "vs torchrl",
        "zmqsync alias mode faster than torchrl at every grid point where torchrl runs",
        all(verdicts) if verdicts else None,
        "; ".join(parts) or "torchrl not measured",
    )
    # 5. memory
    big = [r for r in alias if r.nbytes >= 64 * MiB and r.extra is not None]
    # The segment: a 4 KiB header page, then `slots` slots of whole pages, every tensor
    # at a 256-byte boundary. "Nothing more" = no third copy: the overhead beyond
    # slots × model bytes is checked on models of 1 MiB and more (a 4 KB model's 20 KiB
    # segment is all header and page rounding).
    overs = [
        (r, (r.segment_bytes or 0) - SLOTS * r.nbytes)
        for r in ok
        if r.segment_bytes is not None and r.nbytes >= MiB
    ]
    seg_ok = all(over <= 0.01 * SLOTS * r.nbytes + 64 * KiB for r, over in overs)
    seg_txt = ""
    if overs:
        worst_seg = max(overs, key=lambda ro: ro[1] / ro[0].nbytes)
        seg_txt = (
            f"segment = {SLOTS} × model + at most {worst_seg[1] / KiB:.0f} KiB "
            f"({worst_seg[0].label}: header page, alignment, page rounding)"
        )
    if big:
        worst5 = max(big, key=lambda r: (r.extra or 0) / r.nbytes)
        frac = (worst5.extra or 0) / worst5.nbytes
        add(
            "alias memory",
            "alias workers add ≤ 5% of the model's bytes beyond the shared segment; "
            "the segment holds `slots` copies, nothing more",
            frac <= 0.05 and seg_ok,
            f"worst {frac * 100:.2f}% ({_mib(worst5.extra)} MiB, N={worst5.n}, "
            f"{worst5.label}) over {len(big)} alias points ≥ 64 MB; {seg_txt}",
        )
    else:
        add(
            "alias memory",
            "alias workers add ≤ 5% of model bytes beyond the segment",
            None,
            "not measured (needs an alias point ≥ 64 MB)" + (f"; {seg_txt}" if seg_txt else ""),
        )
    # 6. late join
    lj = res.late_join.get("alias") if res.late_join else None
    if lj:
        add(
            "late join",
            f"late join: a worker starting against a {res.late_join.get('label')} model is "
            "applied (alias) within 50 ms of start(), handshake included",
            lj["max"] <= 0.05,
            f"p50 {_ms(lj['p50'])}, max {_ms(lj['max'])}, first {_ms(lj['first'])} "
            f"({len(lj['samples'])} joins)",
        )
    else:
        add(
            "late join",
            "late join within 50 ms (alias, 1 GB)",
            None,
            res.late_join.get("status", "not measured") if res.late_join else "not measured",
        )
    return out


# --- output -------------------------------------------------------------------------

CSV_FIELDS = [
    "n", "size", "label", "mode", "nbytes", "tensors", "status", "iters",
    "zmqsync_p50", "zmqsync_p99", "zmqsync_lib_p50", "raw_p50", "raw_p99",
    "memcpy1_p50", "memcpyd_p50", "memcpy_floor", "copyn_p50",
    "x_raw", "x_floor", "gbps",
    "torchrl_p50", "torchrl_p99", "torchrl_status", "x_torchrl",
    "torchrl_own_p50", "torchrl_own_p99", "torchrl_own_status", "x_torchrl_own",
    "naive_p50", "naive_p99", "naive_status", "x_naive",
    "join_p50", "pss_delta", "seg_pss", "extra", "extra_frac", "segment_bytes", "segment_frac",
    "seconds", "naive_seconds",
]  # fmt: skip


def write_results(res: Results, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = res.to_json()
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in res.rows:
            writer.writerow(r.flat())


def load_results(path: Path) -> Results:
    p = path / "results.json" if path.is_dir() else path
    return Results.from_json(json.loads(p.read_text()))


def print_report(res: Results, console: Any) -> None:
    """The tables (rich) and the targets."""
    from rich.table import Table

    lat = Table(
        title="publish latency, p50 (ms) — ratios are zmqsync p50 over the baseline",
        caption="floor: copy mode = N+1 concurrent copies; alias = memcpy + raw round trip",
    )
    for col in (
        "N", "model", "mode", "zmqsync", "p99", "raw rt", "memcpy 1t/def", "N+1 copies",
        "×raw", "×floor", "GB/s", "torchrl coll/own", "×torchrl", "naive",
    ):  # fmt: skip
        lat.add_column(col, justify="right")
    for r in res.rows:
        x = r.ratios()
        if r.status != "ok":
            lat.add_row(str(r.n), r.label, r.mode, f"[dim]{r.status}[/]", *[""] * 10)
            continue
        lat.add_row(
            str(r.n),
            r.label,
            r.mode,
            _num(r.zmqsync_p50),
            _num(r.zmqsync_p99),
            _num(r.raw_p50),
            f"{_num(r.memcpy1_p50)}/{_num(r.memcpyd_p50)}",
            _num(r.copyn_p50),
            _x(x["x_raw"]),
            _x(x["x_floor"]),
            "-" if x["gbps"] is None else f"{x['gbps']:.2f}",
            f"{_num(r.torchrl_p50)}/{_num(r.torchrl_own_p50)}",
            _x(x["x_torchrl"]),
            _num(r.naive_p50) if r.naive_p50 is not None else (r.naive_status[:10] or "-"),
        )
    console.print(lat)
    mem = Table(title="memory per worker (MiB): PSS after − before, and beyond the segment")
    for col in (
        "N",
        "model",
        "mode",
        "model MiB",
        "PSS Δ",
        "segment share",
        "beyond",
        "% model",
        "segment / (slots×model)",
        "join p50",
    ):
        mem.add_column(col, justify="right")
    for r in res.rows:
        if r.status != "ok":
            continue
        x = r.ratios()
        mem.add_row(
            str(r.n), r.label, r.mode, _mib(r.nbytes), _mib(r.pss_delta), _mib(r.seg_pss),
            _mib(r.extra), _pct(x["extra_frac"], r.nbytes),
            "-" if x["segment_frac"] is None else f"{x['segment_frac']:.4f}", _num(r.join_p50),
        )  # fmt: skip
    console.print(mem)
    if res.late_join:
        lj = res.late_join
        parts = [
            f"{m}: p50 {_ms(lj[m]['p50'])}, max {_ms(lj[m]['max'])}"
            for m in ("alias", "copy")
            if m in lj
        ]
        console.print(f"late join ({lj.get('label')}): {'; '.join(parts) or lj.get('status')}")
    targets = Table(title="targets")
    for col in ("name", "target", "met", "measured"):
        targets.add_column(col)
    for t in evaluate_targets(res):
        met = {True: "[green]met[/]", False: "[red]not met[/]", None: "[dim]n/a[/]"}[t["met"]]
        targets.add_row(t["id"], t["target"], met, t["measured"])
    console.print(targets)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    ms = x * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def markdown_report(res: Results) -> str:
    """The tables of docs/benchmarks.md, from a results.json."""
    lines = [
        "| N | model | mode | zmqsync p50 | p99 | raw rt | memcpy 1t / default | N+1 copies "
        "| ×raw | ×floor | GB/s | torchrl collector / own | ×torchrl (coll / own) | naive |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.rows:
        x = r.ratios()
        if r.status != "ok":
            lines.append(f"| {r.n} | {r.label} | {r.mode} | {r.status} |||||||||||")
            continue
        naive = _num(r.naive_p50) if r.naive_p50 is not None else (r.naive_status or "-")
        gbps = "-" if x["gbps"] is None else f"{x['gbps']:.2f}"
        lines.append(
            f"| {r.n} | {r.label} | {r.mode} | {_num(r.zmqsync_p50)} | {_num(r.zmqsync_p99)} "
            f"| {_num(r.raw_p50)} | {_num(r.memcpy1_p50)} / {_num(r.memcpyd_p50)} "
            f"| {_num(r.copyn_p50)} | {_x(x['x_raw'])} | {_x(x['x_floor'])} "
            f"| {gbps} "
            f"| {_num(r.torchrl_p50)} / {_num(r.torchrl_own_p50)} "
            f"| {_x(x['x_torchrl'])} / {_x(x['x_torchrl_own'])} | {naive} |"
        )
    lines += [
        "",
        "| N | model | mode | model MiB | PSS Δ MiB | segment share MiB | beyond segment MiB "
        "| % of model | segment / (slots × model) | join p50 (ms) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res.rows:
        if r.status != "ok":
            continue
        x = r.ratios()
        frac = _pct(x["extra_frac"], r.nbytes)
        seg = "-" if x["segment_frac"] is None else f"{x['segment_frac']:.4f}"
        lines.append(
            f"| {r.n} | {r.label} | {r.mode} | {_mib(r.nbytes)} | {_mib(r.pss_delta)} "
            f"| {_mib(r.seg_pss)} | {_mib(r.extra)} | {frac} | {seg} | {_num(r.join_p50)} |"
        )
    lines += ["", "| name | target | met | measured |", "|---|---|---|---|"]
    for t in evaluate_targets(res):
        met = {True: "**met**", False: "**not met**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['id']} | {t['target']} | {met} | {t['measured']} |")
    return "\n".join(lines) + "\n"


# --- plots --------------------------------------------------------------------------


def plot(res: Results, out: Path) -> list[Path]:
    """latency_vs_size.png, latency_vs_workers.png, memory.png under `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "plots need matplotlib: pip install 'zmqsync[plot]' (or run without --plot)"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in res.rows if r.status == "ok"]
    series: list[tuple[str, Callable[[Row], float | None], str, str]] = [
        ("zmqsync copy", lambda r: r.zmqsync_p50 if r.mode == "copy" else None, "C0", "-o"),
        ("zmqsync alias", lambda r: r.zmqsync_p50 if r.mode == "alias" else None, "C1", "-o"),
        ("N+1 copies floor", lambda r: r.copyn_p50 if r.mode == "copy" else None, "C0", ":"),
        ("memcpy floor", lambda r: r.memcpy_floor if r.mode == "alias" else None, "C7", ":"),
        ("raw ZeroMQ rt", lambda r: r.raw_p50 if r.mode == "alias" else None, "C2", ":"),
        ("torchrl (collector)", lambda r: r.torchrl_p50 if r.mode == "alias" else None, "C3",
         "--s"),
        ("torchrl (own buffer)", lambda r: r.torchrl_own_p50 if r.mode == "alias" else None, "C5",
         "--^"),
        ("naive pickle", lambda r: r.naive_p50 if r.mode == "alias" else None, "C4", "--x"),
    ]  # fmt: skip

    def draw(ax: Any, rows: list[Row], xkey: Callable[[Row], float]) -> None:
        for label, get, color, style in series:
            pts = sorted((xkey(r), v) for r in rows if (v := get(r)) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, color=color,
                        label=label, markersize=4, linewidth=1.2)  # fmt: skip
        ax.set_xscale("log", base=2 if xkey is _n else 10)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)

    def _n(r: Row) -> float:
        return r.n

    paths = []
    ns = sorted({r.n for r in ok})
    sizes = [k for k in SIZES if any(r.size == k for r in ok)]
    if ns:
        cols = min(4, len(ns))
        rows_ = -(-len(ns) // cols)
        height = 3.4 * rows_ + 0.9
        fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, height), squeeze=False)
        for ax, n in zip(axes.flat, ns, strict=False):
            draw(ax, [r for r in ok if r.n == n and r.size != "many"], lambda r: r.nbytes)
            ticks = sorted({r.nbytes for r in ok if r.size != "many"})
            ax.set_xticks(ticks, [_human(t) for t in ticks], fontsize=7, rotation=35)
            ax.minorticks_off()
            ax.set_title(f"{n} worker{'s' if n > 1 else ''}")
            ax.set_xlabel("model bytes")
            ax.set_ylabel("p50 per publish (ms)")
        for ax in list(axes.flat)[len(ns) :]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
        fig.suptitle("latency vs model size (p50 per publish)")
        fig.tight_layout(rect=(0, 0.65 / height, 1, 0.97))
        paths.append(out / "latency_vs_size.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    if sizes:
        cols = min(3, len(sizes))
        rows_ = -(-len(sizes) // cols)
        height = 3.4 * rows_ + 0.9
        fig, axes = plt.subplots(rows_, cols, figsize=(4.6 * cols, height), squeeze=False)
        for ax, key in zip(axes.flat, sizes, strict=False):
            draw(ax, [r for r in ok if r.size == key], _n)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.minorticks_off()
            ax.set_title(SIZES[key].label)
            ax.set_xlabel("workers N")
            ax.set_ylabel("p50 per publish (ms)")
        for ax in list(axes.flat)[len(sizes) :]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
        fig.suptitle("latency vs number of workers (p50 per publish)")
        fig.tight_layout(rect=(0, 0.65 / height, 1, 0.97))
        paths.append(out / "latency_vs_workers.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    mem_rows = [r for r in ok if r.extra is not None and r.size != "many"]
    if mem_rows:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for mode, color in (("copy", "C0"), ("alias", "C1")):
            for n, marker in zip(ns, "os^vD<>p", strict=False):
                pts = sorted(
                    (r.nbytes, max(r.extra or 0, 0.01 * MiB) / MiB)
                    for r in mem_rows
                    if r.mode == mode and r.n == n
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], f"-{marker}", color=color,
                            alpha=0.7, markersize=4, label=f"{mode}, N={n}")  # fmt: skip
        xs = sorted({r.nbytes for r in mem_rows})
        ax.plot(xs, [0.05 * x / MiB for x in xs], "k:", label="5% of the model")
        ax.plot(xs, [x / MiB for x in xs], "k--", alpha=0.4, label="the model's bytes")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model bytes")
        ax.set_ylabel("MiB per worker beyond the segment (≥ 0.01)")
        ax.set_title("worker memory beyond the shared segment (PSS)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        paths.append(out / "memory.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# --- command line -------------------------------------------------------------------


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, not {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("worker counts must be >= 1")
    return vals


def _csv_sizes(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in vals if v not in SIZES]
    if unknown or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}"
        )
    return vals


def _csv_modes(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    if not vals or any(v not in MODES for v in vals):
        raise argparse.ArgumentTypeError("modes: copy, alias or copy,alias")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `zmqsync bench` options (cheap: this module imports no torch at top level)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="small grid (1 and 4 workers, up to 64 MB), under 2 minutes",
    )
    p.add_argument("--workers", type=_csv_ints, default=None, help="e.g. 1,2,4,8,16,32,64")
    p.add_argument(
        "--sizes",
        type=_csv_sizes,
        default=None,
        help=f"from {','.join(SIZES)} (many = 2,000 tensors, 4 MB)",
    )
    p.add_argument("--modes", type=_csv_modes, default=None, help="copy,alias")
    p.add_argument(
        "--iters-scale",
        type=float,
        default=None,
        help="multiply the iterations per point (default 1; --quick 0.3)",
    )
    p.add_argument("--min-iters", type=int, default=None, help="samples per point at least")
    p.add_argument(
        "--phase-seconds",
        type=float,
        default=None,
        help="stop measuring a point after this long once --min-iters are in (default 5)",
    )
    p.add_argument("--no-torchrl", action="store_true", help="skip the torchrl baseline")
    p.add_argument(
        "--torchrl-max-workers",
        type=int,
        default=None,
        help="run torchrl only up to this N (default: every N)",
    )
    p.add_argument(
        "--torchrl-many-max-workers",
        type=int,
        default=None,
        help="run torchrl on the 2,000-tensor model only up to this N (default 16)",
    )
    p.add_argument("--no-naive", action="store_true", help="skip the pickled state_dict baseline")
    p.add_argument(
        "--late-join",
        default=None,
        metavar="SIZE",
        help="model size of the late-join test (default 1G; 'none' to skip)",
    )
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="skip points needing more (default min(14, 60%% of MemAvailable))",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads in each worker (default: torch's default)",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="deadline of every operation, s (default 120)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for results.json/.csv and plots (default ./zmqsync-bench)",
    )
    p.add_argument("--plot", action="store_true", help="draw PNG plots (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no tables")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = QUICK if args.quick else BenchConfig()
    changes: dict[str, Any] = {}
    names = ("workers", "sizes", "modes", "iters_scale", "min_iters", "phase_seconds")
    more = ("worker_threads", "timeout", "out", "torchrl_max_workers", "torchrl_many_max_workers")
    for name in (*names, *more):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if args.no_torchrl:
        changes["torchrl"] = False
    if args.no_naive:
        changes["naive"] = False
    if args.late_join is not None:
        if args.late_join.lower() == "none":
            changes["late_join"] = None
        elif args.late_join in SIZES:
            changes["late_join"] = args.late_join
        else:
            raise ValueError(f"--late-join: unknown size {args.late_join!r}")
    if args.mem_budget_gb is not None:
        changes["mem_budget"] = int(args.mem_budget_gb * GiB)
    changes["plot"] = bool(args.plot)
    return dataclasses.replace(cfg, **changes)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C: every process ended, every file removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_from_args(args: argparse.Namespace, command: str = "") -> int:
    """`zmqsync bench`: run, print tables and targets, write files (and plots)."""
    from rich.console import Console

    cfg = config_from_args(args)
    if cfg.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("zmqsync bench: --plot needs matplotlib: pip install 'zmqsync[plot]'",
                  file=sys.stderr)  # fmt: skip
            return 1
    console = None if args.quiet else Console(width=None if sys.stdout.isatty() else 180)
    with _sigterm_as_interrupt():
        res = run_bench(cfg, console, command=command or "zmqsync bench " + " ".join(sys.argv[2:]))
    if console is not None:
        print_report(res, console)
    if cfg.plot:
        for path in plot(res, cfg.out):
            if console is not None:
                console.print(f"plot: {path}")
    if console is not None:
        console.print(f"results: {cfg.out / 'results.json'}, {cfg.out / 'results.csv'} "
                      f"({res.seconds:.0f} s)")  # fmt: skip
    return 0
