"""`zmqsync worker`: a standalone subscriber process (used by the demo and docker-compose).

It holds the weights itself (no model), optionally verifies every version against the
``_checksum`` tensor the trainer publishes, and with ``--json`` prints one JSON line per
applied version and a summary line at exit, which is what tests and the demo read.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ._checksum import digest, stored_digest
from ._layout import Key
from ._subscriber import Subscriber
from ._text import printable

__all__ = ["run_worker"]

log = logging.getLogger(__name__)


class _Verifier:
    """The worker's `on_update`: report (and check) each version it applied."""

    def __init__(self, as_json: bool, verify: bool) -> None:
        self.sub: Subscriber | None = None  # set once the Subscriber exists
        self.as_json, self.verify = as_json, verify
        self.versions: list[int] = []
        self.verified = 0
        self.mismatches: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, version: int) -> None:
        sub = self.sub
        assert sub is not None
        flat: dict[Key, Any] = dict(sub.tensors)
        record: dict[str, Any] = {
            "event": "applied",
            "worker": sub.worker_id,
            "version": version,
            "bus": sub.bus_id,
        }
        if self.verify:
            # The seqlock guard is the reader's side of the protocol: it can only trip
            # when this worker was evicted (or slots=1) and its slot was rewritten.
            with sub.reading() as reading:
                got, want = digest(flat), stored_digest(flat)
            ok = want is None or got == want or reading.torn
            record.update(checksum=got, expected=want, ok=ok, torn_detected=reading.torn)
            with self.lock:
                self.verified += want is not None and got == want
                if not ok:
                    self.mismatches.append(version)
                    log.error("version %d: checksum %s != published %s", version, got, want)
        with self.lock:
            self.versions.append(version)
        if self.as_json:
            print(json.dumps(record), flush=True)

    def summary(self) -> dict[str, Any]:
        sub = self.sub
        assert sub is not None
        with self.lock:
            return {
                "event": "summary",
                "worker": sub.worker_id,
                "applied": len(self.versions),
                "versions": self.versions,
                "last_version": sub.version,
                "verified": self.verified,
                "mismatches": self.mismatches,
            }


def run_worker(
    address: str | None,
    *,
    name: str,
    mode: str,
    apply: str,
    verify: bool,
    as_json: bool,
    worker_id: str | None,
    until_version: int | None,
    forever: bool,
    timeout: float,
) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    verifier = _Verifier(as_json, verify)
    sub = Subscriber(
        address,
        name=name,
        mode=mode,
        apply=apply,
        worker_id=worker_id,
        timeout=timeout,
        on_update=verifier,
    )
    verifier.sub = sub
    with sub:
        while not stop.is_set():
            if apply == "manual":
                sub.poll(0.1)
            elif sub.wait_for_stop(0.1) and not forever:
                break
            if until_version is not None and sub.version >= until_version:
                break
            if apply == "manual" and sub.stopped and not forever:
                break
    summary = verifier.summary()
    if as_json:
        print(json.dumps(summary), flush=True)
    else:
        print(
            f"worker {printable(summary['worker'])}: applied {summary['applied']} versions "
            f"(last {summary['last_version']}), {summary['verified']} verified, "
            f"{len(summary['mismatches'])} mismatches",
            file=sys.stderr,
        )
    return 1 if summary["mismatches"] else 0
