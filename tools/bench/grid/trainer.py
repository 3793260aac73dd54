"""The trainer phase: what publishing every step costs a real training loop.

An MLP (64 MB and 512 MB of float32), Adam, a batch sized so that forward + backward
take at least twice a copy of the model, publishing every step to N alias workers that
are plain processes. Five ways, side by side in one run, each in its own process
(``python -m tools.bench.grid.trainer SPEC``: memory is returned between ways, and a
torchrl sender waiting forever on a dead receiver is killed with its group):

* ``none``: no publishing, the loop's own speed.
* ``sync``: ``publish()`` after ``step()``: a copy into a free slot, then the acks.
* ``overlapped``: ``Publisher(..., optimizer=opt)`` and ``publish(max_lag=None)``: the
  parameters are copied while the next forward and backward run; ``step()`` waits only
  if that copy is unfinished.
* ``torchrl-collector``: torchrl's ``SharedMemWeightSyncScheme`` as its collectors use it
  with a CPU policy: the trainer's tensors are the shared buffer, ``send()`` copies
  nothing and workers read the live, changing tensors (no versions).
* ``torchrl-own``: the same scheme owning a buffer: ``send()`` copies into it in place,
  while workers may read it.

Per publish, "blocked" is the time the training thread spent on it: inside
``publish()``/``send()``, plus (overlapped) inside the step hook; "to last ack" runs
from the call to the last worker's ack (overlapped: observed by a thread that waits on
each handle).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

WAYS = ("none", "sync", "overlapped", "torchrl-collector", "torchrl-own")
WIDTH = 1024  # each layer a 1024x1024 Linear: 4 MiB and 2 tensors
SIZES_MB = (64, 512)
# Workers silent for ~6 beats are dropped: on a loaded 2-core host an idle worker can
# wait seconds for a CPU while the trainer saturates both, so beats are slower here.
HEARTBEAT_S = 2.0


def model_for(size_mb: int) -> torch.nn.Sequential:
    """An MLP of about `size_mb` MB of float32 parameters (ReLU between the layers)."""
    layers = max(1, round(size_mb * 2**20 / ((WIDTH * WIDTH + WIDTH) * 4)))
    parts: list[torch.nn.Module] = []
    for i in range(layers):
        parts.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < layers - 1:
            parts.append(torch.nn.ReLU())
    return torch.nn.Sequential(*parts)


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(int(p.numel()) * p.element_size() for p in model.parameters())


def _copy_seconds(model: torch.nn.Module) -> float:
    """One copy of every parameter into preallocated tensors: a publish's floor."""
    params = [p.detach() for p in model.parameters()]
    dst = [torch.empty_like(p) for p in params]
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        torch._foreach_copy_(dst, params)
        best = min(best, time.perf_counter() - t)
    return best


def _step_fn(
    model: torch.nn.Module, opt: torch.optim.Optimizer, batch: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward and backward, optimizer step) on a fixed random batch."""
    x = torch.randn(batch, WIDTH)

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    return forward_backward, opt.step


def _pick_batch(model: torch.nn.Module, copy_s: float) -> tuple[int, float]:
    """The smallest batch (>= 16) whose forward + backward takes >= 2 copies."""
    batch, spent = 16, 0.0
    while True:
        x = torch.randn(batch, WIDTH)
        model(x).square().mean().backward()  # warm
        t = time.perf_counter()
        model(x).square().mean().backward()
        spent = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        if spent >= 2 * copy_s or batch >= 1024:
            return batch, spent
        batch *= 2


# --- one way, in its own process ---------------------------------------------------------


def _spawn_zmqsync_workers(name: str, n: int) -> list[subprocess.Popen[bytes]]:
    """N plain alias workers: the `zmqsync worker` command, background apply. Their
    stderr goes to this process's (the harness keeps the tail when a way fails)."""
    cmd = [sys.executable, "-m", "zmqsync", "worker", "--name", name, "--mode", "alias"]
    return [
        subprocess.Popen(
            [*cmd, "--worker-id", f"{name}-{i}", "--timeout", "180", "--json"],
            stdout=subprocess.DEVNULL,
        )
        for i in range(n)
    ]


