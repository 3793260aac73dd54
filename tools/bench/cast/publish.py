"""A bf16-slot publish against a float32 one, with the native cast and with torch's.

Three publishers of one float32 model (an MLP of ``--size`` MB, `model_for`), each with
``--workers`` alias workers (`zmqsync worker`), published in turn every round after an
in-place step on the model, as `python -m tools.bench trainer`'s bf16 row does:

``float32``      float32 slots (a copy)
``bf16 torch``   bf16 slots, cast by torch's ``copy_`` (the native cast turned off for
                 this publisher: what the publisher did before the native cast)
``bf16 native``  bf16 slots, cast by ``_native.cast_bf16`` (what it does now)

and prints each p50 and its ratio to the float32 publish, measured side by side.

    .venv/bin/python -m tools.bench cast publish --size 512 --workers 8 --rounds 20
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import uuid

import torch

import zmqsync
from tools.bench.grid.trainer import HEARTBEAT_S, _reap, _spawn_zmqsync_workers, model_for
from zmqsync import _copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MB of float32")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = model_for(args.size)
    ways = {"float32": torch.float32, "bf16 torch": torch.bfloat16, "bf16 native": torch.bfloat16}
    samples: dict[str, list[float]] = {way: [] for way in ways}
    native = _copy.NATIVE_CAST
    with contextlib.ExitStack() as stack:
        workers: list = []
        stack.callback(_reap, workers)
        pubs = {}
        for way, dtype in ways.items():
            name = f"bf16pub-{uuid.uuid4().hex[:8]}"
            _copy.NATIVE_CAST = None if way == "bf16 torch" else native  # read at start()
            pub = zmqsync.Publisher(
                model,
                name=name,
                writes=zmqsync.Copy(dtype=dtype),
                timeout=120,
                heartbeat=HEARTBEAT_S,
            )
            pubs[way] = stack.enter_context(pub)
            workers += _spawn_zmqsync_workers(name, args.workers)
        _copy.NATIVE_CAST = native
        for pub in pubs.values():
            if not pub.wait_for_workers(args.workers, timeout=180):
                raise SystemExit(f"only {len(pub.workers)} of {args.workers} workers joined")
        for i in range(args.rounds + 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            order = list(pubs)[i % 3 :] + list(pubs)[: i % 3]
            for way in order:
                t = time.perf_counter()
                pubs[way].publish()
                if i >= 2:
                    samples[way].append(time.perf_counter() - t)
        for pub in pubs.values():
            pub.close()
    base = statistics.median(samples["float32"])
    print(
        f"{args.size} MB float32 model, {args.workers} alias workers, torch threads "
        f"{args.threads}, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'publish':14s} {'p50 ms':>8s} {'/ float32':>10s}")
    for way, values in samples.items():
        p50 = statistics.median(values)
        print(f"{way:14s} {p50 * 1e3:8.1f} {p50 / base:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
