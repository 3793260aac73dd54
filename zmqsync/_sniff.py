"""The bus sniffer behind `zmqsync sniff`: reads the publisher's tap, never writes to the bus.

It asks the publisher once (INSPECT) where the tap is and who is on the bus, then only
listens. Every frame is decoded by `zmqsync._protocol.decode` (there is no second
parser, and nothing is ever unpickled). Without a tap it falls back to the events
socket: it then sees what the publisher broadcasts (RECEIVE, STOP, HEARTBEAT) but no
acks.

Everything in a record but its type and direction comes from a peer: `to_line` and
`Summary.line` escape it (`printable`) for the terminal, `to_line` also for rich markup.

Recordings (`--record`) hold the tap frames as they arrived, each prefixed by its
length (4 bytes, big-endian), so `--replay` runs exactly the same decoding again.
"""

from __future__ import annotations

import datetime
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import zmq

from ._deadline import Deadline
from ._errors import ProtocolError
from ._protocol import (
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Receive,
    State,
    Stop,
    Tap,
    Welcome,
    decode,
    encode,
    to_plain,
)
from ._registry import lag
from ._security import client_from_env
from ._sockets import connect, resolve_endpoint
from ._text import printable

__all__ = ["Record", "Sniffer", "Summary", "read_recording", "to_json", "to_line"]

_LEN = struct.Struct(">I")


@dataclass(frozen=True)
class Record:
    """One frame seen on the bus: when, which way, which peer, and what it was."""

    ts: float
    dir: str
    peer: str
    msg: Any  # a protocol message, or None when the frame was invalid
    error: str = ""
    nbytes: int = 0
    raw: bytes = b""  # the tap frame, for --record

    @property
    def type(self) -> str:
        return self.msg.TYPE if self.msg is not None else "invalid"


def record_from_tap(frame: bytes) -> Record:
    """Decode one tap frame (the envelope, then the frame inside it)."""
    tap = decode(frame)
    if not isinstance(tap, Tap):
        raise ProtocolError(f"expected a tap record, got {tap.TYPE}")
    try:
        inner = decode(tap.frame)
    except ProtocolError as exc:
        return Record(tap.ts, tap.dir, tap.peer, None, str(exc), len(tap.frame), frame)
    return Record(tap.ts, tap.dir, tap.peer, inner, "", len(tap.frame), frame)


class Sniffer:
    """Subscribes to a publisher's tap (or, failing that, its events socket)."""

    def __init__(self, state: State, address: str) -> None:
        self.state = state
        self.fallback = not state.tap
        endpoint = resolve_endpoint(address, state.events if self.fallback else state.tap)
        curve = client_from_env(state.name)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = connect(self._ctx, zmq.SUB, endpoint, curve.apply if curve else None)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVHWM, 100_000)

    def records(self, deadline: Deadline, stop: threading.Event | None = None) -> Iterator[Record]:
        """Frames as they arrive, until the deadline passes or `stop` is set (a signal
        handler's way to end a live capture between two frames, with nothing lost)."""
        while not deadline.expired() and not (stop is not None and stop.is_set()):
            if not self._sock.poll(deadline.poll_ms(cap_s=0.2)) & zmq.POLLIN:
                continue
            frame = self._sock.recv()
            if frame.startswith(b"\x00zmqsync"):  # the events socket's subscription frame
                continue
            if self.fallback:  # wrap, so that recordings have one format
                frame = encode(Tap(self.state.bus, time.time(), "out", "", frame))
            try:
                yield record_from_tap(frame)
            except ProtocolError as exc:
                yield Record(time.time(), "in", "", None, f"bad tap frame: {exc}", len(frame))

    def close(self) -> None:
        self._sock.close()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> Sniffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_recording(stream: IO[bytes]) -> Iterator[Record]:
    """Records of a file written with --record."""
    while header := stream.read(_LEN.size):
        (length,) = _LEN.unpack(header)
        frame = stream.read(length)
        try:
            yield record_from_tap(frame)
        except ProtocolError as exc:
            yield Record(0.0, "in", "", None, f"bad recorded frame: {exc}", len(frame))