def _reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(20)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class _AckWatch:
    """Waits on each overlapped handle in turn, off the training thread, so that the
    time to the last ack is seen without the loop waiting for it."""

    def __init__(self) -> None:
        self.handles: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.seconds: list[float] = []
        self._thread = threading.Thread(target=self._run, name="bench-ackwatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (handle := self.handles.get()) is not None:
            self.seconds.append(handle.wait(120).seconds)

    def close(self) -> None:
        self.handles.put(None)
        self._thread.join(180)


def run_way(spec: dict[str, Any]) -> dict[str, Any]:
    """Train `spec["steps"]` measured steps (after 2 warm-up ones) one way; the record."""
    way, size_mb, n = spec["way"], int(spec["size_mb"]), int(spec["workers"])
    # The same intra-op threads for every way: on a loaded machine OpenMP's spinning
    # threads made a step 5-10x slower at 2 threads than at 1, and varied with whatever
    # else ran, so the comparison would be of thread scheduling, not of publishing.
    torch.set_num_threads(int(spec.get("threads") or max(1, (os.cpu_count() or 2) // 2)))
    torch.manual_seed(0)
    model = model_for(size_mb)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    copy_s = _copy_seconds(model)
    batch, fwd_bwd_s = _pick_batch(model, copy_s)
    forward_backward, step = _step_fn(model, opt, batch)
    record: dict[str, Any] = {
        "way": way,
        "size_mb": size_mb,
        "bytes": _model_bytes(model),
        "workers": n,
        "batch": batch,
        "copy_s": copy_s,
        "fwd_bwd_s": fwd_bwd_s,
        "threads": torch.get_num_threads(),
    }
    with _publishing(way, model, opt, n) as publish:
        blocked, to_ack, steps_s = _loop(forward_backward, step, publish, int(spec["steps"]))
    record.update(publish.summary(blocked, to_ack) if publish is not None else {})
    record.update(samples={"step": steps_s, "blocked": blocked, "to_ack": to_ack})
    record.update(_step_summary(steps_s))
    record["load"] = os.getloadavg()[0]
    return record


def _step_summary(steps_s: list[float]) -> dict[str, float]:
    """steps/s from the median step: a step the machine stalled (a loaded host runs
    other work for seconds at times) does not decide the comparison."""
    return {"step_s": statistics.median(steps_s), "steps_per_s": 1.0 / statistics.median(steps_s)}


def _merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the repeats of one way at one size: the samples pooled."""
    ok = [r for r in runs if r["status"] == "ok"]
    if not ok:
        return runs[-1]
    pooled: dict[str, list[float]] = {"step": [], "blocked": [], "to_ack": []}
    for r in ok:
        for key in pooled:
            pooled[key] += r["samples"][key]
    out = {**ok[-1], "runs": len(ok), "samples": pooled, "load": max(r["load"] for r in ok)}
    out.update(_step_summary(pooled["step"]))
    if pooled["blocked"]:
        out.update(
            blocked_p50=statistics.median(pooled["blocked"]),
            blocked_mean=statistics.fmean(pooled["blocked"]),
            blocked_max=max(pooled["blocked"]),
            to_last_ack_p50=statistics.median(pooled["to_ack"]) if pooled["to_ack"] else None,
            incomplete_publishes=sum(r["incomplete_publishes"] for r in ok),
        )
    return out


def _loop(
    forward_backward: Callable[[], None],
    step: Callable[[], None],
    publish: Any,
    steps: int,
) -> tuple[list[float], list[float], list[float]]:
    blocked: list[float] = []
    to_ack: list[float] = []
    steps_s: list[float] = []
    for i in range(2 + steps):
        t = time.perf_counter()
        forward_backward()
        step()
        if publish is not None:
            publish(blocked, to_ack)
        if i >= 2:
            steps_s.append(time.perf_counter() - t)
    if publish is not None:
        publish.finish(blocked, to_ack)
    return blocked[2:], to_ack[2:], steps_s


@contextlib.contextmanager
def _publishing(way: str, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> Any:
    if way == "none":
        yield None
    elif way in ("sync", "overlapped"):
        with _zmqsync_way(way, model, opt, n) as publish:
            yield publish
    else:
        with _torchrl_way(way, model, n) as publish:
            yield publish


class _Publishing:
    """Call once per step: publish and note the training thread's cost."""

    def __init__(self, call: Callable[[list[float], list[float]], None]) -> None:
        self._call = call
        self.finish: Callable[[list[float], list[float]], None] = lambda b, a: None
        self.incomplete = 0  # publishes that some worker did not ack (dropped, evicted)

    def __call__(self, blocked: list[float], to_ack: list[float]) -> None:
        self._call(blocked, to_ack)

    def summary(self, blocked: list[float], to_ack: list[float]) -> dict[str, Any]:
        return {
            "incomplete_publishes": self.incomplete,
            "blocked_p50": statistics.median(blocked),
            "blocked_mean": statistics.fmean(blocked),
            "blocked_max": max(blocked),
            "to_last_ack_p50": statistics.median(to_ack) if to_ack else None,
        }


@contextlib.contextmanager
def _zmqsync_way(
    way: str, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int
) -> Iterator[_Publishing]:
    import zmqsync

    name = f"trainer-{uuid.uuid4().hex[:8]}"
    writes = zmqsync.Overlapped(opt) if way == "overlapped" else zmqsync.Copy()
    with zmqsync.Publisher(
        model, name=name, writes=writes, timeout=120, heartbeat=HEARTBEAT_S
    ) as pub:
        workers = _spawn_zmqsync_workers(name, n)
        try:
            if not pub.wait_for_workers(n, timeout=180):
                raise RuntimeError(f"only {len(pub.workers)} of {n} workers joined")
            if way == "sync":

                def publish(blocked: list[float], to_ack: list[float]) -> None:
                    t = time.perf_counter()
                    handle = pub.publish()
                    blocked.append(time.perf_counter() - t)
                    to_ack.append(handle.seconds)
                    publishing.incomplete += bool(handle.missing)

                publishing = _Publishing(publish)
                yield publishing
            else:
                watch = _AckWatch()
                handles: list[Any] = []

                def publish(blocked: list[float], to_ack: list[float]) -> None:
                    handle = pub.publish(max_lag=None)
                    handles.append(handle)
                    watch.handles.put(handle)

                def finish(blocked: list[float], to_ack: list[float]) -> None:
                    handles[-1].wait(120)
                    watch.close()
                    # read now: a handle's step-hook wait is known once the next step ran
                    blocked.extend(h.blocked for h in handles)
                    to_ack.extend(watch.seconds)
                    publishing.incomplete = sum(bool(h.missing) for h in handles)

                publishing = _Publishing(publish)
                publishing.finish = finish
                yield publishing
        finally:
            pub.close()
            _reap(workers)


def _torchrl_receiver(scheme: Any, size_mb: int, worker_idx: int, ready: Any, stop: Any) -> None:
    """One collector worker: its policy is replaced by views of the shared buffer."""
    try:
        model = model_for(size_mb)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
        scheme.connect(worker_idx=worker_idx)  # torchrl's background receiver thread
        ready.put((worker_idx, ""))
    except Exception as exc:
        ready.put((worker_idx, f"{type(exc).__name__}: {exc}"))
        return
    stop.wait()
    scheme.shutdown()


@contextlib.contextmanager
def _torchrl_way(way: str, model: torch.nn.Module, n: int) -> Iterator[_Publishing]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchrl._utils import _get_mp_ctx
        from torchrl.weight_update import SharedMemWeightSyncScheme

    ctx = _get_mp_ctx(None)
    size_mb = round(_model_bytes(model) / 2**20)
    scheme = SharedMemWeightSyncScheme()
    cpu = torch.device("cpu")
    # collector: the policy is the trained module, its tensors become the buffer; own:
    # the policy the collectors hold is another module, send() copies into it
    policy = model if way == "torchrl-collector" else model_for(size_mb)
    scheme.init_on_sender(model_id="policy", model=policy, devices=[cpu] * n, ctx=ctx)
    ready, stop = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_torchrl_receiver, args=(scheme, size_mb, i, ready, stop), daemon=True)
        for i in range(n)
    ]
    try:
        for proc in procs:
            proc.start()
        scheme.connect()
        for _ in range(n):
            _, error = ready.get(timeout=180)
            if error:
                raise RuntimeError(f"a torchrl receiver failed: {error}")

        def publish(blocked: list[float], to_ack: list[float]) -> None:
            t = time.perf_counter()
            scheme.send(weights=model)  # collector.update_policy_weights_(model)
            spent = time.perf_counter() - t
            blocked.append(spent)
            to_ack.append(spent)  # a sync send returns once every worker acked

        yield _Publishing(publish)
    finally:
        stop.set()
        for proc in procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
        with contextlib.suppress(Exception):
            scheme.shutdown()


# --- what a partial and a bf16 publish cost ------------------------------------------------

_RAW_RESPONDER = """
import sys, zmq
ctx = zmq.Context()
sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(sys.argv[1]); push.connect(sys.argv[2])
me = sys.argv[3].encode()
while True:
    if not sub.poll(600_000):
        break
    kind, seq = sub.recv_multipart()
    if kind == b"stop":
        break
    push.send_multipart([me, seq])
"""


def _raw_fanout(n: int) -> tuple[Any, list[subprocess.Popen[bytes]], Any]:
    """A PUB/PULL pair and N plain pyzmq processes echoing on it: the raw round trip."""
    import tempfile

    import zmq

    from .fanout import Fanout

    ctx = zmq.Context()
    runtime = tempfile.mkdtemp(prefix="zsraw")
    fan = Fanout(ctx, runtime, "raw")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RAW_RESPONDER, fan.events, fan.acks, str(i)],
            stdout=subprocess.DEVNULL,
        )
        for i in range(n)
    ]
    fan.connected(n, 180)
    return fan, procs, ctx


