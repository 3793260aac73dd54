"""``python -m tools.bench SCENARIO [QUESTION] [OPTIONS]``: dispatch to a scenario's main."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# scenario -> question -> (module, its main, what it answers); the first question is the
# default, so ``python -m tools.bench fixed`` is ``python -m tools.bench fixed rounds``.
SCENARIOS: dict[str, dict[str, tuple[str, str, str]]] = {
    "grid": {"": ("grid.cli", "main",
        "the full grid: zmqsync vs memcpy, raw ZeroMQ, N+1 copies, torchrl, pickle")},
    "trainer": {"": ("grid.cli", "trainer_main",
        "the trainer loop: steps/s and lag, publishing every step, 5 ways")},
    "fixed": {
        "rounds": ("fixed.rounds", "main",
            "a 4 KB publish to N plain workers next to raw ZeroMQ"),
        "cpu": ("fixed.cpu", "main", "where a publish's CPU goes, per process and thread"),
        "cold-calls": ("fixed.cold_calls", "main",
            "what one call per message costs a worker with cold caches"),
    },
    "steps": {
        "ways": ("steps.ways", "main", "a copy publish's steps, timed, flat/home/tensors"),
        "shared-copy": ("steps.shared_copy", "main",
            "a worker's big copy shared among threads or not (ZMQSYNC_COPY_THREADS)"),
    },
    "cast": {
        "publish": ("cast.publish", "main", "a bf16 publish (native, torch) vs float32"),
        "floor": ("cast.floor", "main", "the float32 -> bf16 casts alone, vs a copy"),
    },
    "joins": {
        "cost": ("joins.cost", "main",
            "honest joins undisturbed and under a storm"),
        "storm": ("joins.storm", "main", "joins and a sniffer's start under connect storms"),
        "admission": ("joins.admission", "main",
            "admission figures: storm, resume, saturated, fenced, member-storm"),
    },
    "relay": {
        "loopback": ("relay.loopback", "main", "relays vs a gloo broadcast, on loopback"),
        "hosts": ("relay.hosts", "main", "relays vs gloo between namespace hosts (root)"),
    },
    "vllm": {"": ("vllm_update", "main",
        "a vLLM engine's update() vs its own reload, disk, pickle; tokens/s")},
    "shards": {"": ("shards", "main",
        "a sharded trainer's publish vs gathering first; tensor-parallel readers")},
    "staleness": {"": ("staleness", "main", "max_lag 0/1/2/none: steps/s and lag")},
    "metrics": {"": ("metrics_cost", "main", "what a scraper every 100 ms costs a publish")},
    "storms": {"": ("storms", "main", "a connection or HELLO storm on a bus of this host")},
    "sides": {"": ("sides", "main",
        "any scenario on two checkouts or environments, rounds alternating")},
}  # fmt: skip


def _usage() -> str:
    lines = ["usage: python -m tools.bench SCENARIO [QUESTION] [OPTIONS]", ""]
    for scenario, questions in SCENARIOS.items():
        for question, (_, _, what) in questions.items():
            lines.append(f"  {(scenario + ' ' + question).strip():<24} {what}")
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[Callable[[list[str]], int], list[str]]:
    """The scenario's main and the arguments left for it."""
    if not argv or argv[0] not in SCENARIOS:
        raise SystemExit(_usage() if not argv or argv[0] in ("-h", "--help") else
                         f"unknown scenario {argv[0]!r}\n\n{_usage()}")  # fmt: skip
    questions = SCENARIOS[argv[0]]
    rest = argv[1:]
    if rest and rest[0] in questions:
        question, rest = rest[0], rest[1:]
    else:
        question = next(iter(questions))
    module, function, _ = questions[question]
    sys.argv[0] = f"python -m tools.bench {argv[0]} {question}".strip()  # argparse's prog
    main: Callable[[list[str]], int] = getattr(
        importlib.import_module(f"{__package__}.{module}"), function
    )
    return main, rest


if __name__ == "__main__":
    main, rest = resolve(sys.argv[1:])
    try:
        sys.exit(main(rest))
    except KeyboardInterrupt:
        sys.exit(130)
