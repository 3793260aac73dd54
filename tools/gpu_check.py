"""Check the CUDA transport on a real GPU, in one call, and measure it.

    python tools/gpu_check.py                  # correctness + bandwidth (1, 8, 32 GiB)
    python tools/gpu_check.py --sizes 1,8      # fewer/smaller bandwidth rows
    python tools/gpu_check.py --quick          # correctness only, small model

Correctness (exit status 1 if any check fails):

* a bf16 model (plus fp32 BatchNorm statistics and an int64 counter) on ``cuda:0``,
  published 20 times to 4 subscriber processes: alias on the same GPU (zero-copy), copy
  into the worker's own CUDA tensors, a CPU worker of the CUDA publisher (it reads the
  CPU copy), and a worker forced onto the CPU fallback (``ZMQSYNC_CUDA_IPC=0``) that
  copies host-to-device. Every worker checks every version bit-exactly against the
  blake2b digest the trainer publishes with it, reports its transport, and counts CUDA
  IPC handle opens: one per CUDA buffer at the handshake, none afterwards;
* a CUDA worker of a CPU publisher (host-to-device copy in the worker);
* the torn-read test: alias workers on the GPU read while the publisher rewrites as
  fast as it can, with slots=2 (never torn) and slots=1 (torn reads detected, never
  used).

Bandwidth: for each size, in a fresh process, the device-to-device copy bandwidth of
the same tensors (``dst.copy_(src)`` + synchronize) against ``publish()`` with one alias
worker (time to the worker's ack) and without waiting (write + synchronize only), and
the worker's handshake time. Target: publish >= 70% of device-to-device, zero handle
opens after the handshake. The tables print as Markdown, with the date and hardware,
ready for docs/benchmarks.md.

``worker`` and ``bench`` are this script's own subcommands for its child processes
(the test suite's GPU tests reuse ``worker``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import zmqsync  # noqa: E402
from zmqsync import _checksum  # noqa: E402
from zmqsync._buffers import cuda as zcuda  # noqa: E402
from zmqsync._buffers.transport import DISABLED  # noqa: E402
from zmqsync._cli.buses import inspect_bus  # noqa: E402

GiB = 2**30
TARGET = 0.70
VERSIONS = 20


# --- child: a subscriber process -----------------------------------------------------------


def run_worker(args: argparse.Namespace) -> int:
    """Join the bus, verify every version, print JSON lines (ready, applied, summary)."""
    device = {"none": None, "cuda": "cuda", "cpu": "cpu"}[args.device]
    sub: zmqsync.Subscriber  # bound below; `verify` runs only once it is
    state: dict[str, Any] = {"verified": 0, "mismatches": [], "versions": [], "errors": []}

    def verify(version: int) -> None:
        flat = dict(sub.tensors)
        with sub.reading() as reading:
            got, want = _checksum.digest(flat), _checksum.stored_digest(flat)
        state["versions"].append(version)
        if want is not None and not reading.torn:
            if got == want:
                state["verified"] += 1
            else:
                state["mismatches"].append(version)

    on_update = verify if args.verify else None
    sub = zmqsync.Subscriber(
        name=args.name,
        reads=(
            zmqsync.Aliases(device=device, manual=args.torn, on_update=on_update)
            if args.mode == "alias"
            else zmqsync.Copies(device=device, manual=args.torn, on_update=on_update)
        ),
        worker_id=args.worker_id,
        timeout=120,
    )
    opens_before = zcuda.opens()
    started = time.perf_counter()
    sub.start()
    handshake_s = time.perf_counter() - started
    opens_at_handshake = zcuda.opens() - opens_before
    print(
        json.dumps(
            {
                "event": "ready",
                "worker": args.worker_id,
                "transport": sub.transport,
                "note": sub.transport_note,
                "handshake_s": handshake_s,
                "opens": opens_at_handshake,
                "version": sub.version,
            }
        ),
        flush=True,
    )
    reads = torn = bad = 0
    try:
        if args.torn:
            while not sub.stopped:
                sub.poll(0.0)
                with sub.reading() as r:
                    values = set()
                    for t in sub._reader.target.tensors.values():
                        values.add(float(t.min()))
                        values.add(float(t.max()))
                reads += 1
                if r.torn:
                    torn += 1
                elif values != {float(r.version % 100)}:
                    bad += 1
        else:
            sub.wait_for_stop(timeout=args.seconds)
    finally:
        summary = {
            "event": "summary",
            "worker": args.worker_id,
            "transport": sub.transport,
            "note": sub.transport_note,
            "handshake_s": handshake_s,
            "opens_at_handshake": opens_at_handshake,
            "opens_after_handshake": zcuda.opens() - opens_before - opens_at_handshake,
            "last_version": sub.version,
            "applied": len(state["versions"]),
            "verified": state["verified"],
            "mismatches": state["mismatches"],
            "reads": reads,
            "torn": torn,
            "bad": bad,
            "devices": sorted({str(t.device) for t in sub._reader.target.tensors.values()})
            if sub._reader.target is not None
            else [],
        }
        sub.close()
        print(json.dumps(summary), flush=True)
    return 0


class Child:
    """A child process of this script whose JSON stdout lines are collected."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self.argv = argv

    def wait_line(self, event: str, timeout: float) -> dict[str, Any]:
        """The next JSON line with this event (other lines are skipped)."""
        end = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                record: dict[str, Any] = json.loads(line)
                if record.get("event") == event:
                    return record
        err = self.proc.stderr.read()[-3000:] if self.proc.poll() is not None else ""
        raise RuntimeError(f"{self.argv[:4]}: no {event!r} line (rc={self.proc.poll()}) {err}")

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return -9

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def spawn_worker(
    name: str, worker_id: str, mode: str, device: str, *, verify: bool = True, **kw: Any
) -> Child:
    argv = ["worker", "--name", name, "--worker-id", worker_id, "--mode", mode]
    argv += ["--device", device]
    if verify:
        argv.append("--verify")
    if kw.get("torn"):
        argv.append("--torn")
    return Child(argv, kw.get("env"))


