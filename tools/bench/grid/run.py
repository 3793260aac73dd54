"""The run: one benchmark from start to end, and the phases it is made of.

`Run` owns everything a run creates: a runtime dir under /tmp, a shm dir under
/dev/shm, the worker pool, a ZeroMQ context, the publisher of the phase in progress and
the torchrl subprocess; `close()` ends and removes all of it, also after Ctrl-C or an
error. `run_bench` walks the grid: for each N, the pool grows to N workers, then every
size is measured (each zmqsync mode interleaved with its floors, then the naive
baseline), then torchrl; the late join comes last. A phase that fails is recorded in its
row and the run goes on; sources edited during the run abort it (`SourceChanged`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import FLAT_KINDS, ROOT, SIZES, SLOTS, BenchConfig, BenchError, Size, SourceChanged
from .fanout import Echoes, Fanout
from .machine import available_memory, describe_machine, meminfo, torchrl_available
from .plan import Stopwatch, iterations, padded_bytes, skip_reason, total_steps
from .pool import Pool, Worker
from .report import write_results
from .results import Results, Row, p50, p99
from .torchrl_baseline import TorchrlBaseline
from .units import GiB, gib, ms, times

if TYPE_CHECKING:
    import torch
    import zmq

    from zmqsync._publisher import Publisher

log = logging.getLogger(__name__)


def _data(mem: dict[str, int]) -> int:
    """PSS of a worker's data: anonymous + shared memory (file-backed code excluded)."""
    return mem.get("pss_anon", 0) + mem.get("pss_shmem", 0)


def _record(
    row: Row,
    samples: dict[str, list[float]],
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
) -> None:
    """A zmqsync phase's samples and the workers' memory before and after it, on `row`."""
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


