"""How long honest workers take to join while another process storms the publisher.

    python -m tools.bench joins storm [--workers 4] [--rounds 3] [--seconds 12] [--only NAME]

Each scenario starts a publisher (tests/helpers/victim.py, publishing every 0.1 s), a
storm (tools/bench/storms.py) against one of its sockets, and then `--workers` real
Subscriber processes (tests/helpers/joiner.py) at once, `--rounds` times; each times its
own join (HELLO to the events subscription and the acks connection) and must then hear
two new versions. A sniffer's time to its first message is measured the same way
(`zmqsync sniff`, from its start, imports included). Prints a JSON line per scenario
and a Markdown table at the end (docs/security.md keeps one).

Everything runs on this host, in a fresh runtime dir and shm dir per scenario.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PY = sys.executable

# name, transport, storm mode (None: undisturbed), target socket
SCENARIOS = [
    ("undisturbed", "ipc", None, "events"),
    ("raw storm on events, ipc", "ipc", "raw", "events"),
    ("raw storm on events, tcp", "tcp", "raw", "events"),
    ("raw storm on events, tcp + CURVE", "tcp-curve", "raw", "events"),
    ("handshaking storm on events, ipc", "ipc", "zmtp", "events"),
    ("handshaking storm on events, tcp", "tcp", "zmtp", "events"),
    ("raw storm on tap, ipc", "ipc", "raw", "tap"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Lines:
    """A child process whose stdout is JSON lines."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT
        )

    def next(self, want: set[str], timeout: float) -> dict[str, object]:
        """The next record whose "event" is in `want` (any record for "*"); a record
        {"event": "none"} if the process ends or `timeout` passes first."""
        end = time.monotonic() + timeout
        out = self.proc.stdout
        assert out is not None
        while time.monotonic() < end:
            if not select.select([out], [], [], max(0.0, end - time.monotonic()))[0]:
                break
            line = out.readline()
            if not line:
                break
            if line.startswith("{"):
                record = json.loads(line)
                if "*" in want or record.get("event") in want:
                    return dict(record)
        return {"event": "none"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _scenario(args: argparse.Namespace, title: str, transport: str, mode: str | None, target: str):
    runtime = tempfile.mkdtemp(prefix="zs", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="zmqsync-storm-", dir="/dev/shm")
    env = {**os.environ, "ZMQSYNC_RUNTIME_DIR": runtime, "ZMQSYNC_SHM_DIR": shm}
    name = f"storm{os.getpid()}"
    extra = [] if transport == "ipc" else ["--address", f"tcp://127.0.0.1:{_free_port()}"]
    extra += ["--curve"] if transport == "tcp-curve" else []
    extra += ["--tap"] if target == "tap" else []
    victim = _Lines(
        [PY, "tests/helpers/victim.py", name, "--interval", "0.1", "--timeout", "2", *extra], env
    )
    procs: list[_Lines] = [victim]
    times: list[float] = []
    failed = 0
    sniffer_first: float | None = None
    storm_summary: dict[str, object] = {}
    try:
        address = str(victim.next({"started"}, 60)["address"])
        endpoint = _endpoint(address, target, name, env)
        storm = None
        if mode is not None:
            seconds = str(args.seconds * args.rounds + 10)
            storm = _Lines([PY, "tools/bench/storms.py", endpoint, "--mode", mode,
                            "--seconds", seconds], env)  # fmt: skip
            procs.append(storm)
            time.sleep(1.0)  # the storm's ramp
        if target == "tap":
            start = time.monotonic()
            sniff = _Lines([PY, "-m", "zmqsync", "sniff", address, "--name", name, "--json",
                            "--count", "3", "--timeout", "10"], env)  # fmt: skip
            procs.append(sniff)
            got = sniff.next({"*"}, 30)
            sniffer_first = time.monotonic() - start if got.get("event") != "none" else None
        for _ in range(args.rounds):
            go = Path(runtime) / f"go-{time.monotonic_ns()}"
            joiners = [
                _Lines(
                    [PY, "tests/helpers/joiner.py", address, "--name", name, "--go", str(go)], env
                )  # fmt: skip
                for _ in range(args.workers)
            ]
            procs.extend(joiners)
            for joiner in joiners:
                joiner.next({"ready"}, 60)
            go.touch()
            for joiner in joiners:
                joined = joiner.next({"joined", "timeout"}, 60)
                heard = joiner.next({"heard", "deaf"}, 30) if joined["event"] == "joined" else {}
                if joined["event"] == "joined" and heard.get("event") == "heard":
                    times.append(float(str(joined["seconds"])))
                else:
                    failed += 1
                joiner.stop()
        if storm is not None:
            storm.stop()
            storm_summary = storm.next({"*"}, 10)
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return {
        "scenario": title,
        "workers": args.workers * args.rounds,
        "got_in": len(times),
        "failed": failed,
        "join_p50_s": round(statistics.median(times), 3) if times else None,
        "join_max_s": round(max(times), 3) if times else None,
        "sniffer_first_s": None if sniffer_first is None else round(sniffer_first, 2),
        "storm_rate": storm_summary.get("rate"),
    }


def _endpoint(address: str, target: str, name: str, env: dict[str, str]) -> str:
    if address.startswith("ipc://"):
        return f"{address}.{target}"
    out = subprocess.run(
        [PY, "-m", "zmqsync", "inspect", address, "--name", name, "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return str(json.loads(out.stdout)[target])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0, help="storm time per round")
    p.add_argument("--only", action="append", help="scenarios whose title contains this")
    args = p.parse_args(argv)
    rows = []
    for title, transport, mode, target in SCENARIOS:
        if args.only and not any(o in title for o in args.only):
            continue
        with contextlib.suppress(KeyboardInterrupt):
            row = _scenario(args, title, transport, mode, target)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| scenario | got in | join p50 | join max | sniffer's first message | storm |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        first = "" if r["sniffer_first_s"] is None else f"{r['sniffer_first_s']} s"
        if r["scenario"].endswith("tap, ipc") and r["sniffer_first_s"] is None:
            first = "none"
        p50 = "-" if r["join_p50_s"] is None else f"{r['join_p50_s']} s"
        mx = "-" if r["join_max_s"] is None else f"{r['join_max_s']} s"
        rate = "" if r["storm_rate"] is None else f"{r['storm_rate']}/s"
        got = f"{r['got_in']}/{r['workers']}"
        print(f"| {r['scenario']} | {got} | {p50} | {mx} | {first} | {rate} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
