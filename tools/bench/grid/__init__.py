"""The full grid: zmqsync next to its floors, torchrl and a naive pickle, in one run.

For each point of the grid (workers N × model size × mode copy/alias) it measures, on
the same machine state, interleaved iteration by iteration:

* **zmqsync**: ``Publisher.publish()`` wall time, from the call to its return (every
  worker applied the version and acked), with N independent worker processes.
* **raw ZeroMQ floor**: a tiny message PUB→SUB to the same N processes, then
  PUSH→PULL back from each (ipc://, as zmqsync's default address).
* **memcpy floor**: one torch ``copy_`` of the model's bytes into shared memory, with
  1 thread and with torch's default threads; the floor is the faster of the two. (In
  copy mode, where it is not the floor, the default-threads samples come after the
  timed loop: torch's threads spin for milliseconds after one.)
* **copy floor (copy mode)**: N+1 concurrent copies: the harness sends a tiny "go",
  every worker copies the bytes from shared memory into its own model, the harness
  copies the trainer's bytes into shared memory; from "go" to the last "done".

And, per (N, size), in separate phases: **naive** (``pickle.dumps(model.state_dict())``
on a PUB socket, each worker unpickles, ``load_state_dict`` and acks) and **torchrl**'s
``SharedMemWeightSyncScheme`` sync ``send()``, in a subprocess killed on a deadline (a
dead receiver blocks its ``send()`` forever), in two set-ups: ``collector`` (what its
collectors do with a CPU policy: the trained module's own tensors are the shared buffer)
and ``own`` (the scheme owns a buffer: ``send()`` copies the trainer's weights into it).
Per worker memory is PSS from ``/proc/PID/smaps_rollup``; the part that maps the shared
segment is split out from ``/proc/PID/smaps``. A late-join measurement times a new
worker's ``Subscriber.start()`` (handshake and apply) against a 1 GB model.

Workers are started once (a pool that grows with N) and reused for every size, mode and
baseline; each run has its own runtime dir (under /tmp) and shm dir (under /dev/shm),
both removed at the end, and every process is ended even on Ctrl-C. Points that do not
fit the memory budget are skipped and say why. Heavy imports (matplotlib, torchrl) are
made only by the functions that need them.

The modules, by concern (each imports only the standard library at module level, so
building the parser stays cheap):

* `config`: model sizes, modes, `BenchConfig` and its quick variant, the errors.
* `units`: byte units and the number formats every table shares.
* `machine`: the machine description and the memory free now.
* `plan`: what a phase costs, whether it fits, how long to measure it.
* `pool`: the worker processes; `fanout`: the harness's own sockets (the floors).
* `run`: one run from start to end (`Run`, `run_bench`);
  `torchrl_baseline`: torchrl's scheme in a subprocess killed on a deadline.
* `results`: rows, runs and their files; `targets`: the seven targets, judged from rows.
* `report`: rich and Markdown tables; `plots`: the figures (matplotlib, optional).
* `args`: the command-line options and `run_from_args`.
* `cli`: ``python -m tools.bench grid`` and ``trainer`` (plots, ``--replot``,
  ``--markdown``); `trainer`: the trainer loop, a way per process.

The workers themselves are `tools.bench.grid.worker`, a separate module run with
``python -m``; it also holds the digest of the library's sources that keeps one run
from mixing two versions of them.
"""

from __future__ import annotations

from .args import add_arguments, config_from_args, run_from_args
from .config import QUICK, SIZES, BenchConfig
from .plots import plot
from .report import markdown_report
from .results import load_results
from .run import run_bench
from .targets import evaluate_targets

__all__ = [
    "BenchConfig",
    "QUICK",
    "SIZES",
    "add_arguments",
    "config_from_args",
    "evaluate_targets",
    "load_results",
    "markdown_report",
    "plot",
    "run_bench",
    "run_from_args",
]