def write_record(stream: IO[bytes], record: Record) -> None:
    if record.raw:
        stream.write(_LEN.pack(len(record.raw)) + record.raw)


def to_json(record: Record) -> dict[str, Any]:
    """Stable JSON fields: ts, dir, type, peer, then the message's own fields.

    WELCOME/STATE manifests become a tensor count; buffer handles are never shown; a
    tap record's frame becomes its length, and any other bytes field hex.
    """
    out: dict[str, Any] = {
        "ts": record.ts,
        "dir": record.dir,
        "type": record.type,
        "peer": record.peer,
    }
    if record.msg is None:
        out.update(error=record.error, bytes=record.nbytes)
        return out
    fields = to_plain(record.msg)
    if "manifest" in fields:
        fields["tensors"] = len(fields.pop("manifest"))
    for buf in fields.get("buffers", []):
        buf.pop("handle", None)
    if "frame" in fields:
        fields["frame"] = len(fields["frame"])
    for key, value in fields.items():  # any other bytes field: hex, so the line stays JSON
        if isinstance(value, bytes):
            fields[key] = value.hex()
    out.update(fields)
    return out


_SHOWN = {
    "hello": ("worker_id", "pid", "host", "mode", "transport"),
    "welcome": ("session", "version", "slot", "seq"),
    "receive": ("seq", "version", "slot"),
    "stop": ("seq", "session", "reason"),
    "heartbeat": ("worker_id", "seq", "version"),
    "ack": ("worker_id", "version"),
    "bye": ("worker_id",),
    "inspect": (),
    "state": ("version", "seq"),
    "error": ("reason",),
}
_COLOURS = {
    "receive": "cyan",
    "ack": "green",
    "stop": "red",
    "hello": "magenta",
    "welcome": "magenta",
    "bye": "yellow",
    "invalid": "bold red",
    "error": "red",
    "heartbeat": "dim",
}


def to_line(record: Record, *, colour: bool = False) -> str:
    """One aligned, human-readable line, safe for a terminal.

    Peer text (the peer's name, every field shown, a rejection's error) has its control
    characters escaped, so a host of ``"\\x1b[2J"`` reads as those characters and clears
    nothing, and a newline in it cannot start a forged line. With `colour` the line is
    rich markup, and the peer text in it is markup-escaped too.
    """
    clock = datetime.datetime.fromtimestamp(record.ts).strftime("%H:%M:%S.%f")[:-3]
    arrow = "→" if record.dir == "out" else "←"
    if record.msg is None:
        detail = f"{printable(record.error)} ({record.nbytes} bytes)"
    else:
        plain = to_json(record)
        detail = " ".join(f"{k}={printable(plain[k])}" for k in _SHOWN.get(record.type, ()))
    kind, peer = f"{record.type:<9}", f"{printable(record.peer or '*'):<20}"
    if colour:
        from rich.markup import escape

        kind = f"[{_COLOURS.get(record.type, 'white')}]{kind}[/]"
        peer, detail = escape(peer), escape(detail)
    return f"{clock} {arrow} {kind} {peer} {detail}"


@dataclass
class _Version:
    sent: float
    expected: set[str]
    acks: dict[str, float] = field(default_factory=dict)


