"""The trainer of docker-compose.yml: a small, real training loop that publishes its policy.

Each round takes a few Adam steps on a tiny MLP policy (it learns to imitate a fixed,
random "teacher" policy on random observations, so the loss really goes down), stores a
checksum of the weights in a ``_checksum`` tensor (``zmqsync worker --verify`` checks
every version against it) and publishes. Workers that stop acking are evicted, not
waited for; a worker that comes back re-joins by itself.

One JSON object per line on stdout: ``started``, ``joined``, one ``published`` per
version (``version``, ``loss``, ``acked``, ``missing``, ``ms``), ``closed`` (with the
segments still in the shm dir after close(): none is expected) and ``done``.

It ends after ``--updates`` versions, once a version was acked by ``--workers`` workers
(at most ``--grace`` seconds later), or on SIGTERM/SIGINT; it always closes the
publisher, which tells the workers to stop and unlinks the shared-memory segment.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import torch

import zmqsync
from zmqsync._checksum import CHECKSUM_KEY, digest, digest_tensor


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "ts": time.time(), **fields}), flush=True)


def make_policy(obs: int, hidden: int, actions: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(obs, hidden),
        torch.nn.LayerNorm(hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, actions),
    )


def weights(policy: torch.nn.Module) -> dict[tuple[str, ...], torch.Tensor]:
    """The policy's state plus the checksum the workers verify."""
    flat = {tuple(k.split(".")): v.detach() for k, v in policy.state_dict().items()}
    flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
    return flat


def segments(shm_dir: str, name: str) -> list[str]:
    try:
        return sorted(f for f in os.listdir(shm_dir) if f.startswith(f"zmqsync-{name}-"))
    except OSError:
        return []


def train(args: argparse.Namespace, pub: zmqsync.Publisher, policy: torch.nn.Module) -> int:
    """Train and publish until done: 0, or 1 if the workers were not all back in time."""
    torch.manual_seed(args.seed + 1)
    obs_dim, act_dim = 32, 8
    teacher = make_policy(obs_dim, args.hidden, act_dim).requires_grad_(False)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    grace_end: float | None = None
    for update in range(1, 1_000_000):
        for _ in range(args.steps):
            obs = torch.randn(256, obs_dim)
            loss = torch.nn.functional.mse_loss(policy(obs), teacher(obs))
            opt.zero_grad()
            loss.backward()
            opt.step()
        handle = pub.publish(weights=weights(policy))
        live = sorted(pub.workers)
        # a worker dropped as silent during this publish never acked it, although
        # handle.acked may still name it: count only the workers still on the bus
        acked = sorted(w for w in handle.acked if w in live)
        emit(
            "published",
            version=handle.version,
            loss=round(loss.item(), 6),
            acked=acked,
            missing=sorted(handle.missing),
            ms=round(handle.seconds * 1e3, 2),
            workers=live,
        )
        if update >= args.updates:
            if len(acked) >= args.workers:
                return 0
            grace_end = grace_end or time.monotonic() + args.grace
            if time.monotonic() > grace_end:
                emit("error", reason=f"fewer than {args.workers} workers acked the end")
                return 1
        time.sleep(args.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="tcp://127.0.0.1:5555", help="control address")
    p.add_argument("--name", default="policy", help="bus name (segment names)")
    p.add_argument("--workers", type=int, default=3, help="workers to wait for")
    p.add_argument("--updates", type=int, default=40, help="versions to publish")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per version")
    p.add_argument("--interval", type=float, default=0.5, help="pause between versions (s)")
    p.add_argument("--timeout", type=float, default=5.0, help="ack deadline per publish (s)")
    p.add_argument("--join-timeout", type=float, default=120.0, help="wait for --workers (s)")
    p.add_argument("--grace", type=float, default=60.0, help="wait for all workers at the end")
    p.add_argument("--linger", type=float, default=1.0, help="pause before close (s)")
    p.add_argument("--hidden", type=int, default=256, help="policy width")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--curve",
        action="store_true",
        help="CURVE on the bus: the workers' keys go to the runtime dir "
        "($ZMQSYNC_RUNTIME_DIR/NAME.curve)",
    )
    args = p.parse_args(argv)

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through `with pub`: STOP, unlink the segment

    signal.signal(signal.SIGTERM, on_signal)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # leave the other cores to the workers
    policy = make_policy(32, args.hidden, 8)
    shm_dir = os.environ.get("ZMQSYNC_SHM_DIR") or "/dev/shm"
    pub = zmqsync.Publisher(
        weights(policy),
        args.address,
        name=args.name,
        slots=2,
        timeout=args.timeout,
        on_timeout="evict",  # a dead worker is dropped, never waited for
        heartbeat=0.5,  # a silent worker is dropped after about 3 s
        shm_dir=shm_dir,
        security=zmqsync.Security(
            tap=True,  # for `zmqsync sniff`
            curve=True if args.curve else None,
        ),
    )
    rc = 0
    try:
        with pub:
            emit(
                "started",
                address=pub.address,
                version=pub.version,
                shm_dir=shm_dir,
                segments=segments(shm_dir, args.name),
                pid=os.getpid(),
                curve=args.curve,
            )
            if pub.wait_for_workers(args.workers, timeout=args.join_timeout):
                emit("joined", workers=sorted(pub.workers))
                rc = train(args, pub, policy)
            else:
                emit("error", reason=f"only {len(pub.workers)} of {args.workers} workers joined")
                rc = 1
            time.sleep(args.linger)  # observers (zmqsync sniff) see the last acks
    except KeyboardInterrupt:
        emit("interrupted", version=pub.version)
        rc = 130
    emit("closed", version=pub.version, segments=segments(shm_dir, args.name))
    emit("done", version=pub.version, rc=rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
