"""A short soak run (about a minute) with random faults: no hangs, no torn versions, no leaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_short_soak(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run(
        [
            sys.executable,
            "tools/soak.py",
            "--duration",
            "45",
            "--workers",
            "3",
            "--seed",
            "7",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["hangs"] == 0, result
    assert result["torn_or_wrong"] == 0, result
    assert result["leaked_segments"] == 0, result
    assert result["publishes"] > 10 and sum(result["faults"].values()) >= 5, result
    assert run.returncode == 0, run.stderr[-3000:]
