"""Smoke test of the harness (`python -m tools.bench grid`): a tiny quick grid, end to
end, no timing asserts; and of `zmqsync bench`, the package's small quick check.

It runs the real harness in a subprocess (real worker processes, the raw ZeroMQ, memcpy,
N+1-copies and naive baselines, torchrl when it is installed, the late join) and checks
the files it writes and that every row carries numbers. Plots are not drawn here
(``--no-plot``), so the suite does not need matplotlib.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import grid as _bench
from tools.bench.grid import worker as _bench_worker
from tools.bench.grid.config import ROOT as BENCH_ROOT
from tools.bench.grid.plan import padded_bytes, skip_reason
from tools.bench.grid.units import GiB

ROOT = Path(__file__).resolve().parent.parent
HAS_TORCHRL = importlib.util.find_spec("torchrl") is not None

pytestmark = pytest.mark.timeout(150)


def _number(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x >= 0


def test_quick_grid_smoke(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "tools.bench", "grid", "--quick", "--no-plot",
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
        "LLM-shaped",
    }
    assert data["machine"]["nproc"] >= 1 and data["machine"]["torch"]

    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    assert all(float(row["zmqsync_p50"]) > 0 for row in table)

    # The harness cleans up after itself: no segment or worker left behind.
    # none left by a process that is gone (a bench someone else runs meanwhile has its own)
    assert not [
        p
        for p in Path("/dev/shm").glob("zmqsync-bench-*")
        if not Path(f"/proc/{p.name.split('-')[2]}").exists()
    ]

    # The markdown report renders from the file alone.
    md = _bench.markdown_report(_bench.load_results(out))
    assert "| 1 | 4 KB | copy |" in md and "| late join |" in md


def test_plan_skips_points_that_do_not_fit():
    cfg = _bench.BenchConfig(mem_budget=2 * GiB)
    one_gb = padded_bytes(_bench.SIZES["1G"])
    assert skip_reason(cfg, "alias", 8, one_gb).startswith("skipped: needs")
    assert skip_reason(cfg, "copy", 1, 4096) == ""
    half_gb = padded_bytes(_bench.SIZES["512M"])
    assert "per publish" in skip_reason(
        _bench.BenchConfig(mem_budget=64 * GiB), "naive", 16, half_gb
    )


def test_torchrl_phase_skips_a_worker_count_whose_receivers_do_not_fit(tmp_path):
    """One receiver process per worker, each an interpreter with torch and torchrl: a
    count whose processes alone exceed the memory available is skipped, with why."""
    from tools.bench.grid.results import Results, Row
    from tools.bench.grid.torchrl_baseline import RECEIVER_BYTES, TorchrlBaseline

    cfg = _bench.BenchConfig(mem_budget=64 * GiB, sizes=("4K",))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    too_many = memory // RECEIVER_BYTES + 1
    results = Results(config={}, machine={})
    results.rows = [Row(n=n, size="4K", label="4 KB", mode="alias") for n in (1, too_many)]
    baseline = TorchrlBaseline(cfg, results, dict(os.environ), tmp_path)
    assert baseline.plan(too_many) == []
    skipped = [r for r in results.rows if r.n == too_many]
    reasons = [r.torchrl_status for r in skipped] + [r.torchrl_own_status for r in skipped]
    assert all("receiver processes need" in why for why in reasons), reasons
    assert [p["variant"] for p in baseline.plan(1)] == ["collector", "own"]


def test_torchrl_phase_counts_a_model_per_receiver(tmp_path):
    """Each torchrl receiver builds its own model: a point whose receivers' processes
    fit but whose models do not is skipped with why (a full grid's LLM-shaped point at
    4 workers was ended by the OOM killer before this was counted)."""
    from tools.bench.grid.machine import meminfo
    from tools.bench.grid.plan import SAFETY
    from tools.bench.grid.results import Results, Row
    from tools.bench.grid.torchrl_baseline import RECEIVER_BYTES, TorchrlBaseline

    llm = padded_bytes(_bench.SIZES["llm"])
    room = meminfo()["MemAvailable"] - SAFETY
    margin = 2 * GiB  # memory that comes and goes while the test runs
    n = next((k for k in range(1, 256) if k * RECEIVER_BYTES + (1 + k) * llm > room + margin), None)
    if n is None or n * RECEIVER_BYTES > room - margin:
        pytest.skip("no worker count fits its receivers but not their models here")
    cfg = _bench.BenchConfig(mem_budget=1024 * GiB, sizes=("llm",))
    results = Results(config={}, machine={})
    results.rows = [Row(n=n, size="llm", label="LLM", mode="alias")]
    assert TorchrlBaseline(cfg, results, dict(os.environ), tmp_path).plan(n) == []
    assert "receivers with a model each need" in results.rows[0].torchrl_status


def test_workers_run_from_the_checkout_the_harness_imports():
    # Workers get ROOT as cwd and first on PYTHONPATH: it must hold this very package.
    assert BENCH_ROOT == ROOT
    assert (BENCH_ROOT / "zmqsync" / "__init__.py").is_file()
    assert (BENCH_ROOT / "tools" / "bench" / "grid" / "worker.py").is_file()


def test_source_digest_changes_with_every_library_file(tmp_path, monkeypatch):
    # A run refuses to mix two versions of the library (SourceChanged): the digest that
    # the harness and every worker compare must change when any library file changes,
    # in a subpackage as well as at the top: every .py of the checkout's zmqsync/.
    copy = tmp_path / "zmqsync"
    shutil.copytree(
        ROOT / "zmqsync", copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c")
    )
    worker = tmp_path / "tools" / "bench" / "grid" / "worker.py"
    monkeypatch.setattr(_bench_worker, "__file__", str(worker))
    library = sorted(copy.rglob("*.py"))
    assert any(p.parent != copy for p in library)  # subpackages are in the walk
    before = _bench_worker.source_digest()
    for path in library:
        text = path.read_bytes()
        path.write_bytes(text + b"\n# edited during a run\n")
        assert _bench_worker.source_digest() != before, path.relative_to(copy)
        path.write_bytes(text)
    assert _bench_worker.source_digest() == before


def test_the_library_and_the_parser_stay_lean():
    # `import zmqsync` and `zmqsync --help` import nothing of the harness, and the
    # harness's parser imports none of the command line's or the extras' heavy modules.
    code = (
        "import argparse, sys\n"
        "import zmqsync, zmqsync.cli\n"
        "zmqsync.cli._parser() if hasattr(zmqsync.cli, '_parser') else None\n"
        "assert not [m for m in sys.modules if m.startswith('tools')]\n"
        "from tools.bench import grid\n"
        "grid.add_arguments(argparse.ArgumentParser())\n"
        "heavy = {'rich', 'matplotlib', 'torchrl'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_arguments_and_quick_config():
    import argparse

    parser = argparse.ArgumentParser()
    _bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--workers", "1,3", "--sizes", "4K,many", "--no-naive"])
    cfg = _bench.config_from_args(args)
    assert cfg.workers == (1, 3) and cfg.sizes == ("4K", "many") and not cfg.naive and cfg.quick
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "5G"])


def test_the_quick_check_publishes_to_its_workers():
    # `zmqsync bench`: the package's small check, end to end, in a subprocess.
    cmd = [sys.executable, "-m", "zmqsync", "bench", "--workers", "1", "--size-mb", "0.1",
           "--publishes", "3", "--timeout", "60"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "publish p50" in proc.stdout and "memcpy  p50" in proc.stdout


def test_every_scenario_resolves_to_a_main():
    # `python -m tools.bench SCENARIO [QUESTION]`: every entry imports and is callable.
    from tools.bench.__main__ import SCENARIOS, resolve

    for scenario, questions in SCENARIOS.items():
        for question in questions:
            main, rest = resolve([scenario, *([question] if question else []), "--x"])
            assert callable(main) and rest == ["--x"], (scenario, question)


def test_the_sides_runner_alternates_two_sides_and_compares_their_figures(tmp_path, capsys):
    # `python -m tools.bench sides`: two trees and a command per side, rounds A B / B A, the
    # figures from each run's JSON. The commands here only write JSON, so nothing is
    # measured: what is checked is the order, the per-side command and the comparison.
    from tools.bench import sides

    log, script = tmp_path / "order", tmp_path / "side.py"
    script.write_text(
        "import json, sys\n"
        "out, log, side, publish = sys.argv[1:]\n"
        "open(log, 'a').write(side)\n"
        "run = {'joined': [0.01, 0.03], 'failed': [], 'publish': float(publish)}\n"
        "json.dump({'results': {'none': [run]}}, open(out + '/run.json', 'w'))\n"
    )
    write = f"{{python}} {script} {{out}} {log} "
    record = tmp_path / "sides.json"
    rc = sides.main([
        "--base", str(ROOT), "--head", str(ROOT), "--rounds", "3", "--json", str(record),
        "--base-cmd", write + "A 0.002", "--head-cmd", write + "B 0.004",
        "joins", "cost", "--storms", "none",
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr()
    assert log.read_text() == "ABBAAB"
    compared = {r["figure"]: r for r in json.loads(record.read_text())["compared"]}
    assert compared["none: publish p50 ms"]["ratio"] == pytest.approx(2.0)
    assert compared["none: join p50 ms"]["ratio"] == pytest.approx(1.0)
    assert compared["none: joined of 2"]["a"] == 2
    assert "figures: median B/A" in capsys.readouterr().out


def test_the_sides_runner_reads_any_scenario():
    # Without a reader of its own a scenario's JSON is read number by number, and a run
    # that wrote none is read from what it printed.
    from tools.bench import sides

    run = {"max_lag": "1", "steps_per_s": 4.0, "samples": [1, 2, 9]}
    leaves = dict(sides._leaves({"runs": [run], "config": {"x": 1}}))
    assert leaves == {"runs[1].steps_per_s": 4.0, "runs[1].samples": 2.0}
    printed = sides._printed("none       62    0\nswap      261   50\n")
    assert printed == {"none #1": 62.0, "none #2": 0.0, "swap #1": 261.0, "swap #2": 50.0}


def test_each_question_has_its_own_output_option_and_reader(tmp_path):
    # A question is run with the option that makes it write JSON only if it has one (no
    # borrowing its scenario's), and read with its own reader, else number by number.
    from tools.bench import sides
    from tools.bench.__main__ import SCENARIOS

    for key in sides.OUTPUT:
        scenario, _, question = key.partition(" ")
        assert question in SCENARIOS[scenario] or not question, key
    assert "--json" not in sides._default_command("fixed cold-calls")
    assert sides._default_command("fixed cpu").endswith("--json {out}/run.json")
    run = {"config": {"workers": 2}, "zmqsync wall per round": [30.0, 50.0, 40.0]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert sides.figures("fixed cpu", tmp_path, "") == {"zmqsync wall per round": 40.0}