def publish_costs(spec: dict[str, Any]) -> dict[str, Any]:
    """Partial publishes of a 2% adapter of a 1 GB model against one copy of the
    adapter plus the raw round trip; a bf16-slot publish of a 512 MB float32 model
    against the float32 one. Each pair interleaved, one sample of each per round."""
    import zmqsync

    n, rounds = int(spec["workers"]), int(spec.get("rounds", 30))
    torch.set_num_threads(int(spec.get("threads") or max(1, (os.cpu_count() or 2) // 2)))
    out: dict[str, Any] = {"workers": n, "rounds": rounds}
    head = model_for(20)
    big = torch.nn.ModuleDict({"backbone": model_for(1000), "adapter": head})
    adapter = [k for k, _ in big.named_parameters() if k.startswith("adapter.")]
    out["adapter_bytes"] = _model_bytes(head)
    out["model_bytes"] = _model_bytes(big)
    src = [p.detach() for p in head.parameters()]
    dst = [torch.empty_like(p) for p in src]
    fan, raw_procs, ctx = _raw_fanout(n)
    name = f"adapter-{uuid.uuid4().hex[:8]}"
    try:
        with zmqsync.Publisher(big, name=name, timeout=120, heartbeat=HEARTBEAT_S) as pub:
            workers = _spawn_zmqsync_workers(name, n)
            try:
                if not pub.wait_for_workers(n, timeout=180):
                    raise RuntimeError(f"only {len(pub.workers)} of {n} workers joined")
                samples: dict[str, list[float]] = {"partial": [], "copy": [], "raw": [], "full": []}
                for i in range(rounds + 2):
                    with torch.no_grad():
                        for p in head.parameters():
                            p.add_(1.0)
                    t = time.perf_counter()
                    pub.publish(keys=adapter)
                    partial = time.perf_counter() - t
                    t = time.perf_counter()
                    torch._foreach_copy_(dst, src)
                    copy = time.perf_counter() - t
                    raw = fan.round(b"raw", n, 60)
                    if i >= 2:
                        samples["partial"].append(partial)
                        samples["copy"].append(copy)
                        samples["raw"].append(raw)
                    if i % 10 == 0:  # a few full versions: the slots reuse, as in training
                        samples["full"].append(pub.publish().seconds)
            finally:
                pub.close()
                _reap(workers)
        med = {k: statistics.median(v) for k, v in samples.items()}
        out.update({f"{k}_p50": v for k, v in med.items()})
        out["partial_ratio"] = med["partial"] / (med["copy"] + med["raw"])
        del big, src, dst
        out.update(_bf16_costs(n, rounds))
    finally:
        for _ in raw_procs:
            fan.pub.send_multipart([b"stop", b"0"])
        _reap(raw_procs)
        fan.close()
        ctx.term()
    return out


def _bf16_costs(n: int, rounds: int) -> dict[str, Any]:
    import zmqsync
    from zmqsync._config import shm_dir

    model = model_for(512)
    names = {dtype: f"{tag}-{uuid.uuid4().hex[:8]}" for dtype, tag in
             ((torch.float32, "f32"), (torch.bfloat16, "bf16"))}  # fmt: skip
    samples: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    mapped: dict[torch.dtype, int] = {}
    with contextlib.ExitStack() as stack:
        pubs = {}
        workers: list[subprocess.Popen[bytes]] = []
        stack.callback(_reap, workers)
        for dtype, name in names.items():
            pubs[dtype] = stack.enter_context(
                zmqsync.Publisher(
                    model,
                    name=name,
                    writes=zmqsync.Copy(dtype=dtype),
                    timeout=120,
                    heartbeat=HEARTBEAT_S,
                )
            )
            workers += _spawn_zmqsync_workers(name, n)
        for dtype, pub in pubs.items():
            if not pub.wait_for_workers(n, timeout=180):
                raise RuntimeError(f"only {len(pub.workers)} of {n} workers joined")
            directory = shm_dir()
            mapped[dtype] = sum(
                os.path.getsize(os.path.join(directory, f))
                for f in os.listdir(directory)
                if names[dtype] in f
            )
        for i in range(rounds + 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            for dtype, pub in pubs.items():
                t = time.perf_counter()
                pub.publish()
                if i >= 2:
                    samples[dtype].append(time.perf_counter() - t)
        for pub in pubs.values():
            pub.close()
    f32, bf16 = (statistics.median(samples[d]) for d in (torch.float32, torch.bfloat16))
    return {
        "f32_p50": f32,
        "bf16_p50": bf16,
        "bf16_ratio": bf16 / f32,
        "f32_segment_bytes": mapped[torch.float32],
        "bf16_segment_bytes": mapped[torch.bfloat16],
    }


def main(argv: list[str]) -> int:
    """Run one way (`argv[0]`: a JSON spec) and print its record as one JSON line."""
    spec = json.loads(argv[0])
    with contextlib.suppress(OSError, AttributeError):  # die with the harness
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    record = publish_costs(spec) if spec.get("way") == "costs" else run_way(spec)
    record["load"] = os.getloadavg()[0]
    print(json.dumps(record), flush=True)
    return 0


# --- the harness side -------------------------------------------------------------------


def run_trainer_phase(
    *,
    sizes_mb: tuple[int, ...] = SIZES_MB,
    workers: int = 8,
    steps: dict[int, int] | None = None,
    ways: tuple[str, ...] = WAYS,
    timeout: float = 900.0,
    costs: bool = True,
    repeats: int = 2,
    progress: Callable[[str], None] = lambda what: None,
) -> list[dict[str, Any]]:
    """Every way at every size, one process each, sizes outer and ways inner (so a
    size's ways run close together in time); a way that fails is recorded with why.
    `repeats`: the ways run that many times, every other time in reverse order (a drift
    in the machine's speed then weighs on every way alike), their samples pooled.
    `costs`: then the partial and bf16 publishes (`publish_costs`)."""
    steps = steps or {64: 15, 512: 6}
    root = Path(__file__).resolve().parents[3]
    records = []
    for size_mb in sizes_mb:
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for repeat in range(repeats):
            for way in ways if repeat % 2 == 0 else tuple(reversed(ways)):
                progress(f"trainer {size_mb} MB {way} ({repeat + 1}/{repeats})")
                spec = {
                    "way": way,
                    "size_mb": size_mb,
                    "workers": workers,
                    "steps": steps.get(size_mb, 6),
                }
                runs[way].append(_run_one(spec, root, timeout))
        records += [_merged(runs[way]) for way in ways]
    if costs:
        progress("partial and bf16 publishes")
        spec = {"way": "costs", "size_mb": 1000, "workers": workers}
        records.append(_run_one(spec, root, timeout))
    return records


def _run_one(spec: dict[str, Any], root: Path, timeout: float) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.bench.grid.trainer", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,
        start_new_session=True,  # its workers go with it when it is killed
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        return {**spec, "status": f"failed: no result within {timeout:.0f} s"}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {**spec, "status": f"failed (rc {proc.returncode}): {last[:300]}"}
    return {**spec, **json.loads(lines[-1]), "status": "ok"}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# --- report -----------------------------------------------------------------------------


def targets(records: list[dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(what, measured, met) per size: overlapped blocked time against sync's, and
    overlapped steps/s against torchrl's collector path."""
    out = []
    for r in records:
        if r["way"] == "costs" and r["status"] == "ok":
            ratio = r["partial_ratio"]
            out.append(
                (
                    "2% adapter of 1 GB, keys= p50 / (adapter copy + raw rt) <= 1.3",
                    f"{ratio:.2f}x",
                    ratio <= 1.3,
                )
            )
            ratio = r["bf16_ratio"]
            out.append(
                (
                    "512 MB float32 model, bf16 slots p50 / float32 p50 <= 0.8",
                    f"{ratio:.2f}x",
                    ratio <= 0.8,
                )
            )
            half = r["bf16_segment_bytes"] / r["f32_segment_bytes"]
            out.append(("bf16 segment / float32 segment ~ 0.5", f"{half:.3f}", half <= 0.51))
    records = [r for r in records if r["way"] != "costs"]
    for size_mb in sorted({r["size_mb"] for r in records}):
        ok = {r["way"]: r for r in records if r["size_mb"] == size_mb and r["status"] == "ok"}
        sync, over, coll = ok.get("sync"), ok.get("overlapped"), ok.get("torchrl-collector")
        if sync and over:
            ratio = over["blocked_p50"] / sync["blocked_p50"]
            out.append(
                (f"{size_mb} MB blocked, overlapped/sync <= 10%", f"{ratio:.1%}", ratio <= 0.1)
            )
        if coll and over:
            ratio = over["steps_per_s"] / coll["steps_per_s"]
            out.append(
                (
                    f"{size_mb} MB steps/s, overlapped/torchrl collector >= 1",
                    f"{ratio:.2f}x",
                    ratio >= 1.0,
                )
            )
    return out  # fmt: skip


def print_trainer_report(records: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    table = Table(title="trainer phase: a training loop publishing every step")
    for col in ("size", "way", "workers", "batch", "steps/s", "vs none", "blocked p50",
                "blocked max", "to last ack p50", "load", "status"):  # fmt: skip
        table.add_column(col)
    base = {
        r["size_mb"]: r["steps_per_s"] for r in records if r["way"] == "none" and "steps_per_s" in r
    }

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.2f} ms"

    for r in records:
        ok = r["status"] == "ok"
        if r["way"] == "costs":
            continue
        table.add_row(
            f"{r['size_mb']} MB",
            r["way"],
            str(r["workers"]),
            str(r.get("batch", "-")),
            f"{r['steps_per_s']:.2f}" if ok else "-",
            f"{r['steps_per_s'] / base[r['size_mb']]:.2f}x" if ok and r["size_mb"] in base else "-",
            ms(r.get("blocked_p50")),
            ms(r.get("blocked_max")),
            ms(r.get("to_last_ack_p50")),
            f"{r['load']:.0f}" if "load" in r else "-",
            r["status"],
        )
    console.print(table)
    for r in records:
        if r["way"] == "costs" and r["status"] == "ok":
            console.print(
                f"keys= (adapter {r['adapter_bytes'] / 2**20:.0f} MiB of "
                f"{r['model_bytes'] / 2**30:.2f} GiB): p50 {ms(r['partial_p50'])}, adapter "
                f"copy {ms(r['copy_p50'])}, raw rt {ms(r['raw_p50'])}, full publish "
                f"{ms(r['full_p50'])}; 512 MB publish p50: float32 {ms(r['f32_p50'])}, "
                f"bf16 slots {ms(r['bf16_p50'])}"
            )
        elif r["way"] == "costs":
            console.print(f"partial and bf16 publishes: {r['status']}")
    for what, measured, met in targets(records):
        console.print(f"  {'[green]met[/]' if met else '[red]missed[/]'}  {what}: {measured}")


def plot_trainer(records: list[dict[str, Any]], out: Path) -> Path:
    """trainer_steps.png: steps/s per way relative to the loop without publishing, one
    group of bars per model size (the sizes differ 10x in speed; the ratio reads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["way"] != "costs" and r["status"] == "ok"]
    sizes = sorted({r["size_mb"] for r in ok})
    base = {r["size_mb"]: r["steps_per_s"] for r in ok if r["way"] == "none"}
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(WAYS)
    for i, way in enumerate(WAYS):
        values = []
        for size_mb in sizes:
            rec = next((r for r in ok if r["size_mb"] == size_mb and r["way"] == way), None)
            values.append(rec["steps_per_s"] / base[size_mb] if rec and size_mb in base else 0)
        xs = [j + (i - (len(WAYS) - 1) / 2) * width for j in range(len(sizes))]
        ax.bar(xs, values, width, label=way)
    ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
    labels = [f"{s} MB MLP, Adam ({base.get(s, 0):.2f} steps/s alone)" for s in sizes]
    ax.set_xticks(range(len(sizes)), labels)
    ax.set_ylabel("training steps/s, relative to no publishing")
    ax.set_title("publishing every step to 8 alias workers (higher is better)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trainer_steps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
