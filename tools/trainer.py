"""A small real trainer process, for tests, the soak harness and manual experiments.

Takes an optimizer step on a tiny policy (with BatchNorm, a bf16 head and an int64
counter) before each publish, stores the weights' digest in ``_checksum`` so that
``zmqsync worker --verify`` checks every version, and prints one JSON line per publish:

    python tools/trainer.py NAME --updates 100 --interval 0.05 --tap --on-timeout evict

Ends after --updates publishes (or runs until SIGTERM with --updates 0) and prints
{"event": "done", ...} with its counters. --size-mb pads the model with a big buffer.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import torch

import zmqsync
from zmqsync._checksum import CHECKSUM_KEY, digest, digest_tensor
from zmqsync._layout import flatten


def make_model(size_mb: float) -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )
    model[-1].to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    if size_mb > 0:
        model.register_buffer("pad", torch.zeros(int(size_mb * 2**20 / 4)))
    return model


def state(model: torch.nn.Module) -> dict:
    flat = flatten(model)
    flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
    return flat


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(16, 8)
    loss = model[3](model[:3](x).bfloat16()).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.steps += 1
        if hasattr(model, "pad"):
            model.pad[:1024].add_(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("--address", default=None)
    p.add_argument("--updates", type=int, default=10, help="0: until SIGTERM")
    p.add_argument("--interval", type=float, default=0.0)
    p.add_argument("--size-mb", type=float, default=0.0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument("--on-timeout", choices=("raise", "evict"), default="evict")
    p.add_argument("--tap", action="store_true", help="open the tap (default: $ZMQSYNC_TAP)")
    p.add_argument("--wait-workers", type=int, default=0)
    args = p.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    torch.manual_seed(0)
    model = make_model(args.size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pub = zmqsync.Publisher(
        state(model),
        args.address,
        name=args.name,
        slots=args.slots,
        timeout=args.timeout,
        on_timeout=args.on_timeout,
        heartbeat=args.heartbeat,
        security=zmqsync.Security(tap=True if args.tap else None),  # None: $ZMQSYNC_TAP decides
    )
    with pub:
        print(
            json.dumps({"event": "started", "bus": pub.bus_id, "address": pub.address}), flush=True
        )
        if args.wait_workers:
            pub.wait_for_workers(args.wait_workers, timeout=60)
        n = 0
        while not stop.is_set() and (args.updates == 0 or n < args.updates):
            step(model, opt)
            flat = state(model)
            t0 = time.monotonic()
            try:
                handle = pub.publish(weights=flat)
                record = {
                    "event": "published",
                    "version": handle.version,
                    "seconds": time.monotonic() - t0,
                    "missing": list(handle.missing),
                    "acked": len(handle.acked),
                    "checksum": digest(flat),
                }
            except zmqsync.PublishTimeout as exc:
                record = {
                    "event": "timeout",
                    "version": exc.version,
                    "missing": list(exc.missing),
                    "seconds": time.monotonic() - t0,
                }
            print(json.dumps(record), flush=True)
            n += 1
            if args.interval:
                stop.wait(args.interval)
        print(
            json.dumps({"event": "done", "version": pub.version, "counters": pub.counters}),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