class Summary:
    """Per-version view: publish → each worker's ack latency, missing workers, gaps, rate;
    and per worker its lag: how many versions it is behind the latest announced one (from
    its ACKs and heartbeats), now and at most, counted as each new version is announced
    (the staleness a trainer that publishes again at once sees; with ``max_lag=k``, k)."""

    def __init__(self, workers: set[str], *, acks_visible: bool = True) -> None:
        self.workers = set(workers)
        self.acks_visible = acks_visible  # False: the events socket only, no tap
        self.versions: dict[int, _Version] = {}
        self.last_seq: int | None = None
        self.gaps = 0
        self.first: float | None = None
        self.last: float | None = None
        self.invalid = 0
        self.latest: int | None = None  # the newest version announced
        self.applied: dict[str, int] = {}  # worker -> newest version it acked or beat with
        self.max_lag: dict[str, int] = {}

    def add(self, record: Record) -> str | None:
        """Account for `record`; returns a summary line when a version is complete."""
        msg = record.msg
        if msg is None:
            self.invalid += 1
            return None
        if isinstance(msg, Hello):
            self.workers.add(msg.worker_id)
        elif isinstance(msg, Bye):
            self.workers.discard(msg.worker_id)
        elif isinstance(msg, Stop) and msg.session and record.peer:
            self.workers.discard(record.peer)
        if isinstance(msg, Receive | Stop):
            if self.last_seq is not None and msg.seq > self.last_seq + 1:
                self.gaps += msg.seq - self.last_seq - 1
            self.last_seq = msg.seq
        if isinstance(msg, Ack | Heartbeat) and msg.worker_id and msg.version >= 0:
            self.applied[msg.worker_id] = max(msg.version, self.applied.get(msg.worker_id, -1))
        if isinstance(msg, Receive):
            behind = self.lags()  # as the trainer moves on
            for worker, lag in behind.items():
                self.max_lag[worker] = max(lag, self.max_lag.get(worker, 0))
            self.latest = msg.version
            self.versions[msg.version] = _Version(record.ts, set(self.workers))
            self.first = record.ts if self.first is None else self.first
            self.last = record.ts
            if any(behind.values()):  # someone had not caught up: say who, how far
                return f"v{msg.version} announced; {self.lag_line()}"
        elif isinstance(msg, Ack) and msg.version in self.versions:
            v = self.versions[msg.version]
            v.acks.setdefault(msg.worker_id, record.ts - v.sent)
            if v.expected and v.expected <= set(v.acks):
                return self.line(msg.version)
        elif isinstance(msg, Welcome) and record.peer:
            self.workers.add(record.peer)
        return None

    def seed(self, state: State) -> Summary:
        """Start from the bus's STATE: its latest version and what each worker acked."""
        self.latest = state.version
        self.applied.update({w.worker_id: w.version for w in state.workers if w.version >= 0})
        return self

    def lags(self) -> dict[str, int]:
        """Each worker on the bus that acked a version: versions behind the latest."""
        if self.latest is None or not self.acks_visible:
            return {}
        latest, out = self.latest, {}
        for w, v in self.applied.items():  # the lag Publisher.workers reports, from the tap
            behind = lag(latest, v)
            if behind is not None and w in self.workers:
                out[w] = behind
        return out

    def lag_line(self) -> str:
        """``lag now/max: w0 0/2, w1 1/2`` (worker ids escaped), or "" before any."""
        lags = self.lags()
        if not lags:
            return ""
        shown = [
            f"{printable(w, limit=128)} {lag}/{self.max_lag.get(w, lag)}"
            for w, lag in sorted(lags.items())[:32]
        ]
        return "lag now/max: " + ", ".join(shown)

    def line(self, version: int) -> str:
        v = self.versions[version]
        lat = sorted(v.acks.values())
        missing = sorted(v.expected - set(v.acks))
        text = f"v{version}: {len(v.acks)}/{len(v.expected)} acks"
        if lat:
            text += f", p50 {statistics.median(lat) * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms"
        if missing:  # worker ids from HELLOs: printable ASCII, but cut and escaped anyway
            text += f", missing {', '.join(printable(w, limit=128) for w in missing)}"
        return text

    def final(self) -> str:
        n = len(self.versions)
        rate = ""
        if n > 1 and self.first is not None and self.last is not None and self.last > self.first:
            rate = f", {(n - 1) / (self.last - self.first):.1f} publishes/s"
        complete = sum(1 for v in self.versions.values() if v.expected <= set(v.acks))
        acked = f"{complete} fully acked" if self.acks_visible else "acks not visible without a tap"
        lags = self.lag_line()
        return (
            f"{n} versions seen ({acked}){rate}, {self.gaps} sequence gaps, "
            f"{self.invalid} invalid frames" + (f"; {lags}" if lags else "")
        )
