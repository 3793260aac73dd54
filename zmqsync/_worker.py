"""`zmqsync worker`: a standalone subscriber process (used by the demo and docker-compose).

It holds the weights itself (no model), optionally verifies every version against the
``_checksum`` tensor the trainer publishes, and tells what happens to it: when it joined
(bus, version, mode, transport), each version it applied, when the publisher went away
and when it re-joined, and a summary at the end, also when stopped with Ctrl-C or
SIGTERM. On a terminal the versions are one live line; otherwise one line each. With
``--json`` every event is one JSON line on stdout (``joined``, ``applied``, ``lost``,
``rejoined``, ``closed``, ``refused``, ``summary``), which is what tests, the demo and the
soak read. A worker the publisher refuses for good (its id taken by another process
while it was paused) ends with that reason and a non-zero status.

The ``applied`` line is printed by the apply thread inside `on_update`, before the ack:
once a publish returned, every worker's line for it is in its pipe. Everything else is
printed by the main thread, which looks at the subscriber every `_TICK_S`; one lock
keeps lines of the two threads whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import IO, Any

from ._checksum import CHECKSUM_KEY, digest, stored_digest
from ._cli.signals import interrupt, record
from ._errors import ProtocolError
from ._layout import Key
from ._reads import Aliases, Copies, OnUpdate, Reads
from ._subscriber import Subscriber
from ._text import printable

__all__ = ["NothingToVerify", "run_worker"]

log = logging.getLogger(__name__)

_TICK_S = 0.1  # how often the main thread looks at the subscriber and redraws


class NothingToVerify(ValueError):
    """``--verify`` against a bus whose versions carry no checksum."""


class _Verifier:
    """The worker's `on_update`: report (and check) each version it applied."""

    def __init__(self, out: _Output, verify: bool, report_digest: bool = False) -> None:
        self.sub: Subscriber | None = None  # set once the Subscriber exists
        self.out, self.verify = out, verify
        self.report_digest = report_digest or verify
        self.versions: list[int] = []
        self.verified = 0
        self.mismatches: list[int] = []
        self.unverifiable: list[int] = []  # versions of a re-joined bus without a checksum
        # JSON lines of versions applied before the "joined" line is out (the handshake
        # applies the current version): printed right after it, in order
        self.held: list[dict[str, Any]] | None = []
        self.lock = threading.Lock()

    def __call__(self, version: int) -> None:
        applied_ts = time.time()  # the version is applied; the ack follows this callback
        sub = self.sub
        assert sub is not None
        record: dict[str, Any] = {
            "event": "applied",
            "worker": sub.worker_id,
            "version": version,
            "bus": sub.bus_id,
            "applied_ts": applied_ts,
        }
        if self.verify:
            self._check(sub, version, record)
        elif self.report_digest:
            record["checksum"] = digest(dict(sub.tensors))
            record["expected"] = stored_digest(dict(sub.tensors))
        with self.lock:
            self.versions.append(version)
            if self.out.as_json and self.held is not None:
                self.held.append(record)
                return
        if self.out.as_json:
            self.out.json(record)

    def joined(self) -> tuple[int | None, int]:
        """The version the worker joined at (the first it applied) and how many it applied
        so far; from now on JSON lines go out as they come, after the held ones."""
        with self.lock:
            for record in self.held or ():
                self.out.json(record)
            self.held = None
            return (self.versions[0] if self.versions else None), len(self.versions)

    def _check(self, sub: Subscriber, version: int, record: dict[str, Any]) -> None:
        flat: dict[Key, Any] = dict(sub.tensors)
        # The seqlock guard is the reader's side of the protocol: it can only trip
        # when this worker was evicted (or slots=1) and its slot was rewritten.
        with sub.reading() as reading:
            got, want = digest(flat), stored_digest(flat)
        ok = want is not None and (got == want or reading.torn)
        record.update(
            checksum=got,
            expected=want,
            ok=ok,
            torn_detected=reading.torn,
            verify_s=time.time() - record["applied_ts"],
        )
        with self.lock:
            self.verified += got == want
            if want is None:
                self.unverifiable.append(version)
                log.error("version %d has no %s tensor to verify", version, CHECKSUM_KEY[0])
            elif not ok:
                self.mismatches.append(version)
                log.error("version %d: checksum %s != published %s", version, got, want)

    def summary(self, sub: Subscriber) -> dict[str, Any]:
        with self.lock:
            return {
                "event": "summary",
                "worker": sub.worker_id,
                "applied": len(self.versions),
                "versions": list(self.versions),
                "last_version": sub.version,
                "verified": self.verified,
                "mismatches": list(self.mismatches),
                "unverifiable": list(self.unverifiable),
            }


