"""``vllm serve`` on a bus: an ASGI middleware that updates the engine between requests.

::

    ZMQSYNC_VLLM_BUS=policy vllm serve MODEL_DIR \\
        --worker-extension-cls zmqsync.integrations.vllm.WorkerExtension \\
        --middleware zmqsync.integrations.vllm.ServerUpdates

It runs in the API server process, beside vLLM's routes, and talks to the engine the
way `Engine` does (``collective_rpc`` to the workers' `WorkerExtension`), through the
server's own engine client. It adds:

* ``POST /zmqsync/update`` (optional JSON body ``{"timeout": s}``): apply the newest
  version; answers ``{"version": v}``, or 409 with ``{"error", "kind", "version"}``
  (`UpdateFailed`). ``GET /zmqsync/status``: the version and each worker's status.
* ``ZMQSYNC_VLLM_EVERY=s``: the same update every `s` seconds, started with the server
  (a failure is logged, once per kind, and the next tick tries again).
* **Requests in flight finish on the weights they started with.** When there is a new
  version, new requests wait at the door; the update waits until the requests already
  in finish (at most ``ZMQSYNC_VLLM_DRAIN_S``, default 300 s: past it the update is
  refused, kind "busy", and the door opens again), pauses the engine's scheduler
  (``pause_generation(mode="wait")``, which also clears the KV and prefix caches), loads
  the version, sets it as the engine's weight version label, resumes, and opens the door.
  Fetching a version into the workers' memory happens before the door closes, so the
  door is closed only for the engine's reload itself.
* **Every response says which version produced it:** ``x-zmqsync-version: v`` (-1: the
  checkpoint's weights). It is exact: no request runs while a version is loaded.

The bus: ``ZMQSYNC_VLLM_BUS`` (its name), ``ZMQSYNC_VLLM_ADDRESS`` (default: the
name's default address), ``ZMQSYNC_SHM_DIR``, ``ZMQSYNC_VLLM_CHECK_FINITE=1``. Each
worker joins at the first update; a join waits at most ``ZMQSYNC_VLLM_JOIN_S`` (default
5 s; the engine serves nothing meanwhile) and is tried again at the next one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ._plan import UpdateFailed, agreed, check, gone, newest, trainer_gone

__all__ = ["SERVER_MIDDLEWARE", "ServerUpdates"]

log = logging.getLogger(__name__)

SERVER_MIDDLEWARE = "zmqsync.integrations.vllm.ServerUpdates"
VERSION_HEADER = b"x-zmqsync-version"
# Routes that run no model: never held at the door, never counted in flight.
_NO_MODEL = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/is_paused"})
_CATCH_UP_S = 10.0
_RPC_SLACK_S = 120.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


class ServerUpdates:
    """ASGI middleware for ``vllm serve --middleware`` (see the module doc)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.name = os.environ.get("ZMQSYNC_VLLM_BUS", "")
        self.address = os.environ.get("ZMQSYNC_VLLM_ADDRESS") or None
        self.check_finite = os.environ.get("ZMQSYNC_VLLM_CHECK_FINITE", "") == "1"
        self.every = _env_float("ZMQSYNC_VLLM_EVERY", 0.0)
        self.drain_s = _env_float("ZMQSYNC_VLLM_DRAIN_S", 300.0)
        self.join_s = _env_float("ZMQSYNC_VLLM_JOIN_S", 5.0)
        self.version = -1
        self.bus_id = ""
        self.workers: list[dict[str, Any]] = []
        self._joined = False
        self._where = f"vllm serve on bus {self.name!r}"
        self._door = asyncio.Event()  # set: requests may enter
        self._door.set()
        self._idle = asyncio.Event()  # set: no request in flight
        self._idle.set()
        self._in_flight = 0
        self._lock = asyncio.Lock()  # one update at a time
        self._ticker: asyncio.Task[None] | None = None
        self._last_failure = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.every > 0 and self._ticker is None and scope["type"] in ("lifespan", "http"):
            self._ticker = asyncio.get_running_loop().create_task(self._tick(scope["app"]))
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/zmqsync/update" and scope["method"] == "POST":
            await self._serve_update(scope, receive, send)
        elif path == "/zmqsync/status":
            await _json(send, 200, self._status())
        elif path in _NO_MODEL:
            await self.app(scope, receive, send)
        else:
            await self._serve_request(scope, receive, send)

    async def _serve_request(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._door.wait()  # closed only while a new version is loaded
        self._in_flight += 1
        self._idle.clear()
        version = str(self.version).encode()

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (VERSION_HEADER, version)]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _serve_update(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            timeout = float(json.loads(body or b"{}").get("timeout", 0.0))
        except (ValueError, AttributeError, TypeError):
            await _json(send, 400, {"error": 'the body must be JSON: {"timeout": seconds}'})
            return
        try:
            version = await self.update(scope["app"].state.engine_client, timeout)
        except UpdateFailed as exc:
            await _json(send, 409, {"error": str(exc), "kind": exc.kind, "version": exc.version})
            return
        await _json(send, 200, {"version": version})

    def _status(self) -> dict[str, Any]:
        return {"bus": self.name, "version": self.version, "in_flight": self._in_flight,
                "workers": self.workers}  # fmt: skip

    async def _tick(self, app: Any) -> None:
        """``ZMQSYNC_VLLM_EVERY``: update every few seconds, for the server's lifetime."""
        while True:
            await asyncio.sleep(self.every)
            client = getattr(app.state, "engine_client", None)
            if client is None:  # the server is still starting
                continue
            try:
                await self.update(client, 0.0)
                self._last_failure = ""
            except UpdateFailed as exc:
                if exc.kind != self._last_failure:
                    log.warning("%s", exc)
                self._last_failure = exc.kind

    async def update(self, client: Any, timeout: float = 0.0) -> int:
        """Apply the newest version (see the module doc); the engine's version after.

        Raises:
            UpdateFailed: as `Engine.update`, and kind "busy" when requests in flight did
                not finish within ``ZMQSYNC_VLLM_DRAIN_S``.
        """
        if not self.name:
            raise UpdateFailed(f"{self._where}: set ZMQSYNC_VLLM_BUS to the bus's name",
                               version=self.version, kind="join")  # fmt: skip
        async with self._lock:
            if not self._joined:
                await self._join(client)
            goal = await self._fetch(client, timeout)
            if goal == (self.bus_id, self.version):
                if gone(self.workers):
                    raise trainer_gone(self._where, self.version)
                return self.version
            self._door.clear()
            try:
                await self._load(client, goal)
            finally:
                self._door.set()
            return self.version

    async def _join(self, client: Any) -> None:
        self.workers = await self._rpc(
            client, "zmqsync_join", self.join_s, name=self.name, address=self.address,
            timeout=self.join_s, check_finite=self.check_finite,
        )  # fmt: skip
        try:
            check(self.workers, self._where, self.version)
        except UpdateFailed:
            await self._rpc(client, "zmqsync_leave", 10.0)  # the next update joins again
            raise
        self._joined = True

    async def _fetch(self, client: Any, timeout: float) -> tuple[str, int]:
        statuses = await self._rpc(client, "zmqsync_fetch", timeout, timeout=timeout)
        check(statuses, self._where, self.version)
        goal = agreed(statuses)
        if goal is None:
            _, version = newest(statuses)
            statuses = await self._rpc(client, "zmqsync_fetch", _CATCH_UP_S,
                                       timeout=_CATCH_UP_S, at_least=version)  # fmt: skip
            check(statuses, self._where, self.version)
            goal = agreed(statuses)
            if goal is None:
                raise UpdateFailed(f"{self._where}: workers hold different versions",
                                   version=self.version, kind="disagree")  # fmt: skip
        self.workers = statuses
        return goal

    async def _load(self, client: Any, goal: tuple[str, int]) -> None:
        """With the door closed: drain, pause, load, label, resume."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.drain_s)
        except asyncio.TimeoutError:
            raise UpdateFailed(
                f"{self._where}: {self._in_flight} request(s) still running after "
                f"{self.drain_s:g} s; version {goal[1]} was not loaded (raise "
                "ZMQSYNC_VLLM_DRAIN_S, or update when the server is less busy)",
                version=self.version,
                kind="busy",
            ) from None
        await client.pause_generation(mode="wait")  # nothing runs; clears KV/prefix caches
        try:
            self.workers = await self._rpc(client, "zmqsync_load", 0.0, bus=goal[0],
                                           version=goal[1])  # fmt: skip
            check(self.workers, self._where, self.version)
            self.bus_id, self.version = goal
            await client.reset_prefix_cache()
            await client.update_weight_version(str(self.version))
            log.info("%s: version %d loaded", self._where, self.version)
        finally:
            await client.resume_generation()

    async def _rpc(self, client: Any, method: str, wait: float, **kwargs: Any) -> list[Any]:
        results = await client.collective_rpc(method, timeout=wait + _RPC_SLACK_S, kwargs=kwargs)
        return list(results)


async def _json(send: Send, status: int, content: dict[str, Any]) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