class Run:
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
        from .worker import source_digest

        self.source = source_digest()
        self.pool = Pool(env, self.log_dir, cfg.timeout, self.source)
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.echoes = Echoes(self.ctx, self.runtime, env)  # the raw floor's processes
        self.torchrl = TorchrlBaseline(cfg, results, env, self.log_dir)
        self.publisher: Publisher | None = None  # the phase's; closed with the run if open
        self.phase = 0
        self.progress: Any = None  # rich's Progress and its task, set by run_bench
        self.task: Any = None

    def close(self) -> None:
        """End every process and remove every file of the run."""
        if self.publisher is not None:
            with contextlib.suppress(Exception):
                self.publisher.close()
            self.publisher = None
        self.torchrl.close()
        self.pool.close()
        self.echoes.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.shm, ignore_errors=True)
        shutil.rmtree(self.runtime, ignore_errors=True)

    # --- helpers ---

    def name(self) -> str:
        """A fresh bus name: no phase can reach a socket or segment of an earlier one."""
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
        from zmqsync._publisher import Publisher
        from zmqsync._writes import Copy

        from .worker import make_model, storage_bytes

        cfg, pool, n, timeout = self.cfg, self.pool, row.n, self.cfg.timeout
        s = padded_bytes(size)
        volume = (n + 1) * s * (2 if row.mode == "copy" else 1) + 2 * s
        iters, warmup = iterations(cfg, size, volume)
        trainer, tflat = make_model(size.kind, size.target, fill=True, grad=True)
        row.tensors = len(list(trainer.parameters()))
        row.nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
        _, dst = self.shm_file("dst", tflat.numel())
        floor_src = ""
        if row.mode == "copy":  # the copy workers' floor reads the trainer's bytes in a file
            floor_src, src = self.shm_file("src", tflat.numel())
            src.copy_(tflat)
            del src
        before = pool.call(n, {"cmd": "mem", "under": self.segment_prefix})
        pool.call(n, {"cmd": "model", "kind": size.kind, "nbytes": size.target})
        if row.mode == "copy":  # the N+1-copies floor: a thread in each worker copies on "go"
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
            trainer,
            self.address(name),
            name=name,
            slots=SLOTS,
            timeout=timeout,
            shm_dir=self.shm,
            writes=Copy(flat=True),  # see FLAT_KINDS
        )
        pub.start()
        # The memcpy floors read the trainer's bytes where its tensors are: in the
        # segment's home slot, which moves at each publish; a view of their storage
        # object follows it. Their first buffer goes.
        memcpy_src = storage_bytes(next(iter(trainer.parameters())))[: tflat.numel()]
        del trainer, tflat
        row.segment_bytes = self.segment_bytes()
        row.segment_slots = SLOTS + 1
        joins = pool.call(
            n,
            {
                "cmd": "join",
                "address": pub.address,
                "name": name,
                "mode": row.mode,
                "flat": size.kind in FLAT_KINDS,
                "timeout": timeout,
                "shm_dir": self.shm,
            },
        )
        row.join_p50 = p50([j["seconds"] for j in joins])
        if not pub.wait_for_workers(n, timeout=timeout):
            raise BenchError(f"only {len(pub.workers)} of {n} workers joined in time")
        samples = self._interleave(row, pub, fan, (memcpy_src, dst), iters, warmup)
        pool.call(n, {"cmd": "unrespond"})  # unmaps the floor buffer
        pool.call(n, {"cmd": "touch"})
        after = pool.call(n, {"cmd": "mem", "under": self.segment_prefix})
        pool.call(n, {"cmd": "leave"})
        pub.close()
        self.publisher = None
        _record(row, samples, before, after)

    def _interleave(
        self,
        row: Row,
        pub: Publisher,
        fan: Fanout,
        copy: tuple[torch.Tensor, torch.Tensor],
        iters: int,
        warmup: int,
    ) -> dict[str, list[float]]:
        """Timed publishes, each next to one sample of every floor; the samples by name.

        `copy` is (source, destination) of the memcpy floor: a view of the trainer's
        bytes (its tensors' storage) and a file in the run's shm dir.

        In copy mode the samples of the memcpy on torch's threads come after the timed
        loop, as many: torch's OpenMP threads spin for ~8 ms after a copy on them (here),
        so a sample inside the loop left a third busy thread in the trainer through the
        next raw round, N+1-copies round and publish. On two cores, which of those
        threads shared a core with it decided the round, and the draw held for hundreds
        of milliseconds: the publish of a 4 MB model to one copy worker moved between
        ~0.5 and ~1.5 ms within one point while the floor beside it did not. Its floor
        is the N+1 copies; the memcpy samples are only reported there. In alias mode
        they are the floor and stay beside each publish.
        """
        import torch

        n, timeout = row.n, self.cfg.timeout
        tflat, dst = copy
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

        stop = Stopwatch(self.cfg, warmup)
        for i in range(warmup + iters):
            if stop.enough(i):
                break
            # raw first (processes of its own: see `Echoes`), after the last publish; the
            # copies round (the workers' responder threads) next, then the publish.
            got: dict[str, float] = {"raw": self.echoes.round(n, timeout)}
            if row.mode == "copy":
                got["copyn"] = fan.round(b"copy", n, timeout, local=lambda: memcpy(1))
            t = time.perf_counter()
            handle = pub.publish()
            got["zmqsync"] = time.perf_counter() - t
            got["lib"] = handle.seconds
            got["memcpy1"] = memcpy(1)
            if row.mode != "copy":
                got["memcpyd"] = memcpy(default_threads)
            if i >= warmup:
                for k, v in got.items():
                    samples[k].append(v)
        if row.mode == "copy":
            samples["memcpyd"] = [memcpy(default_threads) for _ in samples["zmqsync"]]
        return samples

    def naive_phase(self, rows: list[Row], size: Size, fan: Fanout) -> None:
        """A pickled state_dict on a PUB socket; each worker unpickles, loads, acks."""
        import pickle

        from .worker import make_plain_model

        n, timeout = rows[0].n, self.cfg.timeout
        s = padded_bytes(size)
        iters, _ = iterations(self.cfg, size, 3 * (n + 1) * s)
        warmup = 1
        stop_cfg = dataclasses.replace(self.cfg, min_iters=min(3, self.cfg.min_iters))
        trainer = make_plain_model(size.kind, size.target)
        self.pool.call(n, {"cmd": "model", "kind": size.kind, "nbytes": size.target})
        self.pool.call(n, {"cmd": "respond", "events": fan.events, "acks": fan.acks})
        fan.connected(n, timeout)
        lat: list[float] = []
        stop = Stopwatch(stop_cfg, warmup)
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
        s = padded_bytes(size)
        rows = []
        for mode in cfg.modes:
            row = Row(n=n, size=size.key, label=size.label, mode=mode)
            row.status = skip_reason(cfg, mode, n, s, available_memory()) or "ok"
            results.rows.append(row)
            rows.append(row)
        naive_skip = (
            skip_reason(cfg, "naive", n, s, available_memory())
            if cfg.naive
            else "skipped: --no-naive"
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
            self._job(rows, size, what, job)
        for row in rows:
            self.report_row(row)

    def _job(self, rows: list[Row], size: Size, what: str, job: Callable[[Fanout], None]) -> None:
        """One phase (`what`: a mode or "naive") on a fresh Fanout; a failure goes in the
        rows' status and the run goes on, with the pool reset and the floor files gone."""
        n = rows[0].n
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

    # --- torchrl ---

    def torchrl_for(self, n: int) -> None:
        """torchrl's SharedMemWeightSyncScheme with n receivers, in a killable subprocess."""
        # the pool's workers keep the last size's model (an LLM-shaped one is 1.1 GB each)
        # and torchrl's receivers make theirs: drop the pool's first (the OOM killer ended
        # a full run's harness here, at 4 workers, before that)
        self.pool.reset(n)
        points = self.torchrl.plan(n)
        if not points:
            return
        self.progress_note(f"N={n} torchrl")
        self.torchrl.measure(n, points)
        self.advance()

    # --- late join ---

    def late_join(self, key: str) -> None:
        """A new worker's Subscriber(...).start() against a model of `key` (alias, copy)."""
        from zmqsync._publisher import Publisher

        from .worker import make_model

        size, timeout = SIZES[key], self.cfg.timeout
        s = padded_bytes(size)
        out: dict[str, Any] = {"size": key, "label": size.label}
        if 4 * s > self.cfg.mem_budget:
            out["status"] = f"skipped: needs {gib(4 * s)}"
            self.results.late_join = out
            self.advance()
            return
        self.progress_note(f"late join {size.label}")
        self.pool.grow(max(1, len(self.pool.workers)))
        trainer, _ = make_model(size.kind, size.target, fill=True, grad=True)
        out["nbytes"] = sum(p.numel() * p.element_size() for p in trainer.parameters())
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
                    join = {"address": pub.address, "name": name, "mode": mode}
                    secs.append(self._join_once(self.pool.workers[r % workers], size, join))
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

    def _join_once(self, w: Worker, size: Size, join: dict[str, Any]) -> float:
        """Worker `w` builds a model of `size`, joins the bus, drops it; the join's seconds."""
        timeout = self.cfg.timeout
        cmd = {"cmd": "model", "kind": size.kind, "nbytes": size.target}
        w.wait(w.send(cmd), time.monotonic() + timeout)
        cmd = {"cmd": "join", **join, "timeout": timeout, "shm_dir": self.shm}
        reply = w.wait(w.send(cmd), time.monotonic() + timeout)
        w.wait(w.send({"cmd": "drop"}), time.monotonic() + timeout)
        seconds: float = reply["seconds"]
        return seconds

    # --- progress ---

    def progress_note(self, what: str) -> None:
        """Say on the progress bar what is being measured now."""
        if self.progress is not None:
            self.progress.update(self.task, description=what)

    def advance(self, steps: int = 1) -> None:
        """Count `steps` phases done (or skipped) on the progress bar."""
        if self.progress is not None and steps > 0:
            self.progress.advance(self.task, steps)

    def report_row(self, row: Row) -> None:
        """One line per finished row, so a long run shows its numbers as it goes."""
        if self.console is None:
            return
        if row.status != "ok":
            self.console.print(f"  N={row.n:<3} {row.label:<20} {row.mode:<5} [dim]{row.status}[/]")
            return
        r = row.ratios()
        self.console.print(
            f"  N={row.n:<3} {row.label:<20} {row.mode:<5} p50 {ms(row.zmqsync_p50)}  "
            f"raw {ms(row.raw_p50)} ({times(r['x_raw'])})  floor {times(r['x_floor'])}"
        )


def run_bench(cfg: BenchConfig, console: Any = None, command: str = "") -> Results:
    """Run the grid of `cfg`; always ends every process and removes every file it made.

    Returns the results (partial, with ``interrupted`` set, if Ctrl-C stopped it: then
    KeyboardInterrupt is raised again after the files are written).
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not cfg.mem_budget:
        avail = meminfo().get("MemAvailable", 8 * GiB)
        cfg = dataclasses.replace(cfg, mem_budget=min(14 * GiB, int(avail * 0.6)))
    if cfg.torchrl and (why := torchrl_available()):
        if console is not None:
            console.print(f"[yellow]torchrl baseline off[/]: {why}")
        cfg = dataclasses.replace(cfg, torchrl=False)
    conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    results = Results(config=conf, machine=describe_machine())
    from zmqsync._publisher import Publisher  # noqa: F401 - the code the digest describes

    from .worker import source_digest

    results.machine["source_digest"] = source_digest()
    # what "raw rt" was measured against (runs before this note: the pool's own threads)
    results.machine["raw_floor"] = "N plain pyzmq processes, one 8-byte frame each"
    results.command = command
    run = Run(cfg, results, console)
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
            run.progress, run.task = pr, pr.add_task("starting workers", total=total_steps(cfg))
            run.console = pr.console if console is not None else None
            for n in sorted(cfg.workers):
                run.progress_note(f"starting {n} workers")
                started = run.pool.grow(n)
                run.echoes.grow(n, cfg.timeout)
                results.machine.setdefault("pool_start_s", {})[str(n)] = started
                for key in cfg.sizes:
                    run.point(n, SIZES[key])
                if cfg.torchrl and n <= cfg.torchrl_max_workers:
                    run.torchrl_for(n)
                # what is measured so far, on disk: a run killed later (the OOM killer,
                # a lost terminal) keeps every worker count it finished
                results.seconds = time.perf_counter() - t0
                write_results(results, cfg.out)
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
