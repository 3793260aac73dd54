"""How long an honest worker takes to join a bus, undisturbed and while a peer storms it.

A bus is a trainer process (a ``Publisher`` over four ``nn.Linear(16, 16)``) with its
own N worker processes that have imported torch and zmqsync and wait for a ``join``
line. A round asks every worker to ``Subscriber(...).start()`` at once, then publishes
one version to see that every joined worker also hears the bus (a worker that joined
but never gets a RECEIVE is "deaf"), then every worker closes. Two checkouts side by
side are the runner's (``python -m tools.bench sides --base REF --head REF joins cost``):
it alternates whole runs of this.

A storm runs in its own process, bounded in time, against the side's bus on this host
only (ipc:// or 127.0.0.1), from a little before the joins until the round's publish:

``none``      nothing: the undisturbed join.
``events``    connect() + close() in a loop on the events socket (storms.py).
``zmtp``      the same, each connection greeted as a SUB up to the publisher's answer, so
              that every one reaches the handshake (storms.py ``--mode zmtp``).
``tap``       connect() + close() on the tap socket (the trainer opens one).
``hello``     a real worker holds the id ``storm-held``; then the HELLO storm of
              storms.py for that id: 4 DEALER connections, 16 HELLOs in flight on each.
``curve``     the trainer binds ``tcp://127.0.0.1`` with ``curve=True``; the storm
              connects to its events port without keys, in a loop. Workers use the keys.
``burn``      K CPU-bound processes (``--burn K``, default 2 per core) while joining.

``--model many`` joins a model of 2,000 vectors of 512 floats held by one module (a
``ParameterList``, as the bench's 2,000-tensor model), ``--mode alias`` and ``--flat``
as the bench runs it (a flat publisher; copy workers keep one block).

    .venv/bin/python -m tools.bench joins cost --workers 4 --rounds 5 --storms none events hello
    .venv/bin/python -m tools.bench joins cost --model many --mode alias --flat --workers 4

Prints per storm: joins in time, the join's p50 and max in seconds, deaf
workers, and the round's publish; ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
sys.path.insert(0, str(HERE.parents[1]))  # tools/bench: its role processes run this by path
from roles import die_with_parent as _die_with_parent  # noqa: E402
from roles import say as _say  # noqa: E402
from roles import subscriber  # noqa: E402

READY_S = 600.0  # N workers importing torch on a loaded 2-core machine take a while
JOIN_S = 30.0  # a worker's start() timeout: past it the join counts as failed
PUBLISH_S = 10.0
STORM_LEAD_S = 1.0  # the storm runs this long before the joins start
HELD_ID = "storm-held"
CONNECT_STORM = HERE.parents[1] / "storms.py"
_CONNECTS = ("events", "zmtp", "tap", "curve")


MANY_TENSORS = 2000


def _model(kind: str = "mlp") -> Any:
    import torch
    from torch import nn

    if kind == "many":
        return nn.ParameterList(nn.Parameter(torch.randn(512)) for _ in range(MANY_TENSORS))
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- roles (subprocesses) ---------------------------------------------------------------


def trainer(name: str, storm: str, kind: str, flat: bool) -> int:
    """A Publisher that answers ``count`` (workers on the bus) and ``publish`` lines."""
    import zmqsync

    _die_with_parent()
    address = f"tcp://127.0.0.1:{_free_port()}" if storm == "curve" else None
    pub = zmqsync.Publisher(
        _model(kind),
        address,
        name=name,
        security=zmqsync.Security(curve=True if storm == "curve" else None, tap=storm == "tap"),
        writes=zmqsync.Copy(flat=flat),
    ).start()
    from zmqsync._cli.buses import inspect_bus  # the endpoints, as `zmqsync inspect` reads them

    state = inspect_bus(pub.address, 10.0, name)
    _say(event="ready", address=pub.address, events=state.events, tap=state.tap)
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "count":
                _say(workers=len(pub.workers))
            elif cmd == "publish":
                t0 = time.perf_counter()
                p = pub.publish(max_lag=None)
                p.wait(timeout=PUBLISH_S)
                _say(
                    seconds=time.perf_counter() - t0,
                    targets=len(p.targets),
                    acked=len([w for w in p.acked if w != HELD_ID]),
                )
            elif cmd == "quit":
                break
    finally:
        pub.close()
    return 0


def worker(address: str, name: str, kind: str, mode: str, flat: bool) -> int:
    """Imports everything first; then one Subscriber per ``join`` line, closed on
    ``leave``. Reports how long start() took (or why it failed)."""
    _die_with_parent()
    model = _model(kind)
    _say(event="ready")
    sub = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "join":
            t0 = time.perf_counter()
            try:
                sub = subscriber(address, model, name=name, mode=mode, flat=flat, timeout=JOIN_S)
                sub.start()
                _say(joined=time.perf_counter() - t0)
            except Exception as exc:  # a failed join is a sample too
                _say(failed=f"{type(exc).__name__}: {exc}"[:200], after=time.perf_counter() - t0)
                sub = None
        elif cmd == "leave":
            if sub is not None:
                sub.close()
                sub = None
            _say(left=True)
        elif cmd == "quit":
            break
    if sub is not None:
        sub.close()
    return 0


def _storm_hello(address: str, name: str, until: float) -> int:
    """Hold `HELD_ID` with a real worker, then the HELLO storm of storms.py for that id."""
    from storms import MAX_CONNECTIONS, MAX_HELLOS, MAX_WINDOW, hello_storm

    held = subscriber(address, _model(), name=name, worker_id=HELD_ID).start()
    try:
        report = hello_storm(
            address,
            [HELD_ID],
            seconds=max(until - time.monotonic(), 0.0),
            max_hellos=MAX_HELLOS,
            connections=min(4, MAX_CONNECTIONS),
            window=MAX_WINDOW,
        )
    finally:
        held.close()
    return int(report["sent"])  # type: ignore[call-overload]


def _burn(until: float) -> int:
    x = 0
    while time.monotonic() < until:
        for _ in range(100_000):
            x += 1
    return x


def storm(kind: str, target: str, name: str, seconds: float) -> int:
    """One storm process: says ``storming`` once it runs, ``stormed`` with its count."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    until = time.monotonic() + seconds
    count = 0
    if kind == "hello":
        count = _storm_hello(target, name, until)
    elif kind == "burn":
        _say(event="storming")
        count = _burn(until)
    _say(stormed=count)
    return 0


