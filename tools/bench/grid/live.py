"""Live publishes next to torchrl's collector path: a round trip, not a copy.

torchrl's collector path (``TorchrlBaseline``'s "collector" points) shares the trained
module's own tensors with its workers; ``send()`` only tells them to re-read. zmqsync's
counterpart is ``Publisher(live=True)``: the trainer's tensors are moved into the
segment, N alias subscribers map them, and a publish announces a version and collects
the acks. This module times that publish at the same sizes and N, with receivers
started the way the torchrl baseline starts its own (same start method), in a
subprocess of its own (``python -m tools.bench.grid.live SPEC``) killed on a deadline.

Results go into each row's ``samples["zmqsync_live"]`` and into the torchrl run's summary
(``results.torchrl_runs[i]["live"]``: p50/p99 per size), beside torchrl's numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .config import ROOT, BenchConfig
from .results import Results, p50, p99

__all__ = ["measure_live"]


def measure_live(
    cfg: BenchConfig,
    results: Results,
    n: int,
    points: list[dict[str, Any]],
    env: dict[str, str],
    log_path: Path,
) -> dict[str, Any]:
    """Time live publishes to `n` alias workers at each collector point's size.

    Returns the summary (also stored on the rows, see the module doc): per size key,
    ``{"p50", "p99", "iters"}`` in seconds, or ``{"error": ...}``.
    """
    sizes = [p for p in points if p["variant"] == "collector"]
    summary: dict[str, Any] = {}
    if not sizes:
        return summary
    spec = {"workers": n, "points": sizes, "start_method": cfg.torchrl_start_method}
    spec["connect_timeout"] = cfg.timeout
    deadline = time.monotonic() + 120.0 + len(sizes) * (cfg.timeout + 4 * cfg.phase_seconds)
    with open(log_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.bench.grid.live", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out = ""
            summary["status"] = "killed: past its deadline"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if proc.returncode != 0:  # e.g. killed for memory: the sizes it did not report say so
        summary.setdefault("status", f"exited {proc.returncode}")
    for line in out.splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("event") != "point":
            continue
        if "error" in rec:
            summary[rec["key"]] = {"error": rec["error"]}
            continue
        lat = rec["lat"]
        summary[rec["key"]] = {"p50": p50(lat), "p99": p99(lat), "iters": len(lat)}
        for row in results.rows:
            if row.n == n and row.size == rec["key"]:
                row.samples["zmqsync_live"] = list(lat)
    for point in sizes:
        summary.setdefault(point["key"], {"error": summary.get("status", "no result")})
    return summary


def _receiver(name: str, timeout: float, ready: Any, stop: Any) -> None:
    """One alias worker of the live bus: joins, then acks every version until told."""
    from ..roles import subscriber
    from .worker import _die_with_parent

    _die_with_parent()
    try:
        sub = subscriber(name=name, mode="alias", timeout=timeout).start()
    except Exception as exc:  # reported to the sender, which ends the point
        ready.put(f"{type(exc).__name__}: {exc}")
        return
    ready.put("")
    stop.wait()
    sub.close()


def main(argv: list[str]) -> int:
    """Sender side: per point, a live publisher, n alias workers, timed publishes."""
    import multiprocessing as mp
    import secrets

    from zmqsync._publisher import Publisher
    from zmqsync._writes import Live

    from .worker import _die_with_parent, _trim, make_model

    _die_with_parent()
    spec = json.loads(argv[0])
    n, timeout = int(spec["workers"]), float(spec["connect_timeout"])
    ctx = mp.get_context(spec.get("start_method") or "forkserver")

    def emit(**record: Any) -> None:
        print(json.dumps(record), flush=True)

    for point in spec["points"]:
        trainer, _ = make_model(point["kind"], point["nbytes"], fill=True, grad=True)
        name = f"bench-live-{secrets.token_hex(4)}"
        ready, stop = ctx.Queue(), ctx.Event()
        procs = []
        try:
            # heartbeat: torchrl's receivers have none to miss; a loaded host can stall an
            # alias worker mapping a big segment for seconds without it being dead
            live = Live()
            with Publisher(trainer, name=name, writes=live, timeout=timeout, heartbeat=2.0) as pub:
                procs = [
                    ctx.Process(target=_receiver, args=(name, timeout, ready, stop), daemon=True)
                    for _ in range(n)
                ]
                for proc in procs:
                    proc.start()
                for _ in range(n):
                    error = ready.get(timeout=timeout)
                    if error:
                        raise RuntimeError(f"a live receiver failed: {error}")
                if not pub.wait_for_workers(n, timeout=timeout):
                    raise RuntimeError(f"only {len(pub.workers)} of {n} workers joined")
                emit(event="point", key=point["key"], lat=_timed(pub, point))
        except (RuntimeError, OSError, queue.Empty) as exc:
            emit(event="point", key=point["key"], error=f"{type(exc).__name__}: {exc}")
        finally:
            stop.set()
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            del trainer
            _trim()
    emit(event="done")
    return 0


def _timed(pub: Any, point: dict[str, Any]) -> list[float]:
    """Seconds of each ``publish()`` (announce, every ack), as the torchrl points count."""
    lat: list[float] = []
    begin = time.perf_counter()
    for i in range(point["warmup"] + point["iters"]):
        samples, spent = i - point["warmup"], time.perf_counter() - begin
        if samples >= point["min_iters"] and spent > point["max_seconds"]:
            break
        t = time.perf_counter()
        pub.publish()
        if i >= point["warmup"]:
            lat.append(time.perf_counter() - t)
    return lat


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