class _Output:
    """Lines for a person (a live line on a terminal) or JSON lines, kept whole."""

    def __init__(self, stream: IO[str], as_json: bool) -> None:
        self.stream, self.as_json = stream, as_json
        self.live = not as_json and stream.isatty()
        self._lock = threading.Lock()
        self._open = False  # a live line is on screen, not ended by a newline

    def json(self, record: dict[str, Any]) -> None:
        # one write per line: print() writes the text and the newline separately
        self._write(json.dumps(record) + "\n")

    def say(self, text: str) -> None:
        """One line of news (joined, lost, ...); ends a live line first."""
        self._write(("\n" if self._open else "") + text + "\n")
        self._open = False

    def status(self, text: str) -> None:
        """The live line: redrawn in place on a terminal."""
        self._write(f"\r\x1b[K{text}")
        self._open = True

    def end(self) -> None:
        if self._open:
            self._write("\n")
            self._open = False

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()


class _Watch:
    """What the main thread reports: link changes and the versions applied since."""

    def __init__(self, sub: Subscriber, verifier: _Verifier, out: _Output, forever: bool) -> None:
        self.sub, self.verifier, self.out, self.forever = sub, verifier, out, forever
        self.connected = True
        self.bus = sub.bus_id
        self.shown = 0  # versions already reported (index into verifier.versions)
        self.mode = "alias" if isinstance(sub.reads, Aliases) else "copy"
        self.apply = "manual" if sub.reads.manual else "background"

    def joined(self) -> None:
        """The "joined" line first, then every version applied since (the handshake's
        own, and any that came in meanwhile)."""
        sub = self.sub
        with self.verifier.lock:
            first = self.verifier.versions[0] if self.verifier.versions else sub.version
        record = {
            "event": "joined",
            "worker": sub.worker_id,
            "name": sub.name,
            "bus": sub.bus_id,
            "address": sub.address,
            "version": first,
            "mode": self.mode,
            "apply": self.apply,
            "transport": sub.transport,
        }
        if self.out.as_json:
            self.out.json(record)
            self.verifier.joined()
            return
        self.out.say(
            f"worker {printable(sub.worker_id)} joined bus {sub.name!r} (id {sub.bus_id}) at "
            f"{printable(sub.address)}: version {first}, {self.mode} mode, "
            f"{self.apply} apply, transport {printable(sub.transport)}"
        )
        _, applied = self.verifier.joined()
        self.shown = min(applied, 1)  # the version it joined at is in the line above

    def tick(self) -> None:
        sub = self.sub
        connected = sub.connected
        if connected == self.connected:
            self.shown = self._show_versions()
        elif connected:  # nothing is applied while lost: the versions came after the rejoin
            self.connected = True
            self._rejoined()
            self.shown = self._show_versions()
        else:  # the versions since the last look came before the loss
            self.connected = False
            self.shown = self._show_versions()
            self._lost()

    def _lost(self) -> None:
        sub = self.sub
        why = "closed the bus" if sub.stopped else "went silent"
        if self.out.as_json:
            event = "closed" if sub.stopped else "lost"
            self.out.json(
                {"event": event, "worker": sub.worker_id, "bus": self.bus, "version": sub.version}
            )
            return
        if sub.stopped and not self.forever:  # the worker ends now (--forever: it waits)
            self.out.say(f"the publisher at {printable(sub.address)} closed the bus")
            return
        self.out.say(
            f"the publisher at {printable(sub.address)} {why}; still computing with version "
            f"{sub.version}; waiting for a publisher to answer there again"
        )

    def refused(self) -> None:
        """The publisher refused this worker for good: say why (the reason comes last,
        as the error the command ends with)."""
        sub = self.sub
        if self.out.as_json:
            self.out.json(
                {
                    "event": "refused",
                    "worker": sub.worker_id,
                    "bus": self.bus,
                    "version": sub.version,
                    "reason": sub.refusal,
                }
            )
            return
        self.out.say(
            f"the publisher at {printable(sub.address)} refused this worker for good; "
            f"it stops at version {sub.version}"
        )

    def _rejoined(self) -> None:
        sub = self.sub
        new_bus = sub.bus_id != self.bus
        self.bus = sub.bus_id
        if self.out.as_json:
            self.out.json(
                {
                    "event": "rejoined",
                    "worker": sub.worker_id,
                    "bus": sub.bus_id,
                    "new_bus": new_bus,
                    "version": sub.version,
                }
            )
            return
        what = f"a new publisher (bus id {sub.bus_id})" if new_bus else "the same publisher"
        self.out.say(f"re-joined {what}: version {sub.version}")

    def _show_versions(self) -> int:
        if self.out.as_json:
            return self.shown
        with self.verifier.lock:
            new = self.verifier.versions[self.shown :]
            total, verified = len(self.verifier.versions), self.verifier.verified
        if not new:
            return self.shown
        check = f", {verified} verified" if self.verifier.verify else ""
        if self.out.live:
            self.out.status(f"version {new[-1]} applied ({total} versions so far{check})")
        else:
            for version in new:
                self.out.say(f"applied version {version}")
        return self.shown + len(new)


