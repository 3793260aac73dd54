"""The vLLM adapter's logic without vLLM: decisions, checkpoint checks, the server's door.

These run in the project's venv in milliseconds; tests/test_vllm*.py run the real engine.
"""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
import torch

from zmqsync.integrations.vllm import UpdateFailed
from zmqsync.integrations.vllm._checkpoint import checkpoint_shapes, mismatch, not_finite
from zmqsync.integrations.vllm._plan import agreed, check, gone, newest
from zmqsync.integrations.vllm._server import ServerUpdates


def status(**fields):
    base = {"rank": 0, "version": 0, "bus": "b", "fetched": 0, "fetched_bus": "b",
            "connected": True, "stopped": False, "error": "", "kind": ""}  # fmt: skip
    return {**base, **fields}


def test_decisions_over_worker_statuses():
    assert agreed([status(fetched=3), status(rank=1, fetched=3)]) == ("b", 3)
    assert agreed([status(fetched=3), status(rank=1, fetched=4)]) is None
    assert newest([status(fetched=3), status(rank=1, fetched=4)]) == ("b", 4)
    assert not gone([status()]) and gone([status(), status(rank=1, connected=False)])
    check([status(), status(rank=1)], "here", 2)
    with pytest.raises(UpdateFailed) as caught:
        check([status(error="x", kind="disagree"), status(rank=1, error="names", kind="mismatch")],
              "engine on bus 'p'", 2)  # fmt: skip
    assert caught.value.kind == "mismatch" and caught.value.version == 2
    assert str(caught.value) == (
        "engine on bus 'p': engine worker 1: names; the engine keeps version 2"
    )
    assert isinstance(caught.value, RuntimeError)


def _safetensors(path, tensors: dict[str, tuple[int, ...]]) -> None:
    """A safetensors file written by hand (the header is JSON; data zeros)."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_a_version_is_checked_against_the_checkpoint(tmp_path):
    _safetensors(tmp_path / "model-1.safetensors", {"a.weight": (4, 2)})
    _safetensors(tmp_path / "model-2.safetensors", {"b.weight": (3,)})
    expected = checkpoint_shapes(str(tmp_path))
    assert expected == {"a.weight": (4, 2), "b.weight": (3,)}
    assert checkpoint_shapes(str(tmp_path / "nowhere")) is None
    good = {"a.weight": torch.zeros(4, 2), "b.weight": torch.zeros(3)}
    assert mismatch(good, expected) == ""
    bad = {"a.weight": torch.zeros(2, 4), "c.weight": torch.zeros(3)}
    assert mismatch(bad, expected) == (
        "1 name(s) the engine's model does not have: c.weight; 1 of its tensor(s) not "
        "published: b.weight; 1 shape(s) differ: a.weight (2, 4) (the engine's is (4, 2))"
    )
    good["b.weight"][1] = float("inf")
    assert not_finite(good) == ["b.weight"]


class FakeEngine:
    """An engine client: versions appear when the test says; the load waits for a gate."""

    def __init__(self) -> None:
        self.newest = 0
        self.loaded: list[int] = []
        self.gate = asyncio.Event()
        self.calls: list[str] = []

    async def collective_rpc(self, method, timeout=None, kwargs=None):
        self.calls.append(method)
        if method == "zmqsync_load":
            await self.gate.wait()
            self.loaded.append(kwargs["version"])
        version = self.loaded[-1] if self.loaded else -1
        return [status(version=version, fetched=self.newest)]

    async def pause_generation(self, mode):
        self.calls.append(f"pause:{mode}")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self):
        return True

    async def update_weight_version(self, version):
        self.calls.append(f"label:{version}")


def test_the_server_door_lets_requests_in_flight_finish_and_stamps_versions(monkeypatch):
    monkeypatch.setenv("ZMQSYNC_VLLM_BUS", "policy")

    async def scenario():
        engine = FakeEngine()
        released = asyncio.Event()

        async def app(scope, receive, send):  # a slow model route
            if scope["path"] == "/slow":
                await released.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        state = type("State", (), {"engine_client": engine})()
        middleware = ServerUpdates(app)
        app_obj = type("App", (), {"state": state})()

        async def call(path, method="GET", body=b""):
            sent = []

            async def receive():
                return {"type": "http.request", "body": body, "more_body": False}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "path": path, "method": method, "app": app_obj}
            await middleware(scope, receive, send)
            headers = dict(sent[0]["headers"])
            return sent[0]["status"], headers, sent[1]["body"]

        engine.gate.set()
        assert (await call("/zmqsync/update", "POST"))[2] == b'{"version": 0}'
        engine.gate.clear()
        slow = asyncio.ensure_future(call("/slow"))  # in flight, on version 0
        await asyncio.sleep(0.01)
        engine.newest = 1
        update = asyncio.ensure_future(call("/zmqsync/update", "POST"))
        await asyncio.sleep(0.01)
        late = asyncio.ensure_future(call("/fast"))  # arrives while the door is closed
        await asyncio.sleep(0.01)
        assert not late.done() and not update.done() and engine.loaded == [0]
        released.set()  # the request in flight finishes; then the load runs
        status_, headers, _ = await slow
        assert headers[b"x-zmqsync-version"] == b"0"
        await asyncio.sleep(0.01)
        assert engine.calls[-2:] == ["pause:wait", "zmqsync_load"] and not late.done()
        engine.gate.set()
        assert (await update)[2] == b'{"version": 1}'
        assert (await late)[1][b"x-zmqsync-version"] == b"1"
        assert engine.calls[-2:] == ["label:1", "resume"]

    asyncio.run(scenario())


def test_the_vllm_venv_is_built_by_one_process_at_a_time(tmp_path):
    from tests.helpers.vllm_env import _locked

    lock = tmp_path / "venv.lock"
    with _locked(lock, 5.0):
        with pytest.raises(RuntimeError, match="held .* for 0 s"), _locked(lock, 0.2):
            pass
    with _locked(lock, 0.2):  # released: the next one gets it at once
        pass


def test_the_server_updates_by_itself_every_few_seconds(monkeypatch):
    monkeypatch.setenv("ZMQSYNC_VLLM_BUS", "policy")
    monkeypatch.setenv("ZMQSYNC_VLLM_EVERY", "0.01")

    async def scenario():
        engine = FakeEngine()
        engine.gate.set()

        async def app(scope, receive, send):
            return None

        middleware = ServerUpdates(app)
        app_obj = type("App", (), {"state": type("State", (), {"engine_client": engine})()})()
        await middleware({"type": "lifespan", "app": app_obj}, None, None)
        for _ in range(500):
            await asyncio.sleep(0.01)
            if middleware.version == 0:
                break
        engine.newest = 3
        for _ in range(500):
            await asyncio.sleep(0.01)
            if middleware.version == 3:
                break
        ticker = middleware._ticker
        assert ticker is not None
        ticker.cancel()
        return middleware.version, engine.calls

    version, calls = asyncio.run(scenario())
    assert version == 3 and calls[0] == "zmqsync_join" and "label:3" in calls
