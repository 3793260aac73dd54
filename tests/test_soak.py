"""A short soak run (about a minute) with random faults: no hangs, no torn versions, no leaks.

It asserts what the soak exists for and nothing about speed: on a loaded machine the
trainer publishes fewer versions in the same time, which is no failure. It only asks
that faults were injected and that versions went through (else the zeros prove nothing).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.timeout(480)  # up to 180 s for the trainer to start on a loaded host, 45 s of faults
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
        timeout=450,
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    # no hang: no publish overran its deadline, the trainer never went silent, and after
    # the faults stopped every live worker reached the newest version (none was lost)
    assert result["hangs"] == 0 and result["behind_at_end"] == [], result
    # no torn or wrong version: every applied version matched its checksum, and versions
    # never went back within one bus
    assert result["torn_or_wrong"] == 0, result
    # no leak: nothing left in the shm dir after the clean shutdown and one `zmqsync gc`
    assert result["leaked_segments"] == 0, result
    # the run did what a soak is for: faults happened and versions were applied anyway
    assert sum(result["faults"].values()) >= 5, result
    assert result["publishes"] >= 1 and result["applied_and_verified"] >= 1, (
        "the soak saw no version published and applied, so its zeros prove nothing "
        f"(did the trainer start within the run?): {result}"
    )
    assert run.returncode == 0, run.stderr[-3000:]