class _Signals:
    """Ctrl-C and SIGTERM end the loop (and so print the summary) instead of killing.

    Until the worker has joined there is nothing to summarise and the handshake may
    wait for its whole deadline: then they interrupt it (KeyboardInterrupt).
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.joined = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()
        if not self.joined:
            interrupt(signum)  # KeyboardInterrupt, or Terminated for SIGTERM
        record(signum)  # the command's exit status says which ended it


def reads(mode: str, *, manual: bool, on_update: OnUpdate | None) -> Reads:
    """The `Reads` the CLI's ``--mode`` and ``--apply`` spell."""
    if mode == "alias":
        return Aliases(manual=manual, on_update=on_update)
    return Copies(manual=manual, on_update=on_update)


def run_worker(
    address: str | None,
    *,
    name: str,
    mode: str,
    apply: str,
    verify: bool,
    as_json: bool,
    report_digest: bool = False,
    worker_id: str | None,
    until_version: int | None,
    forever: bool,
    timeout: float,
    stream: IO[str] | None = None,
) -> int:
    """Join the bus, report until it closes (or a signal, or `until_version`), summarise.

    Returns:
        0, or 1 when a version failed its checksum or had none to check.

    `report_digest` puts each version's digest in its JSON line (``checksum``, and
    ``expected`` when the bus has one) without checking anything: for tests that compare
    it with the trainer's own.

    Raises:
        NothingToVerify: `verify` on a bus that publishes no ``_checksum``.
        ProtocolError: the publisher refused the worker for good, after the summary (its
            worker id belongs to another process now: it was paused or starved past the
            publisher's patience, and another process took the id meanwhile).
    """
    out = _Output(stream if stream is not None else sys.stdout, as_json)
    signals = _Signals()
    verifier = _Verifier(out, verify, report_digest)
    sub = Subscriber(
        address,
        name=name,
        reads=reads(mode, manual=apply == "manual", on_update=verifier),
        worker_id=worker_id,
        timeout=timeout,
    )
    verifier.sub = sub
    with signals.installed(), sub:
        if verify and CHECKSUM_KEY not in sub.tensors:
            raise NothingToVerify(
                f"bus {sub.name!r} at {printable(sub.address)} publishes no "
                f"{CHECKSUM_KEY[0]!r} tensor, so --verify has nothing to check: drop "
                "--verify, or publish the weights' digest (zmqsync demo and tools/trainer.py do)"
            )
        watch = _Watch(sub, verifier, out, forever)
        watch.joined()
        signals.joined = True
        while not signals.stop.is_set():
            if apply == "manual":
                sub.poll(_TICK_S)
            else:
                signals.stop.wait(_TICK_S)
            watch.tick()
            if until_version is not None and sub.version >= until_version:
                break
            if sub.refusal or (sub.stopped and not forever):
                break
        summary = verifier.summary(sub)
    out.end()
    if sub.refusal:  # final, also with --forever: another process holds its worker id
        watch.refused()
    _print_summary(out, summary, verify)
    if sub.refusal:
        raise ProtocolError(
            f"worker {printable(sub.worker_id)} was refused by the publisher at "
            f"{printable(sub.address)}: {printable(sub.refusal)}"
        )
    return 1 if summary["mismatches"] or summary["unverifiable"] else 0


def _print_summary(out: _Output, summary: dict[str, Any], verify: bool) -> None:
    if out.as_json:
        out.json(summary)
        return
    check = ""
    if verify:
        check = f", {summary['verified']} verified, {len(summary['mismatches'])} mismatches"
        if summary["unverifiable"]:
            check += f", {len(summary['unverifiable'])} without a checksum"
    out.say(
        f"worker {printable(summary['worker'])}: applied {summary['applied']} versions "
        f"(last {summary['last_version']}){check}"
    )
