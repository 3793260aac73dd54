"""vLLM adapter: an inference engine whose weights follow a zmqsync bus.

Two lines on the engine's side (docs/vllm.md)::

    from vllm import LLM, SamplingParams
    from zmqsync.integrations import vllm as zv

    llm = LLM(model_dir, worker_extension_cls=zv.WORKER_EXTENSION)
    engine = zv.attach(llm, name="policy")        # joins; loads the bus's current version
    while True:
        version = engine.update()                 # the newest version, on every worker
        outs = llm.generate(prompts, SamplingParams(temperature=0))

and a trainer publishing the checkpoint's names (``zmqsync.Publisher(hf_model,
name="policy")``; ``publish(max_lag=None)`` when the engine updates at its own pace).

* **Where the weights go.** `WORKER_EXTENSION` is mixed into vLLM's worker class, so the
  bus is joined inside every worker process (one `zmqsync.Subscriber` each, manual
  apply). `Engine.update` asks them, through vLLM's ``collective_rpc``, to take the
  newest version and then to load it through vLLM's own in-place reload (its
  ``load_weights``: the checkpoint's names, the fused qkv_proj/gate_up_proj, tensor
  parallel slices, the CPU's packed GEMM weights processed again). The bytes an engine
  computes with are those a fresh engine loads from a checkpoint of the same tensors
  (tests/test_vllm.py checks tokens and tensors).
* **When.** ``collective_rpc`` runs between engine steps, and an offline ``LLM`` runs
  none while its driver is in `update`: no request ever sees two versions. The prefix
  cache is reset after each new version (no KV computed by old weights is reused), and
  the version is the engine's weight version label: every finished completion's
  ``outputs[i].weight_versions`` says which version sampled its tokens.
* **Failure.** A version whose names or shapes differ from the engine's checkpoint, a
  version with NaN or inf (``check_finite=True``), a trainer that closed or died:
  `UpdateFailed` on the driver, and the engine keeps the version it had.
* **A server.** ``vllm serve ... --worker-extension-cls`` with `SERVER_MIDDLEWARE`
  (`ServerUpdates`): ``POST /zmqsync/update`` or updates every few seconds; requests in
  flight finish on the weights they started with, and each response carries the version
  that produced it (``x-zmqsync-version``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ._plan import UpdateFailed, agreed, check, gone, newest, trainer_gone
from ._server import SERVER_MIDDLEWARE, ServerUpdates
from ._worker import WorkerExtension

__all__ = [
    "SERVER_MIDDLEWARE",
    "WORKER_EXTENSION",
    "Engine",
    "ServerUpdates",
    "UpdateFailed",
    "WorkerExtension",
    "attach",
]

log = logging.getLogger(__name__)

# The dotted path vLLM imports in each worker: LLM(worker_extension_cls=...),
# vllm serve --worker-extension-cls ...
WORKER_EXTENSION = f"{WorkerExtension.__module__.rsplit('.', 1)[0]}.WorkerExtension"

# A laggard worker (another version fetched than the others) gets this long to catch up.
_CATCH_UP_S = 10.0
# Slack over an RPC's own wait for vLLM to carry it (a reload of hundreds of MB included).
_RPC_SLACK_S = 120.0


class Engine:
    """A vLLM ``LLM`` on a bus: `update` applies the newest version on every worker.

    Made by `attach`. Not thread-safe: call it from the thread that calls ``generate``
    (the safe point is "between two generate calls").
    """

    def __init__(self, llm: Any, name: str, *, address: str | None, timeout: float,
                 check_finite: bool, shm_dir: str | None) -> None:  # fmt: skip
        self._llm = llm
        self.name = name
        self.version = -1  # what the engine computes with; -1: its checkpoint's weights
        self.bus_id = ""
        self.workers: list[dict[str, Any]] = []  # the last statuses, one per worker
        self._closed = False
        self._where = f"vLLM engine on bus {name!r}"
        try:
            self.workers = self._rpc(
                "zmqsync_join", timeout, name=name, address=address, timeout=timeout,
                shm_dir=shm_dir, check_finite=check_finite,
            )  # fmt: skip
        except Exception as exc:
            if "zmqsync_join" not in str(exc):
                raise
            raise TypeError(
                "this vllm.LLM's workers have no zmqsync extension: make it with "
                "LLM(..., worker_extension_cls=zmqsync.integrations.vllm.WORKER_EXTENSION)"
            ) from exc
        try:
            check(self.workers, self._where, self.version)
        except UpdateFailed:
            self._rpc("zmqsync_leave", 10.0)
            raise

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self.connected else "disconnected")
        workers = len(self.workers)
        return f"<zmqsync vLLM engine {self.name!r} v{self.version} {workers} workers {state}>"

    @property
    def connected(self) -> bool:
        """Whether every worker's publisher answered at the last call (see `update`)."""
        return bool(self.workers) and not gone(self.workers)

    def update(self, timeout: float = 0.0) -> int:
        """Apply the newest published version on every worker; return the engine's version.

        Args:
            timeout: how long to wait for a version newer than the engine's when none is
                there yet (0: do not wait; the engine's version is returned).

        Returns:
            The version the engine computes with from now on (`version`).

        Raises:
            UpdateFailed: no trainer answers (``kind="trainer"``), the version does not
                fit the engine's model (``"mismatch"``), holds NaN/inf
                (``"not-finite"``), or the workers could not agree on one version. The
                engine keeps computing with `version`.
            ClosedError: after `close`.
        """
        self._check_open()
        started = time.perf_counter()
        statuses = self._rpc("zmqsync_fetch", timeout, timeout=timeout)
        check(statuses, self._where, self.version)
        goal = agreed(statuses)
        if goal is None:  # a version landed between two workers' fetches: catch up
            bus, version = newest(statuses)
            statuses = self._rpc("zmqsync_fetch", _CATCH_UP_S, timeout=_CATCH_UP_S,
                                 at_least=version)  # fmt: skip
            check(statuses, self._where, self.version)
            goal = agreed(statuses)
            if goal is None:
                raise UpdateFailed(
                    f"{self._where}: workers hold different versions after {_CATCH_UP_S} s "
                    f"({sorted((s['rank'], s['fetched']) for s in statuses)}); the engine "
                    f"keeps version {self.version}",
                    version=self.version,
                    kind="disagree",
                )
        self.workers = statuses
        if goal == (self.bus_id, self.version):
            if gone(statuses):
                raise trainer_gone(self._where, self.version)
            return self.version
        self.workers = self._rpc("zmqsync_load", 0.0, bus=goal[0], version=goal[1])
        check(self.workers, self._where, self.version)
        self.bus_id, self.version = goal
        if not self._llm.reset_prefix_cache():
            log.warning("%s: vLLM did not reset its prefix cache (requests running?)", self._where)
        self._llm.llm_engine.set_weight_version(str(self.version))
        log.info("%s: version %d applied in %.3f s", self._where, self.version,
                 time.perf_counter() - started)  # fmt: skip
        return self.version

    def close(self) -> None:
        """Leave the bus in every worker; the engine keeps its weights. Idempotent."""
        if not self._closed:
            self._closed = True
            self._rpc("zmqsync_leave", 10.0)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            from ..._errors import ClosedError

            raise ClosedError(f"{self._where} was closed; attach() again")

    def _rpc(self, method: str, wait: float | None, **kwargs: Any) -> list[dict[str, Any]]:
        limit = None if wait is None else wait + _RPC_SLACK_S
        return list(self._llm.collective_rpc(method, timeout=limit, kwargs=kwargs))


