"""The test's side of `vllm_driver`: start an engine in the vLLM venv, send commands.

Every wait has a deadline; the engine's output (vLLM logs) goes to a file whose tail is
in every error, and the process is killed when the object is closed.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.helpers.vllm_env import ROOT, VllmEnv

PREFIX = "@zv "
# `vllm_probe.engine_digests` travels to the workers as a function: vLLM sends callables
# only with pickle allowed (the test's own engine, fed by the test's own process)
_PROBE_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
START_TIMEOUT_S = 600.0  # ~25 s here when idle; far more with other work on 2 cores


class EngineProc:
    """A `tests.helpers.vllm_driver` process: `call(op, **fields)` -> its reply."""

    def __init__(self, env: VllmEnv, model: Path, log: Path, tp: int = 1, **extra_env: str) -> None:
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(env.python), "-m", "tests.helpers.vllm_driver", str(model), str(tp)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._out, text=True,
            env=env.env(**{**_PROBE_ENV, **extra_env}), cwd=ROOT,
        )  # fmt: skip
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next(START_TIMEOUT_S, "the engine to start")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._replies.put(json.loads(line[len(PREFIX) :]))
            else:
                self._out.write(line)
                self._out.flush()

    def _next(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no answer from the vLLM engine within {timeout} s ({what}; "
                f"rc={self.proc.poll()}); its log ends:\n{self.tail()}"
            ) from None

    def tail(self, n: int = 60) -> str:
        self._out.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def call(self, op: str, *, reply_s: float = 180.0, **fields: Any) -> dict[str, Any]:
        """Send one command with its `fields` (``timeout=`` among them goes to the engine:
        ``update(timeout=...)``); its reply within `reply_s` (a driver error raises
        AssertionError)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._next(reply_s, op)
        if answer.get("kind") == "driver":
            raise AssertionError(f"{op}: {answer['error']}\n{answer.get('trace', '')}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("quit", reply_s=60)
                self.proc.wait(60)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._reader.join(10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._out.close()
