"""Smoke test of `zmqsync bench`: a tiny quick grid, end to end, no timing asserts.

It runs the real harness in a subprocess (real worker processes, the raw ZeroMQ, memcpy,
N+1-copies and naive baselines, torchrl when it is installed, the late join) and checks
the files it writes and that every row carries numbers. Plots are not drawn here, so the
suite does not need matplotlib; `tools/bench.py` draws them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zmqsync import _bench

ROOT = Path(__file__).resolve().parent.parent
HAS_TORCHRL = importlib.util.find_spec("torchrl") is not None

pytestmark = pytest.mark.timeout(150)


def _number(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x >= 0


def test_quick_grid_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "zmqsync", "bench", "--quick",
        "--workers", "1,2", "--sizes", "4K,many",
        "--iters-scale", "0.05", "--min-iters", "3", "--phase-seconds", "1",
        "--late-join", "4M", "--torchrl-max-workers", "1",
        "--timeout", "60", "--out", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=140, env=dict(os.environ)
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "targets" in proc.stdout and "late join" in proc.stdout

    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {(r["n"], r["size"], r["mode"]) for r in rows} == {
        (n, s, m) for n in (1, 2) for s in ("4K", "many") for m in ("copy", "alias")
    }
    for r in rows:
        where = (r["n"], r["size"], r["mode"])
        assert r["status"] == "ok", where
        for key in ("zmqsync_p50", "zmqsync_p99", "raw_p50", "memcpy1_p50", "memcpyd_p50",
                    "naive_p50", "x_raw", "x_floor", "gbps", "segment_bytes"):  # fmt: skip
            assert _number(r[key]), (where, key, r[key])
        for key in ("pss_delta", "seg_pss", "extra"):  # differences: may be slightly < 0
            assert isinstance(r[key], int | float) and math.isfinite(r[key]), (where, key)
        assert r["iters"] >= 3 and len(r["samples"]["zmqsync"]) == r["iters"]
        if r["mode"] == "copy":
            assert _number(r["copyn_p50"]), where
        assert r["tensors"] == (2000 if r["size"] == "many" else 8)
        if HAS_TORCHRL and r["n"] == 1:
            assert _number(r["torchrl_p50"]) and _number(r["torchrl_own_p50"]), where
        elif HAS_TORCHRL:
            assert r["torchrl_status"] == ""  # N=2 is above --torchrl-max-workers

    late = data["late_join"]
    assert late["status"] == "ok" and _number(late["alias"]["p50"]) and _number(late["copy"]["p50"])
    assert {t["id"] for t in data["targets"]} == {
        "fixed cost",
        "big alias",
        "copy floor",
        "vs torchrl",
        "alias memory",
        "late join",
    }
    assert data["machine"]["nproc"] >= 1 and data["machine"]["torch"]

    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert all(float(row["zmqsync_p50"]) > 0 for row in table)

    # The harness cleans up after itself: no segment or worker left behind.
    assert not [p for p in Path("/dev/shm").glob("zmqsync-bench-*")]

    # The markdown report renders from the file alone.
    md = _bench.markdown_report(_bench.load_results(out))
    assert "| 1 | 4 KB | copy |" in md and "| late join |" in md


def test_plan_skips_points_that_do_not_fit():
    cfg = _bench.BenchConfig(mem_budget=2 * _bench.GiB)
    one_gb = _bench._padded(_bench.SIZES["1G"])
    assert _bench._skip_reason(cfg, "alias", 8, one_gb).startswith("skipped: needs")
    assert _bench._skip_reason(cfg, "copy", 1, 4096) == ""
    half_gb = _bench._padded(_bench.SIZES["512M"])
    assert "per publish" in _bench._skip_reason(
        _bench.BenchConfig(mem_budget=64 * _bench.GiB), "naive", 16, half_gb
    )


def test_arguments_and_quick_config():
    import argparse

    parser = argparse.ArgumentParser()
    _bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--workers", "1,3", "--sizes", "4K,many", "--no-naive"])
    cfg = _bench.config_from_args(args)
    assert cfg.workers == (1, 3) and cfg.sizes == ("4K", "many") and not cfg.naive and cfg.quick
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "5G"])
