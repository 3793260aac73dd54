"""A tensor-parallel vLLM engine (2 CPU workers) on a bus: each worker takes its slices.

vLLM's CPU backend binds each rank's threads to cores of its own and keeps one core
free by default; on a 2-core machine with one NUMA node it refuses TP=2 ("Not enough
allowed NUMA nodes") unless told where: ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (rank 0 on
core 0, rank 1 on core 1) and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``. Then it runs, and:

* every worker joins the bus itself and loads its own slices (the qkv and gate/up
  fusions of its heads and columns, the rows of o_proj and down_proj, its half of the
  vocabulary), read back through each worker's kernels;
* after updates, the greedy tokens are those the same TP=2 engine gave fresh from the
  checkpoint (TP=2 sums in another order than TP=1, so that is the reference).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import zmqsync
from tests.helpers import vllm_env
from tests.helpers.vllm_engine import EngineProc
from tests.helpers.vllm_model import state_dict
from tests.helpers.vllm_probe import expected_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

FINAL = 7
PROMPTS = ["the quick brown fox", "once upon a time there"]
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _vllm_segments() -> set[Path]:
    """vLLM's own shared memory between TP ranks (``vllm_dist_*``), which its CPU
    workers leave in /dev/shm when they exit."""
    return set(Path("/dev/shm").glob("vllm_dist_*"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    before = _vllm_segments()
    try:
        yield from _engine(tmp_path_factory)
    finally:
        for segment in _vllm_segments() - before:  # ours: the engine is gone by now
            segment.unlink(missing_ok=True)


def _engine(tmp_path_factory):
    venv = vllm_env.ensure()
    model = tmp_path_factory.mktemp("tiny-llama")
    vllm_env.tiny_model(venv, model, FINAL)
    log = tmp_path_factory.mktemp("vllm-tp-log") / "engine.log"
    proc = EngineProc(venv, model, log, tp=2, **BIND)
    try:
        proc.fresh = proc.call("generate", prompts=PROMPTS)["tokens"]
        yield proc
    finally:
        proc.close()


def test_each_tensor_parallel_worker_loads_its_slices(engine, name, bus_dirs):
    _, shm = bus_dirs
    with zmqsync.Publisher(state_dict(1), name=name, shm_dir=str(shm)) as pub:
        try:
            assert engine.call("attach", name=name, address=pub.address, shm_dir=str(shm),
                               timeout=30.0) == {"version": 0}  # fmt: skip
            ranks = engine.call("tensors")["digests"]
            assert len(ranks) == 2
            for rank, digests in enumerate(ranks):
                assert digests == expected_digests(state_dict(1), rank, 2)
            assert engine.call("generate", prompts=PROMPTS)["tokens"] != engine.fresh
            pub.publish(weights=state_dict(FINAL), max_lag=None)
            assert engine.call("update", timeout=10.0) == {"version": 1}
            for rank, digests in enumerate(engine.call("tensors")["digests"]):
                assert digests == expected_digests(state_dict(FINAL), rank, 2)
            assert engine.call("generate", prompts=PROMPTS)["tokens"] == engine.fresh
        finally:
            engine.call("detach")
