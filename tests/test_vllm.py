"""A real vLLM engine (CPU build) follows a bus: tokens, tensors, failures.

The engine runs in a venv of its own (`tests.helpers.vllm_env`: built once, cached under
~/.cache/zmqsync, ~2 minutes the first time), on a tiny Llama made here
(`tests.helpers.vllm_model`), in one process for the whole module
(`tests.helpers.vllm_driver`; ~25-60 s to start). The trainer is this test process: a
`zmqsync.Publisher` of the checkpoint's names.

The engine starts from the checkpoint of seed `FINAL`, and before anything else records
its greedy tokens: those of a fresh engine loaded from disk. Tests then attach it to
buses that publish other seeds, and it must come back to exactly those tokens (and
tensors) when a bus publishes seed `FINAL` again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import zmqsync
from tests.helpers import vllm_env
from tests.helpers.vllm_engine import EngineProc
from tests.helpers.vllm_model import state_dict
from tests.helpers.vllm_probe import expected_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

FINAL = 7  # the seed of the checkpoint the engine starts from
PROMPTS = ["the quick brown fox", "once upon a time there", "weights move from a trainer"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> vllm_env.VllmEnv:
    return vllm_env.ensure()


@pytest.fixture(scope="module")
def model_dir(venv, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    vllm_env.tiny_model(venv, path, FINAL)
    return path


@pytest.fixture(scope="module")
def engine(venv, model_dir, tmp_path_factory):
    """One engine for the module, and its greedy tokens fresh from the checkpoint."""
    log = tmp_path_factory.mktemp("vllm-log") / "engine.log"
    proc = EngineProc(venv, model_dir, log)
    try:
        proc.fresh = proc.call("generate", prompts=PROMPTS)["tokens"]
        yield proc
    finally:
        proc.close()


@pytest.fixture
def bus(engine, name, bus_dirs):
    """publish(seed) on a bus named `name`; attach(**options) the engine to it; the
    engine leaves the bus after the test."""
    _, shm = bus_dirs
    pubs: list[zmqsync.Publisher] = []

    class Bus:
        def start(self, weights, **options):
            pub = zmqsync.Publisher(weights, name=name, shm_dir=str(shm), **options)
            pubs.append(pub.start())
            return pub

        def attach(self, **options):
            pub = pubs[-1]
            return engine.call("attach", name=name, address=pub.address, shm_dir=str(shm),
                               timeout=30.0, **options)  # fmt: skip

    try:
        yield Bus()
    finally:
        engine.call("detach")
        for pub in pubs:
            pub.close()


def digests(engine) -> dict[str, str]:
    """What the engine's only worker computes with."""
    (only,) = engine.call("tensors")["digests"]
    return only


def test_greedy_tokens_after_updates_equal_a_fresh_engines(engine, bus):
    pub = bus.start(state_dict(1))
    assert bus.attach() == {"version": 0}
    seen = [engine.call("generate", prompts=PROMPTS)["tokens"]]
    for version, seed in enumerate([2, 3, FINAL], start=1):
        pub.publish(weights=state_dict(seed), max_lag=None)
        assert engine.call("update", timeout=10.0) == {"version": version}
        out = engine.call("generate", prompts=PROMPTS)
        assert out["weight_versions"] == [[str(version)]] * len(PROMPTS)  # vLLM's own label
        seen.append(out["tokens"])
    assert seen[-1] == engine.fresh  # after 3 updates: a fresh engine's tokens, exactly
    assert all(tokens != engine.fresh for tokens in seen[:-1])  # the weights did change


def test_engine_tensors_equal_the_published_ones_after_every_update(engine, bus):
    pub = bus.start(state_dict(11))
    bus.attach()
    assert digests(engine) == expected_digests(state_dict(11))
    for version, seed in enumerate([12, 13], start=1):
        pub.publish(weights=state_dict(seed), max_lag=None)
        assert engine.call("update", timeout=10.0) == {"version": version}
        assert digests(engine) == expected_digests(state_dict(seed))
    # no new version: update() returns the engine's, and nothing moves
    assert engine.call("update") == {"version": 2}
    assert digests(engine) == expected_digests(state_dict(13))