# --- orchestrator -----------------------------------------------------------------------


class _Proc:
    """A role subprocess driven by lines on stdin, answering JSON lines on stdout."""

    def __init__(self, args: list[str], env: dict[str, str], script: bool = True) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *([str(HERE)] if script else []), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd="/tmp",  # so that PYTHONPATH decides which zmqsync is imported
            text=True,
        )
        self.lines: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: IO[str]) -> None:
        for line in out:
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # two threads' lines run together: not ours
                    continue
                with self._cond:
                    self.lines.append(record)
                    self._cond.notify_all()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def next(self, timeout: float) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self._cond:
            while not self.lines:
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise SystemExit(f"no answer from {self.proc.args[2:4]} in {timeout:.0f} s")
                self._cond.wait(min(left, 0.5))
            return self.lines.pop(0)

    def close(self) -> None:
        self.send("quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Bus:
    """A trainer process and its N workers, driven one round at a time."""

    def __init__(
        self,
        storm: str,
        n: int,
        env: dict[str, str],
        model: tuple[str, str, bool] = ("mlp", "copy", False),
    ) -> None:
        self.storm = storm
        self.env = dict(env, PYTHONPATH=str(ROOT))
        self.name = f"jc{uuid.uuid4().hex[:8]}"
        kind, mode, flat = model
        self.trainer = _Proc(["_trainer", self.name, storm, kind, str(int(flat))], self.env)
        ready = self.trainer.next(READY_S)
        self.address, self.events, self.tap = ready["address"], ready["events"], ready["tap"]
        role = ["_worker", self.address, self.name, kind, mode, str(int(flat))]
        self.workers = [_Proc(role, self.env) for _ in range(n)]
        for w in self.workers:
            w.next(READY_S)

    def _target(self) -> str:
        if self.storm in ("events", "zmtp", "curve"):
            return str(self.events)
        return str(self.tap) if self.storm == "tap" else self.address

    def round(self, seconds: float, burn: int) -> dict[str, Any]:
        storms: list[_Proc] = []
        sniff = {"sniff_quiet": self._sniff()} if self.storm == "tap" else {}
        if self.storm in _CONNECTS:  # no zmqsync in it: the same storm for every side
            mode = "zmtp" if self.storm == "zmtp" else "raw"
            cmd = [str(CONNECT_STORM), self._target(), "--mode", mode, "--seconds", str(seconds)]
            storms.append(_Proc(cmd, self.env, script=False))
            time.sleep(STORM_LEAD_S)
        elif self.storm != "none":
            kinds = ["burn"] * burn if self.storm == "burn" else [self.storm]
            for kind in kinds:
                role = ["_storm", kind, self._target(), self.name, str(seconds)]
                storms.append(_Proc(role, self.env))
            for s in storms:
                s.next(60.0)  # storming
            time.sleep(STORM_LEAD_S if self.storm != "hello" else STORM_LEAD_S + 2.0)
        if self.storm == "tap":
            sniff["sniff_storm"] = self._sniff()
        for w in self.workers:
            w.send("join")
        joins = [w.next(JOIN_S + 30.0) for w in self.workers]
        self.trainer.send("publish")
        publish = self.trainer.next(PUBLISH_S + 30.0)
        for s in storms:
            s.proc.terminate()
        for s in storms:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(10)
        for w in self.workers:
            w.send("leave")
        for w in self.workers:
            w.next(30.0)
        end = time.monotonic() + 30.0
        while time.monotonic() < end:  # the next round starts with an empty bus
            self.trainer.send("count")
            if self.trainer.next(10.0)["workers"] == 0:
                break
            time.sleep(0.2)
        joined = [j["joined"] for j in joins if "joined" in j]
        failed = [j["failed"] for j in joins if "failed" in j]
        return {
            "joined": joined,
            "failed": failed,
            "deaf": len(joined) - publish["acked"],
            "publish": publish["seconds"],
            **sniff,
        }

    def _sniff(self) -> float | None:
        """Seconds until `zmqsync sniff --count 1` has seen a message (None: not in time)."""
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "zmqsync", "sniff", self.address, "--count", "1"]
        try:
            subprocess.run(cmd, env=self.env, cwd="/tmp", capture_output=True, timeout=JOIN_S)
        except subprocess.TimeoutExpired:
            return None
        return time.perf_counter() - t0

    def close(self) -> None:
        for p in [*self.workers, self.trainer]:
            p.close()


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    roles = {
        "_trainer": lambda a: trainer(a[0], a[1], a[2], a[3] == "1"),
        "_worker": lambda a: worker(a[0], a[1], a[2], a[3], a[4] == "1"),
        "_storm": lambda a: storm(a[0], a[1], a[2], float(a[3])),
    }
    if argv and argv[0] in roles:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator ends us
        return int(roles[argv[0]](argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--storms", nargs="+", default=["none"], help="none events zmtp tap hello curve burn"
    )
    parser.add_argument("--burn", type=int, default=2 * (os.cpu_count() or 1))
    parser.add_argument("--storm-seconds", type=float, default=JOIN_S + 20.0)
    parser.add_argument("--model", choices=("mlp", "many"), default="mlp")
    parser.add_argument("--mode", choices=("copy", "alias"), default="copy")
    parser.add_argument("--flat", action="store_true", help="a flat publisher and workers")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    model = (args.model, args.mode, args.flat)
    if args.model != "mlp" and "hello" in args.storms:
        parser.error("the hello storm's held worker has the small model: use --model mlp")
    runtime = tempfile.mkdtemp(prefix="zjc", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="zmqsync-jc-", dir="/dev/shm")
    env = dict(os.environ, ZMQSYNC_RUNTIME_DIR=runtime, ZMQSYNC_SHM_DIR=shm)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for storm_kind in args.storms:
            bus = Bus(storm_kind, args.workers, env, model)
            try:
                for _ in range(args.rounds):
                    sample = bus.round(args.storm_seconds, args.burn)
                    results.setdefault(storm_kind, []).append(sample)
            finally:
                bus.close()
            report(storm_kind, results.get(storm_kind, []), args.workers)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "results": results}, default=str))
    return 0


def report(storm_kind: str, samples: list[dict[str, Any]], n: int) -> None:
    print(f"\nstorm: {storm_kind}; load now {os.getloadavg()[0]:.1f}")
    print(f"  {'joined':>9} {'p50 s':>8} {'max s':>8} {'deaf':>5} {'publish p50 s':>14}")
    joined = [t for s in samples for t in s["joined"]]
    deaf = sum(s["deaf"] for s in samples)
    pub = _p([s["publish"] for s in samples], 0.5)
    print(
        f"  {len(joined):>4}/{n * len(samples):<4} {_p(joined, 0.5):8.3f} "
        f"{max(joined, default=float('nan')):8.3f} {deaf:>5} {pub:14.3f}"
    )
    for key in ("sniff_quiet", "sniff_storm"):
        got = [s[key] for s in samples if key in s]
        if got:
            seen = [t for t in got if t is not None]
            print(
                f"    {key}: {len(seen)}/{len(got)} saw a message, p50 "
                f"{_p(seen, 0.5):.3f} s, max {max(seen, default=float('nan')):.3f} s"
            )
    for reason in sorted({f for s in samples for f in s["failed"]})[:3]:
        print(f"    failed: {reason}")


if __name__ == "__main__":
    sys.exit(main())