# --- correctness ---------------------------------------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.rows: list[tuple[str, bool, str]] = []

    def add(self, name: str, ok: bool, detail: str = "") -> None:
        self.rows.append((name, ok, detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.rows)


def bf16_model(device: str, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.BatchNorm1d(width),
        torch.nn.Linear(width, width),
        torch.nn.Linear(width, 16),
    )
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    model[3].to(torch.bfloat16)
    return model.to(device)


def versioned(model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
    """A new version of the weights (seeded), with the digest the workers check."""
    gen = torch.Generator(device="cpu").manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
            p.add_(noise.to(p.dtype), alpha=1e-2)
        bn = model[1]
        bn.running_mean.fill_(float(version))
        bn.num_batches_tracked.fill_(version)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    flat = {tuple(k.split(".")): v for k, v in weights.items()}
    digest = _checksum.digest_tensor(_checksum.digest(flat))
    weights["_checksum"] = digest.to(next(model.parameters()).device)
    return weights


def check_mixed_bus(checks: Checks, width: int) -> None:
    """4 worker processes on a CUDA publisher: alias, copy, CPU worker, forced fallback."""
    print("CUDA publisher, 4 workers (alias/cuda, copy/cuda, copy/cpu, fallback):", flush=True)
    name = f"gpucheck-{uuid.uuid4().hex[:6]}"
    model = bf16_model("cuda:0", width)
    kinds = {
        "alias-cuda": ("alias", "none", {}, "cuda"),
        "copy-cuda": ("copy", "cuda", {}, "cuda"),
        "copy-cpu": ("copy", "cpu", {}, "cpu"),
        "fallback": ("copy", "cuda", {"ZMQSYNC_CUDA_IPC": "0"}, "cpu"),
    }
    with zmqsync.Publisher(versioned(model, 0), name=name, timeout=120) as pub:
        workers = {
            wid: spawn_worker(name, wid, mode, dev, env=env)
            for wid, (mode, dev, env, _) in kinds.items()
        }
        try:
            ready = {wid: w.wait_line("ready", 180) for wid, w in workers.items()}
            checks.add("4 workers joined", pub.wait_for_workers(4, timeout=60))
            seconds = []
            for v in range(1, VERSIONS + 1):
                p = pub.publish(weights=versioned(model, v))
                seconds.append(p.seconds)
                if p.missing:
                    checks.add(f"version {v} acked by all", False, f"missing {p.missing}")
                    break
            infos = pub.workers
            state = inspect_bus(pub.address, 10.0)
            notes = {w.worker_id: w.transport_note for w in state.workers}
        except BaseException:
            for w in workers.values():
                w.kill()
            raise
    summaries = {}
    for wid, w in workers.items():
        try:
            summaries[wid] = w.wait_line("summary", 60)
        except RuntimeError as exc:
            summaries[wid] = {"error": str(exc)}
        w.finish()
    for wid, (_, _, _, transport) in kinds.items():
        s = summaries[wid]
        want_opens = 1 if transport == "cuda" else 0
        ok = (
            s.get("transport") == transport
            and infos.get(wid) is not None
            and infos[wid].transport == transport
            and s.get("verified") == VERSIONS + 1
            and not s.get("mismatches")
            and s.get("opens_at_handshake") == want_opens
            and s.get("opens_after_handshake") == 0
        )
        detail = (
            f"transport {s.get('transport')} (pub.workers: "
            f"{infos[wid].transport if wid in infos else '-'}), verified "
            f"{s.get('verified')}/{VERSIONS + 1}, mismatches {s.get('mismatches')}, opens "
            f"{s.get('opens_at_handshake')}+{s.get('opens_after_handshake')}, devices "
            f"{s.get('devices')}, handshake {1e3 * s.get('handshake_s', 0):.0f} ms"
        )
        checks.add(f"worker {wid}", ok, detail or s.get("error", ""))
    checks.add(
        "fallback reason in inspect",
        notes.get("fallback") == DISABLED and ready["fallback"]["note"] == DISABLED,
        repr(notes.get("fallback")),
    )
    checks.add(
        "publish with 4 workers",
        True,
        f"median {1e3 * statistics.median(seconds):.1f} ms for "
        f"{sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20:.0f} MiB",
    )


def check_cpu_publisher(checks: Checks, width: int) -> None:
    print("CPU publisher, CUDA worker (host-to-device copy in the worker):", flush=True)
    name = f"gpucheck-{uuid.uuid4().hex[:6]}"
    model = bf16_model("cpu", width)
    with zmqsync.Publisher(versioned(model, 0), name=name, timeout=120) as pub:
        worker = spawn_worker(name, "cuda-worker", "copy", "cuda")
        try:
            worker.wait_line("ready", 180)
            for v in range(1, 6):
                pub.publish(weights=versioned(model, v))
            info = pub.workers.get("cuda-worker")
        except BaseException:
            worker.kill()
            raise
    s = worker.wait_line("summary", 60)
    worker.finish()
    ok = (
        s["transport"] == "cpu"
        and info is not None
        and info.transport == "cpu"
        and s["verified"] == 6
        and not s["mismatches"]
        and any(d.startswith("cuda") for d in s["devices"])
    )
    checks.add("CUDA worker of a CPU publisher", ok, f"{s['transport']}, note {s['note']!r}")


def check_torn(checks: Checks, slots: int) -> None:
    print(f"torn-read test on the GPU, slots={slots}:", flush=True)
    name = f"gpucheck-{uuid.uuid4().hex[:6]}"
    template = {
        "a": torch.zeros(1024, 1024, device="cuda:0"),
        "b": torch.zeros(4096, dtype=torch.bfloat16, device="cuda:0"),
        "c": torch.zeros(333, dtype=torch.int64, device="cuda:0"),
    }
    with zmqsync.Publisher(template, name=name, slots=slots, timeout=60) as pub:
        readers = [
            spawn_worker(name, f"torn{i}", "alias", "none", verify=False, torn=True)
            for i in range(2)
        ]
        try:
            for r in readers:
                r.wait_line("ready", 180)
            pub.wait_for_workers(2, timeout=60)
            end, version = time.monotonic() + 4.0, 0
            while time.monotonic() < end:
                version += 1
                pub.publish(
                    weights={k: torch.full_like(t, version % 100) for k, t in template.items()}
                )
        except BaseException:
            for r in readers:
                r.kill()
            raise
    for r in readers:
        s = r.wait_line("summary", 60)
        r.finish()
        ok = s["bad"] == 0 and s["reads"] > 100 and (slots == 1 or s["torn"] == 0)
        ok = ok and s["transport"] == "cuda" and s["opens_after_handshake"] == 0
        checks.add(
            f"torn reads, slots={slots}, {s['worker']}",
            ok,
            f"{s['reads']} reads, {s['torn']} torn (detected), {s['bad']} bad, {version} versions",
        )


# --- bandwidth -----------------------------------------------------------------------------


_DIGEST_WORKER = """
import json, sys, time
import zmqsync
from zmqsync._checksum import digest
name = sys.argv[1]
sub = zmqsync.Subscriber(name=name, mode="alias", worker_id="overlap-worker", timeout=120,
                         on_update=lambda v: print(json.dumps(
                             {"version": v, "digest": digest(dict(sub.tensors))}), flush=True))
with sub:
    print(json.dumps({"version": sub.version, "digest": digest(dict(sub.tensors)),
                      "transport": sub.transport}), flush=True)
    while not sub.stopped:
        time.sleep(0.05)
"""


def check_overlapped(checks: Checks, width: int) -> None:
    """optimizer= on a CUDA model: versions bit-exact in an alias worker (CUDA IPC) while
    step() runs right after each publish, and the training thread's blocked time per
    publish against a synchronous publish's."""
    print("overlapped publish of a CUDA model (side stream, the step waits on the GPU):")
    from zmqsync._checksum import digest
    from zmqsync._layout import flatten

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(8))).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, width, device="cuda")

    def forward_backward() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()

    name = f"gpucheck-{uuid.uuid4().hex[:6]}"
    expected: dict[int, str] = {}
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=120) as pub:
        worker = subprocess.Popen(
            [sys.executable, "-c", _DIGEST_WORKER, name],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if not pub.wait_for_workers(1, timeout=180):
                raise RuntimeError("the overlap worker did not join")
            for _ in range(10):
                forward_backward()
                handle = pub.publish(max_lag=None)
                expected[handle.version] = digest(flatten(model))  # syncs: fine here
                opt.step()  # right away: the copy may still be queued
            handle.wait(60)
        finally:
            pub.close()
        out, _ = worker.communicate(timeout=60)
    seen = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    wrong = [r["version"] for r in seen if expected.get(r["version"], r["digest"]) != r["digest"]]
    ok = bool(seen) and not wrong and seen[-1]["version"] == max(expected)
    checks.add("overlapped CUDA versions bit-exact", ok, f"{len(seen)} applied, wrong: {wrong}")

    blocked: dict[str, float] = {}
    for way in ("sync", "overlapped"):
        writes = zmqsync.Overlapped(opt) if way == "overlapped" else zmqsync.Copy()
        with zmqsync.Publisher(model, name=f"{name}{way[0]}", writes=writes) as pub:
            handles = []
            for _ in range(30):
                forward_backward()
                opt.step()
                handles.append(pub.publish(max_lag=0 if way == "sync" else None))
            handles[-1].wait(60)
            torch.cuda.synchronize()
            blocked[way] = statistics.median([h.blocked for h in handles[5:]])
    ratio = blocked["overlapped"] / blocked["sync"]
    checks.add(
        "overlapped blocked <= 5% of sync (CUDA)",
        ratio <= 0.05,
        f"{blocked['overlapped'] * 1e3:.3f} vs {blocked['sync'] * 1e3:.3f} ms ({ratio:.1%})",
    )


def run_bench(args: argparse.Namespace) -> int:
    """One size, in its own process (a closed CUDA publisher keeps its memory until exit)."""
    size = int(args.gib * GiB)
    chunk = min(size, 256 * 2**20)
    n = max(1, size // chunk)
    src = {f"t{i}": torch.randn(chunk // 2, device="cuda:0").to(torch.bfloat16) for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in src.values())
    dst = {k: torch.empty_like(t) for k, t in src.items()}
    d2d = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, t in src.items():
            dst[k].copy_(t)
        torch.cuda.synchronize()
        d2d.append(time.perf_counter() - t0)
    del dst
    torch.cuda.empty_cache()
    name = f"gpubench-{uuid.uuid4().hex[:6]}"
    started = time.perf_counter()
    pub = zmqsync.Publisher(src, name=name, slots=args.slots, timeout=300, shm_dir=args.shm_dir)
    pub.start()
    start_s = time.perf_counter() - started
    env = {"ZMQSYNC_SHM_DIR": args.shm_dir} if args.shm_dir else {}
    worker = spawn_worker(name, "bench-alias", "alias", "none", verify=False, env=env)
    try:
        ready = worker.wait_line("ready", 300)
        pub.wait_for_workers(1, timeout=60)
        pub.publish()  # warm-up
        waited, written = [], []
        for _ in range(5):
            p = pub.publish()
            waited.append(p.seconds)
        for _ in range(5):
            t0 = time.perf_counter()
            p = pub.publish(max_lag=None)
            written.append(time.perf_counter() - t0)
            p.wait()
    finally:
        pub.close()
    summary = worker.wait_line("summary", 120)
    worker.finish()
    d2d_s, wait_s, write_s = min(d2d[1:]), statistics.median(waited), statistics.median(written)
    print(
        json.dumps(
            {
                "event": "bench",
                "gib": args.gib,
                "bytes": nbytes,
                "tensors": n,
                "slots": args.slots,
                "d2d_gbs": nbytes / d2d_s / 1e9,
                "publish_gbs": nbytes / wait_s / 1e9,
                "write_gbs": nbytes / write_s / 1e9,
                "publish_ms": wait_s * 1e3,
                "start_s": start_s,
                "handshake_ms": ready["handshake_s"] * 1e3,
                "transport": summary["transport"],
                "opens_at_handshake": summary["opens_at_handshake"],
                "opens_after_handshake": summary["opens_after_handshake"],
            }
        ),
        flush=True,
    )
    return 0


def shm_dir_for(nbytes: int) -> str | None:
    """A directory with room for the CPU segment: /dev/shm, else one on disk, else None."""
    for base in ("/dev/shm", "/tmp"):
        try:
            st = os.statvfs(base)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize > nbytes * 1.1 + GiB:
            path = os.path.join(base, f"zmqsync-gpucheck-{os.getpid()}")
            os.makedirs(path, exist_ok=True)
            return path
    return None


def bandwidth(sizes: list[float], checks: Checks) -> list[dict[str, Any]]:
    rows = []
    free, _total = torch.cuda.mem_get_info(0)
    for gib in sizes:
        slots = 2 if gib < 16 else 1
        need_gpu = gib * GiB * (2 + slots)
        row: dict[str, Any] = {"gib": gib, "slots": slots}
        shm = shm_dir_for(int(gib * GiB * slots))
        if need_gpu > free * 0.95:
            row["skipped"] = f"needs {need_gpu / GiB:.0f} GiB of GPU memory, {free / GiB:.0f} free"
        elif shm is None:
            row["skipped"] = f"no directory with {gib * slots:.0f} GiB free for the CPU segment"
        else:
            print(f"bandwidth, {gib:g} GiB (slots={slots}, shm {shm}):", flush=True)
            child = Child(["bench", "--gib", str(gib), "--slots", str(slots), "--shm-dir", shm])
            try:
                row.update(child.wait_line("bench", 900))
            except RuntimeError as exc:
                row["skipped"] = f"failed: {exc}"[:300]
            child.finish()
            shutil.rmtree(shm, ignore_errors=True)
        rows.append(row)
        if "skipped" in row:
            print(f"  {gib:g} GiB skipped: {row['skipped']}", flush=True)
            continue
        ratio = row["publish_gbs"] / row["d2d_gbs"]
        checks.add(
            f"{gib:g} GiB: zero handle opens after the handshake",
            row["opens_after_handshake"] == 0 and row["transport"] == "cuda",
        )
        print(f"  publish/d2d = {ratio:.0%} (target {TARGET:.0%})", flush=True)
    return rows


# --- report --------------------------------------------------------------------------------


def hardware() -> str:
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name} ({props.total_memory / GiB:.0f} GiB, {zcuda.device_uuid(0)}), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs"
    )


def report(checks: Checks, rows: list[dict[str, Any]]) -> None:
    print()
    print(f"## CUDA transport check, {datetime.date.today().isoformat()}")
    print()
    print(f"Hardware: {hardware()}")
    print()
    print("| check | result | details |")
    print("|---|---|---|")
    for name, ok, detail in checks.rows:
        print(f"| {name} | {'ok' if ok else '**FAIL**'} | {detail} |")
    if not rows:
        return
    print()
    print(
        "| size | slots | device-to-device GB/s | publish GB/s (to ack) | publish / d2d "
        "| write only GB/s | handshake ms | opens after handshake |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['gib']:g} GiB | {r['slots']} | skipped: {r['skipped']} | | | | | |")
            continue
        ratio = r["publish_gbs"] / r["d2d_gbs"]
        mark = "" if ratio >= TARGET else " (below target)"
        print(
            f"| {r['gib']:g} GiB | {r['slots']} | {r['d2d_gbs']:.0f} | {r['publish_gbs']:.0f} "
            f"| {ratio:.0%}{mark} | {r['write_gbs']:.0f} | {r['handshake_ms']:.0f} "
            f"| {r['opens_after_handshake']} |"
        )
    print()
    print(f"Target: publish >= {TARGET:.0%} of device-to-device, 0 handle opens after handshake.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) one subscriber process")
    w.add_argument("--name", required=True)
    w.add_argument("--worker-id", required=True)
    w.add_argument("--mode", choices=("alias", "copy"), default="copy")
    w.add_argument("--device", choices=("none", "cuda", "cpu"), default="none")
    w.add_argument("--verify", action="store_true")
    w.add_argument("--torn", action="store_true")
    w.add_argument("--seconds", type=float, default=600.0)
    b = sub.add_parser("bench", help="(internal) one bandwidth row")
    b.add_argument("--gib", type=float, required=True)
    b.add_argument("--slots", type=int, default=2)
    b.add_argument("--shm-dir", default=None)
    parser.add_argument("--sizes", default="1,8,32", help="GiB per bandwidth row")
    parser.add_argument("--quick", action="store_true", help="correctness only, small model")
    args = parser.parse_args(argv)
    if args.command == "worker":
        return run_worker(args)
    if not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, "
            f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); nothing checked",
            file=sys.stderr,
        )
        return 2
    if args.command == "bench":
        return run_bench(args)
    print(f"gpu_check on {hardware()}", flush=True)
    checks = Checks()
    width = 1024 if args.quick else 4096
    for step in (
        lambda: check_mixed_bus(checks, width),
        lambda: check_cpu_publisher(checks, width),
        lambda: check_torn(checks, 2),
        lambda: check_torn(checks, 1),
        lambda: check_overlapped(checks, width),
    ):
        try:
            step()
        except Exception as exc:  # a crashed check is a failed check; go on with the rest
            checks.add("check crashed", False, f"{type(exc).__name__}: {exc}"[:300])
    rows = [] if args.quick else bandwidth([float(s) for s in args.sizes.split(",")], checks)
    report(checks, rows)
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