def test_a_version_that_does_not_fit_is_refused_and_the_engine_keeps_its_own(engine, bus):
    pub = bus.start(state_dict(21))
    bus.attach()
    before = digests(engine)
    pub.close()
    renamed = state_dict(22)
    renamed["model.layers.0.mlp.gate.weight"] = renamed.pop("model.layers.0.mlp.gate_proj.weight")
    bus.start(renamed)  # the same bus name: a trainer restarted with another model
    end = time.monotonic() + 60
    failed = engine.call("update", timeout=5.0)
    while failed.get("kind") in (None, "trainer") and time.monotonic() < end:
        time.sleep(0.2)  # until the worker re-joined the restarted bus
        failed = engine.call("update", timeout=5.0)
    assert failed["kind"] == "mismatch", failed
    assert "model.layers.0.mlp.gate.weight" in failed["error"]
    assert "model.layers.0.mlp.gate_proj.weight" in failed["error"]
    assert failed["version"] == 0
    assert digests(engine) == before
    assert engine.call("generate", prompts=PROMPTS)["tokens"] != engine.fresh  # still 21's


def test_a_wrong_shape_is_refused_at_attach(engine, bus):
    before = digests(engine)
    wrong = state_dict(31)
    wrong["lm_head.weight"] = torch.zeros(1024, 256, dtype=torch.bfloat16)
    bus.start(wrong)
    failed = bus.attach()
    assert failed["kind"] == "mismatch" and "lm_head.weight (1024, 256)" in failed["error"]
    assert digests(engine) == before


def test_a_version_with_nan_is_refused_with_check_finite(engine, bus):
    pub = bus.start(state_dict(41))
    bus.attach(check_finite=True)
    bad = state_dict(42)
    bad["model.norm.weight"][3] = float("nan")
    pub.publish(weights=bad, max_lag=None)
    failed = engine.call("update", timeout=10.0)
    assert failed["kind"] == "not-finite" and "model.norm.weight" in failed["error"]
    assert failed["version"] == 0
    assert digests(engine) == expected_digests(state_dict(41))
    pub.publish(weights=state_dict(FINAL), max_lag=None)  # the next good one goes in
    assert engine.call("update", timeout=10.0) == {"version": 2}
    assert engine.call("generate", prompts=PROMPTS)["tokens"] == engine.fresh


def test_a_trainer_that_dies_is_reported_and_the_engine_keeps_serving(engine, bus, name):
    trainer = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.vllm_trainer", name, str(FINAL)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=vllm_env.ROOT,
    )  # fmt: skip
    try:
        assert trainer.stdout is not None
        address = trainer.stdout.readline().strip()
        assert address.startswith("ipc://"), address
        answer = engine.call("attach", name=name, address=address,
                             shm_dir=os.environ["ZMQSYNC_SHM_DIR"], timeout=30.0)  # fmt: skip
        assert answer == {"version": 0}
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(30)
        end = time.monotonic() + 60
        while "error" not in (answer := engine.call("update")) and time.monotonic() < end:
            time.sleep(0.5)  # the worker notices silence after ~6 missed heartbeats (3 s)
        assert answer.get("kind") == "trainer", answer
        assert "no trainer answers" in answer["error"] and answer["version"] == 0
        assert engine.call("generate", prompts=PROMPTS)["tokens"] == engine.fresh
    finally:
        trainer.kill()
        trainer.wait(30)
        for pipe in (trainer.stdin, trainer.stdout):
            if pipe is not None:
                pipe.close()
        for leftover in os.listdir(os.environ["ZMQSYNC_SHM_DIR"]):  # SIGKILL leaks them
            os.unlink(os.path.join(os.environ["ZMQSYNC_SHM_DIR"], leftover))


def _doc_block(after: str) -> str:
    """The first ```python block after the line that names `after` in docs/vllm.md."""
    text = (vllm_env.ROOT / "docs" / "vllm.md").read_text()
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start : text.index("```", start)]


def test_the_docs_example_runs_as_written(venv, model_dir, tmp_path):
    for script in ("trainer.py", "engine.py"):
        (tmp_path / script).write_text(_doc_block(f"`{script}`"))
    env = venv.env()
    engine = subprocess.Popen(
        [str(venv.python), "engine.py", str(model_dir)], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    trainer = subprocess.run(
        [str(venv.python), "trainer.py", str(model_dir)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    try:
        out, _ = engine.communicate(timeout=300)
    finally:
        engine.kill()
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    assert trainer.stdout.split() == [w for v in range(1, 6) for w in ("published", str(v))]
    lines = [line for line in out.splitlines() if re.match(r"v\d+: |stopping: ", line)]
    versions = [int(line[1:].split(":")[0]) for line in lines if line[:1] == "v"]
    assert versions[0] == 0 and versions[-1] == 5 and versions == sorted(set(versions)), lines
    for line in lines[:-1]:
        assert line.endswith(f"(sampled by {line[1:].split(':')[0]})"), line
    assert lines[-1] == "stopping: trainer", out[-3000:]
    assert engine.returncode == 0
