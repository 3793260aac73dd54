"""The machine the numbers are measured on, and the memory it has free now.

A latency table means little without the CPU, the memory, the library versions and the
commit it came from, so every results.json carries this description. Memory is read
from /proc/meminfo rather than through a dependency: the planner asks for it before
every phase, to skip what no longer fits.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from importlib import metadata
from typing import Any

from .config import ROOT


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes; empty where there is none."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


def available_memory() -> int | None:
    """MemAvailable now (the pool and anything else on the host already counted)."""
    return meminfo().get("MemAvailable")


def torchrl_available() -> str:
    """'' when torchrl can be used here, else why not."""
    try:
        metadata.version("torchrl")
    except metadata.PackageNotFoundError:
        from zmqsync._extras import install_hint

        return f"torchrl is not installed: {install_hint('torchrl')}"
    return ""


def _git_revision() -> str:
    """HEAD, and the zmqsync files that differ from it (a dirty tree is worth saying)."""
    git = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "zmqsync"], cwd=ROOT, capture_output=True, text=True
        ).stdout.split("\n")
        changed = sorted(line[3:] for line in dirty if line.strip())
        git = head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    return git


def describe_machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch
    import zmq

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = meminfo()
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "git": os.environ.get("ZMQSYNC_BENCH_REVISION") or _git_revision(),
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total": mem.get("MemTotal"),
        "mem_available": mem.get("MemAvailable"),
        "shm_size": shm.f_blocks * shm.f_frsize if shm else None,
        "loadavg_start": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "tensordict": _version("tensordict"),
        "torchrl": _version("torchrl"),
        "msgpack": _version("msgpack"),
        "zmqsync": _version("zmqsync"),
    }