def attach(llm: Any, name: str = "weights", *, address: str | None = None,
           timeout: float = 60.0, check_finite: bool = False,
           shm_dir: str | None = None) -> Engine:  # fmt: skip
    """Join bus `name` in every worker of `llm`, then load its current version.

    Args:
        llm: a ``vllm.LLM`` made with ``worker_extension_cls=WORKER_EXTENSION``.
        name: bus name (the trainer's ``Publisher(..., name=)``).
        address: control address; None: the default address for `name`.
        timeout: how long each worker waits for the trainer's bus to answer (s).
        check_finite: refuse a version holding NaN or inf (costs one pass over it).
        shm_dir: where the trainer's segments are (default $ZMQSYNC_SHM_DIR or /dev/shm).

    Raises:
        UpdateFailed: a worker could not join (``kind="join"``: no trainer within
            `timeout`, ...), or the current version does not fit the engine's model.
        TypeError: `llm` was made without the worker extension.
    """
    if not hasattr(llm, "collective_rpc"):
        raise TypeError(f"attach() takes a vllm.LLM, not {type(llm).__name__}")
    engine = Engine(llm, name, address=address, timeout=timeout, check_finite=check_finite,
                    shm_dir=shm_dir)  # fmt: skip
    try:
        engine.update()
    except UpdateFailed:
        engine.close()
        raise
    return engine
