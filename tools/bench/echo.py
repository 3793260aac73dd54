"""The one echo worker of the harness: SUB -> PUSH, every message answered.

Run by path (``python tools/bench/echo.py EVENTS ACKS [OPTIONS]``), from any directory:
``PYTHONPATH`` decides which ``zmqsync`` it imports. The raw round trip it answers is the
floor a publish is compared with; what else the process holds or does is what the
scenario asks about:

``grid``, ``fixed``   nothing else: a plain pyzmq process, no torch (the raw floor; the
                      grid's Echoes, the fixed cost's raw side).
``fixed cpu``         ``--subscribe NAME``: a real Subscriber on the same process, the
                      echo on the main thread (the CPU of both is read from ``/proc``).
``fixed cold-calls``  ``--extra VARIANT``: one more call per message, the echo on a
                      thread (``--thread``) while the main thread sleeps, torch imported.

Every worker looks at its parent once a second and leaves when it is gone, or on the
message ``quit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
EXTRAS = ("none", "python", "swap", "add", "add-t1")


def _extra(variant: str) -> Callable[[], None]:
    """The call a cold-calls worker makes per message (``none``: no call at all)."""
    if variant == "none":
        return lambda: None
    import torch

    if variant == "add-t1":
        torch.set_num_threads(1)
    small = torch.zeros(64)
    a, b = torch.zeros(1024).untyped_storage(), torch.zeros(1024).untyped_storage()

    def python() -> None:
        x = 0
        for i in range(300):
            x += i

    calls: dict[str, Callable[[], Any]] = {
        "python": python,
        "swap": lambda: a._swap_data_ptr_(b),  # an alias worker's version switch
        "add": lambda: small.add_(1),  # one op through torch's dispatcher
        "add-t1": lambda: small.add_(1),
    }
    return calls[variant]


def echo(events: str, acks: str, extra: Callable[[], None]) -> None:
    """Answer every message on `events` on `acks` until ``quit`` or the parent is gone."""
    import zmq

    ctx = zmq.Context()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.linger = push.linger = 0
    sub.subscribe(b"")
    sub.rcvtimeo = 1000  # look at the parent once a second
    sub.connect(events)
    push.connect(acks)
    while True:
        try:
            msg = sub.recv()
        except zmq.Again:
            if os.getppid() == 1:
                break
            continue
        if msg == b"quit":
            break
        extra()
        push.send(msg)
    ctx.destroy(linger=0)


def _model(kind: str) -> Any:
    if kind == "many":  # the grid's 2,000 tensors of 2 KB
        sys.path.append(str(HERE.parents[2]))  # after PYTHONPATH: it still picks zmqsync
        from tools.bench.grid.worker import make_model

        return make_model("many", 0, fill=False)[0]
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 4 KB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("events")
    parser.add_argument("acks")
    parser.add_argument("--extra", choices=EXTRAS, default="none")
    parser.add_argument("--thread", action="store_true", help="echo on a thread; main sleeps")
    parser.add_argument("--subscribe", metavar="NAME", help="hold a Subscriber of bus NAME")
    parser.add_argument("--mode", choices=("copy", "alias"), default="alias")
    parser.add_argument("--model", choices=("4k", "many"), default="4k")
    parser.add_argument("--flat", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))  # tools/bench, for a run by path from anywhere
    from roles import die_with_parent, subscriber

    die_with_parent()
    extra = _extra(args.extra)
    if args.subscribe:
        sub = subscriber(
            model=_model(args.model), name=args.subscribe, mode=args.mode, flat=args.flat
        )
        with sub:
            echo(args.events, args.acks, extra)
    elif args.thread:
        threading.Thread(target=echo, args=(args.events, args.acks, extra), daemon=True).start()
        while threading.active_count() > 1:
            time.sleep(1)
    else:
        echo(args.events, args.acks, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
