"""The trainer loop of the harness (`python -m tools.bench trainer`), run small: every
way trains, publishes and reports, with real worker processes (timings are reported,
never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tools.bench.grid.trainer import WAYS, model_for, targets


def test_the_mlp_has_the_size_asked_for():
    model = model_for(64)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    assert abs(nbytes - 64 * 2**20) < 4.2 * 2**20


@pytest.mark.timeout(600)
def test_every_way_trains_publishes_and_reports(tmp_path):
    out = tmp_path / "bench"
    done = subprocess.run(
        [sys.executable, "-m", "tools.bench", "trainer", "--no-plot", "--trainer-sizes", "4",
         "--trainer-workers", "2", "--trainer-repeats", "1", "--no-trainer-costs",
         "--out", str(out), "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=560,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads((out / "trainer.json").read_text())
    assert [r["way"] for r in records] == list(WAYS)
    for r in records:
        assert r["status"] == "ok", r
        assert r["steps_per_s"] > 0 and r["batch"] >= 16
        if r["way"] != "none":
            assert r["blocked_p50"] >= 0 and r["to_last_ack_p50"] > 0
    assert [what.split(",")[0] for what, _, _ in targets(records)] == [
        "4 MB blocked",
        "4 MB steps/s",
    ]
