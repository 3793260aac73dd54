"""The trainer of the namespace tests: publishes a checksummed version when told to.

    python tests/helpers/hosts_trainer.py NAME --size-mb 4 --timeout 4

Each SIGUSR1 publishes the next version (its bytes depend on the version number, with
their digest in ``_checksum`` so that ``zmqsync worker --verify`` checks each one) and
waits for its acks; SIGTERM closes the bus. Prints one JSON line per event: ``started``
(with version 0's digest); ``published`` (version, seconds, acked, missing, checksum,
and ``start``/``end`` on the monotonic clock, which every namespace shares) or
``timeout``; ``done``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import torch

import zmqsync
from zmqsync._checksum import CHECKSUM_KEY, digest, digest_tensor


def weights(version: int, size_mb: float) -> dict[tuple[str, ...], torch.Tensor]:
    """A model state of about `size_mb` MiB whose bytes depend on `version`."""
    g = torch.Generator().manual_seed(version)
    flat = {
        ("policy", "w"): torch.randn(max(1, int(size_mb * 2**20 / 4)), generator=g),
        ("policy", "b"): torch.randn(256, generator=g).to(torch.bfloat16),
        ("steps",): torch.tensor(version, dtype=torch.int64),
    }
    flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
    return flat


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("--size-mb", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    args = p.parse_args(argv)
    first = weights(0, args.size_mb)
    pub = zmqsync.Publisher(
        first,
        name=args.name,
        slots=2,
        timeout=args.timeout,
        heartbeat=args.heartbeat,
        on_timeout="evict",
    )
    asked, wake, stop = [0], threading.Event(), threading.Event()

    def publish_one(signum: int, frame: object) -> None:
        asked[0] += 1
        wake.set()

    def quit_(signum: int, frame: object) -> None:
        stop.set()
        wake.set()

    signal.signal(signal.SIGUSR1, publish_one)
    signal.signal(signal.SIGTERM, quit_)
    with pub:
        emit(
            {
                "event": "started",
                "bus": pub.bus_id,
                "address": pub.address,
                "pid": os.getpid(),
                "checksum": digest(first),
            }
        )
        done = 0
        while not stop.is_set():
            if done == asked[0]:
                wake.wait(0.5)
                wake.clear()
                continue
            done += 1
            flat = weights(pub.version + 1, args.size_mb)
            start = time.monotonic()
            try:
                handle = pub.publish(weights=flat)
                record: dict[str, object] = {
                    "event": "published",
                    "version": handle.version,
                    "acked": list(handle.acked),
                    "missing": list(handle.missing),
                }
            except zmqsync.PublishTimeout as exc:
                record = {"event": "timeout", "version": exc.version, "missing": list(exc.missing)}
            end = time.monotonic()
            record.update(seconds=end - start, start=start, end=end, checksum=digest(flat))
            emit(record)
        emit({"event": "done", "version": pub.version})
    return 0


if __name__ == "__main__":
    sys.exit(main())
