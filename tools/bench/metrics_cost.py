"""What a Prometheus scraper costs a publish: publish p50/p99 with and without a scraper
hitting ``zmqsync metrics`` every 100 ms, side by side in one run.

One trainer (this process: a ``Publisher`` over an MLP of ``--size-mb``), ``--workers``
worker processes (``zmqsync worker``), one exporter process (``zmqsync metrics``) and
one scraper process that GETs ``/metrics`` every ``--every`` seconds while it is on.
Each *round* runs both sides, in alternating order, so that a load that drifts on a
shared machine hits both alike:

``quiet``
    the scraper is paused (SIGUSR2), then ``--per-round`` publishes;
``scraped``
    the scraper is on (SIGUSR1), then the same publishes.

Each publish is timed from the call until every worker acked (``Publish.seconds``);
publishes are ``--gap`` seconds apart, so scrapes land between and during them. Every
scrape is an INSPECT answered by the publisher's agent thread: the cost measured is the
trainer's, where a scrape lands.

    .venv/bin/python -m tools.bench metrics                  # 2 workers, 1 MB, 30 rounds
    .venv/bin/python -m tools.bench metrics --workers 4 --size-mb 16 --json /tmp/m.json

Prints a table (p50, p99, mean, the trainer's CPU time per publish, counted over every
thread of the trainer process, the exporter's CPU time, scrapes per second while on)
and the load average at the start and the end; ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scraper(port: int, every: float) -> int:
    """The scraper process: GET /metrics every `every` s while on (SIGUSR1 on, SIGUSR2
    off, SIGTERM ends it); prints how many scrapes it made and how many failed."""
    on, stop = threading.Event(), threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: on.set())
    signal.signal(signal.SIGUSR2, lambda *_: on.clear())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(json.dumps({"ready": True}), flush=True)  # signals are safe to send from now on
    done = failed = 0
    url = f"http://127.0.0.1:{port}/metrics"
    next_at = time.monotonic()
    while not stop.is_set():
        if not on.is_set():
            on.wait(0.05)
            next_at = time.monotonic()
            continue
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                body = reply.read()
            done += 1
            up = [line for line in body.splitlines() if line.startswith(b"zmqsync_up{")]
            failed += not (up and up[0].endswith(b" 1.0"))  # the bus did not answer
        except OSError:
            failed += 1
        next_at += every
        time.sleep(max(0.0, next_at - time.monotonic()))
    print(json.dumps({"scrapes": done, "failed": failed}), flush=True)
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2):
                return
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--size-mb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--gap", type=float, default=0.02, help="seconds between publishes")
    p.add_argument("--every", type=float, default=0.1, help="seconds between scrapes")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--scraper", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scraper is not None:
        return _scraper(args.scraper, args.every)

    import torch

    import zmqsync

    name = f"mcost{uuid.uuid4().hex[:6]}"
    env = dict(os.environ)
    runtime = tempfile.mkdtemp(prefix="zsm", dir="/tmp")
    env.setdefault("ZMQSYNC_RUNTIME_DIR", runtime)
    os.environ["ZMQSYNC_RUNTIME_DIR"] = env["ZMQSYNC_RUNTIME_DIR"]
    width = max(1, int((args.size_mb * 2**20 / 4 / 4) ** 0.5))  # four square layers
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    procs: list[subprocess.Popen[str]] = []
    samples: dict[str, list[float]] = {"quiet": [], "scraped": []}
    # CPU seconds per side: the trainer's (every thread: its agent answers the scrapes'
    # INSPECTs) and the exporter's
    cpu = {side: {"trainer": 0.0, "exporter": 0.0} for side in samples}
    load_start = os.getloadavg()
    cli = [sys.executable, "-m", "zmqsync"]
    try:
        with zmqsync.Publisher(model, name=name, timeout=30.0) as pub:
            for _ in range(args.workers):
                procs.append(
                    subprocess.Popen(
                        [*cli, "worker", "--name", name, "--forever"],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                )
            if not pub.wait_for_workers(args.workers, timeout=600):
                raise SystemExit("the workers did not join within 600 s")
            port = _free_port()
            exporter = subprocess.Popen(
                [*cli, "metrics", "--name", name, "--port", str(port)],
                env=env,
                stdout=subprocess.DEVNULL,
                text=True,
            )
            procs.append(exporter)
            _wait_http(port, 120)
            scraper = subprocess.Popen(
                [sys.executable, __file__, "--scraper", str(port), "--every", str(args.every)],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            procs.append(scraper)
            assert scraper.stdout is not None and json.loads(scraper.stdout.readline())["ready"]
            for _ in range(5):  # warm-up, not counted
                pub.publish()
            on_seconds = 0.0
            for r in range(args.rounds):
                sides = ("quiet", "scraped") if r % 2 == 0 else ("scraped", "quiet")
                for side in sides:
                    scraper.send_signal(signal.SIGUSR1 if side == "scraped" else signal.SIGUSR2)
                    time.sleep(0.15)  # a scrape or two in flight before the first publish
                    began = time.monotonic()
                    trainer0, exporter0 = time.process_time(), _cpu_s(exporter.pid)
                    for _ in range(args.per_round):
                        samples[side].append(pub.publish().seconds)
                        time.sleep(args.gap)
                    cpu[side]["trainer"] += time.process_time() - trainer0
                    cpu[side]["exporter"] += _cpu_s(exporter.pid) - exporter0
                    if side == "scraped":
                        on_seconds += time.monotonic() - began + 0.15
            scraper.send_signal(signal.SIGUSR2)
            scraper.send_signal(signal.SIGTERM)
            out, _ = scraper.communicate(timeout=30)
            scrapes = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
        with contextlib.suppress(OSError):
            os.rmdir(runtime)
    load_end = os.getloadavg()
    rate = scrapes["scrapes"] / on_seconds if on_seconds else 0.0
    print(
        f"publish of {args.size_mb:g} MB to {args.workers} workers, {args.rounds} rounds of "
        f"{args.per_round} per side, interleaved; scraper every {args.every * 1e3:.0f} ms"
    )
    print(
        "| side | publishes | p50 | p99 | mean | trainer CPU per publish | exporter CPU "
        "| scrapes/s while on |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for side, values in samples.items():
        ms = [v * 1e3 for v in values]
        scraped = f"{rate:.1f} ({scrapes['failed']} up 0)" if side == "scraped" else "-"
        per_publish = cpu[side]["trainer"] / len(ms) * 1e3
        print(
            f"| {side} | {len(ms)} | {_pct(ms, 0.5):.3f} ms | {_pct(ms, 0.99):.3f} ms | "
            f"{statistics.fmean(ms):.3f} ms | {per_publish:.3f} ms | "
            f"{cpu[side]['exporter']:.2f} s | {scraped} |"
        )
    extra = cpu["scraped"]["trainer"] - cpu["quiet"]["trainer"]
    if scrapes["scrapes"]:
        print(
            f"the trainer's CPU with the scraper on: {extra * 1e3:+.0f} ms over "
            f"{scrapes['scrapes']} scrapes ({extra / scrapes['scrapes'] * 1e3:+.3f} ms per scrape)"
        )
    print(f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end")
    if args.json:
        record = {"args": vars(args), "samples": samples, "cpu_s": cpu, "scrapes": scrapes}
        Path(args.json).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
