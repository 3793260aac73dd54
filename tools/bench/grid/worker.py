"""The worker processes of the grid, and the models every side builds.

Run by the harness (`tools.bench.grid`) with `subprocess`, never by hand::

    python -m tools.bench.grid.worker pool --index I
        One pool worker: an independent interpreter that imports torch once and then
        plays every worker role the benchmark needs, one command at a time. Commands
        are JSON lines on stdin, each answered by one JSON line on stdout:
        ``model`` (build a model of a given size), ``join``/``leave`` (a
        `zmqsync.Subscriber` in copy or alias mode, background apply: the public API, as
        a user's worker has it), ``respond``/``unrespond`` (a thread that answers the
        harness's own PUB socket: naive pickled state_dict, one memcpy of the floor
        buffer, or an echo that shows the subscription is live; the raw ZeroMQ floor
        has processes of its own, see ``tools.bench.grid.fanout.Echoes``), ``touch`` (read
        every weight, as a forward pass would), ``mem`` (PSS/RSS from /proc/self),
        ``drop``, ``exit``. Between commands the main thread is blocked reading the
        next one: idle, as a worker's main thread in ``time.sleep`` would be.

    python -m tools.bench.grid.worker torchrl SPEC_JSON
        torchrl's ``SharedMemWeightSyncScheme`` driven as its collectors drive it: the
        sender (this process) calls ``init_on_sender`` before the workers start and
        ``connect()`` after, the receivers (processes started from torchrl's own
        multiprocessing context) call ``init_on_receiver`` and ``connect``; sync
        ``send()`` is timed. Prints one JSON line per measured point. The harness runs
        it in its own session and kills the whole group on a deadline: a dead receiver
        blocks torchrl's ``send()`` forever.

A pool worker exits when its stdin closes and, on Linux, when its parent dies
(PR_SET_PDEATHSIG), so a killed harness leaves no process behind.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import json
import math
import mmap
import os
import pickle
import queue
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "MODEL_ALIGN",
    "FlatModel",
    "PlainModel",
    "make_model",
    "make_plain_model",
    "model_bytes",
    "model_dtype",
    "model_shapes",
    "read_memory",
]

MODEL_ALIGN = 64  # bytes between tensors of a bench model (float32 views need 4)
MANY_TENSORS = 2000  # the "many small tensors" model: 2,000 tensors of 512 floats
LLM_LAYERS, LLM_VOCAB = 24, 32000  # the LLM-shaped model: 24 blocks, a 32k vocabulary


def model_dtype(kind: str) -> torch.dtype:
    """The dtype of a bench model's tensors: bf16 for the LLM-shaped one, else float32."""
    return torch.bfloat16 if kind == "llm" else torch.float32


def model_shapes(kind: str, nbytes: int) -> list[tuple[int, ...]]:
    """Tensor shapes of a bench model of about `nbytes` bytes (of `model_dtype`).

    ``mlp``: four Linear layers (weight h×h, bias h), 8 tensors. ``many``: 2,000 vectors
    of 512 floats (4 MB in total), the per-tensor overhead case. ``llm``: a decoder-only
    transformer as LLaMA lays one out (`_llm_shapes`), in bf16: 219 tensors.
    """
    if kind == "mlp":
        h = max(2, int(math.sqrt(nbytes / 16)))
        return [(h, h), (h,)] * 4
    if kind == "many":
        return [(512,)] * MANY_TENSORS
    if kind == "llm":
        return _llm_shapes(nbytes)
    raise ValueError(f"unknown model kind {kind!r}")


def _llm_shapes(nbytes: int) -> list[tuple[int, ...]]:
    """Token embeddings; per block an attention norm, q/k/v/o projections, an MLP norm,
    gate/up/down projections (hidden 8/3 of the width); a final norm and the output
    head. The width (a multiple of 64) is the one that brings the bf16 bytes to about
    `nbytes`: 1 GiB gives width 1280, 558M parameters, 1.04 GiB."""
    per_width2 = LLM_LAYERS * (4 + 3 * 8 / 3)  # parameters per width squared
    params = nbytes / 2
    width = (-2 * LLM_VOCAB + math.sqrt((2 * LLM_VOCAB) ** 2 + 4 * per_width2 * params)) / (
        2 * per_width2
    )
    d = max(64, round(width / 64) * 64)
    ff = max(64, round(d * 8 / 3 / 64) * 64)
    shapes: list[tuple[int, ...]] = [(LLM_VOCAB, d)]
    for _ in range(LLM_LAYERS):
        shapes += [(d,), (d, d), (d, d), (d, d), (d, d), (d,), (ff, d), (ff, d), (d, ff)]
    return [*shapes, (d,), (LLM_VOCAB, d)]


def element_size(kind: str) -> int:
    """Bytes per value of a bench model of `kind`."""
    return torch.empty(0, dtype=model_dtype(kind)).element_size()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class FlatModel(nn.Module):
    """A module whose parameters are float32 views into one flat byte buffer.

    One buffer per model lets the harness measure the memcpy floor on exactly the bytes
    the model holds (``flat.copy_(src)``), without a second allocation per worker.
    """

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        flat: torch.Tensor,
        grad: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.params = nn.ParameterList()
        offset = 0
        step = torch.empty(0, dtype=dtype).element_size()
        for shape in shapes:
            n = math.prod(shape) * step
            view = flat[offset : offset + n].view(dtype).view(shape)
            self.params.append(nn.Parameter(view, requires_grad=grad))
            offset += _round_up(n, MODEL_ALIGN)


class PlainModel(nn.Module):
    """The same parameters, each with its own storage (what a real model looks like)."""

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        fill: bool,
        grad: bool,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.params = nn.ParameterList()
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype)
            if fill:
                t.fill_(0.5)
            self.params.append(nn.Parameter(t, requires_grad=grad))


def make_model(
    kind: str, nbytes: int, *, fill: bool, grad: bool = False
) -> tuple[FlatModel, torch.Tensor]:
    """A bench model and its flat buffer.

    Args:
        kind: "mlp" or "many" (see `model_shapes`).
        nbytes: target size in bytes.
        fill: write every byte (a trainer's model); False leaves the pages untouched, so
            a worker's model costs no memory until something writes it.
        grad: requires_grad of the parameters (a trainer's are True).
    """
    shapes, dtype = model_shapes(kind, nbytes), model_dtype(kind)
    step = element_size(kind)
    total = sum(_round_up(math.prod(s) * step, MODEL_ALIGN) for s in shapes)
    flat = torch.empty(total, dtype=torch.uint8)
    if fill:
        flat.view(dtype).fill_(0.5)
    return FlatModel(shapes, flat, grad, dtype), flat


def make_plain_model(kind: str, nbytes: int, *, grad: bool = True) -> PlainModel:
    """A filled bench model with one storage per tensor.

    The naive baseline pickles ``state_dict()``: torch pickles a storage once per tensor
    that views it, so views into one flat buffer would be serialized many times over.
    """
    return PlainModel(model_shapes(kind, nbytes), fill=True, grad=grad, dtype=model_dtype(kind))


def model_bytes(kind: str, nbytes: int) -> int:
    """Bytes of the tensors themselves (what a publish moves), padding excluded."""
    return sum(math.prod(s) * element_size(kind) for s in model_shapes(kind, nbytes))


# --- memory ---------------------------------------------------------------------------

_ROLLUP_FIELDS = (
    "Rss",
    "Pss",
    "Pss_Anon",
    "Pss_File",
    "Pss_Shmem",
    "Private_Clean",
    "Private_Dirty",
    "Shared_Clean",
    "Shared_Dirty",
)


def read_memory(pid: int | str = "self", under: str | None = None) -> dict[str, int]:
    """Memory of a process in bytes, from /proc/PID/smaps_rollup.

    ``pss_anon + pss_shmem`` is the process's data; ``pss_file`` (library code) is left
    out of comparisons: its PSS moves whenever any process on the host maps the same
    libraries.

    With `under`, also ``seg_pss`` / ``seg_rss``: the part of PSS/RSS that maps files
    whose path starts with that prefix (the shared segments), from /proc/PID/smaps.
    """
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[0][:-1] in _ROLLUP_FIELDS:
                out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    if under is not None:
        seg_pss = seg_rss = 0
        inside = False
        prefix = under
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                parts = line.split()
                if not parts:
                    continue
                if not parts[0].endswith(":"):  # a mapping's header line
                    inside = len(parts) >= 6 and parts[5].startswith(prefix)
                elif inside and parts[0] == "Pss:":
                    seg_pss += int(parts[1]) * 1024
                elif inside and parts[0] == "Rss:":
                    seg_rss += int(parts[1]) * 1024
        out["seg_pss"], out["seg_rss"] = seg_pss, seg_rss
    return out


def _trim() -> None:
    """Give freed heap back to the OS (glibc), so the next point's baseline is honest."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the harness dies (no orphan keeps /dev/shm)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage `tensor` views, as a flat uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _map_readonly(path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only on purpose
        return mm, torch.frombuffer(mm, dtype=torch.uint8)


# --- pool worker ----------------------------------------------------------------------


class _Responder:
    """A thread answering the harness's PUB socket on its PUSH socket.

    Frames in: ``[kind, seq, payload?]``; out: ``[index, seq]``. Kinds: ``raw`` (echo:
    the subscription is live), ``naive`` (unpickle a state_dict and load it into the
    model), ``copy`` (one memcpy of the floor buffer into the model's own bytes, on this
    thread). It is started only for the phases that need it (copy mode, naive).

    The copy is a plain memcpy on one thread, as a zmqsync worker's is: a torch ``copy_``
    with torch's default two threads in each of N+1 processes on 2 cores made the "floor"
    erratic (9 processes copying 4 MB: 4 ms in one run, 25-50 ms in others, with
    OpenMP threads spinning) and left spinning threads to bill the publish measured next.
    """

    def __init__(self, worker: _PoolWorker, events: str, acks: str) -> None:
        import zmq

        self.worker = worker
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.linger = 0
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(events)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.linger = 0
        self.push.connect(acks)
        self.ident = str(worker.index).encode()
        self.stop = threading.Event()
        self.error = ""
        self.thread = threading.Thread(target=self._run, name="bench-responder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.sub.poll(100):
                    continue
                frames = self.sub.recv_multipart()
                kind, seq = frames[0], frames[1]
                if kind == b"naive":
                    state = pickle.loads(frames[2])
                    model = self.worker.model
                    if model is not None:
                        model.load_state_dict(state)
                    del state
                elif kind == b"copy":
                    src, flat = self.worker.floor_src, self.worker.flat
                    if src is not None and flat is not None:
                        if flat.numel() < src.numel():
                            raise ValueError("the model is smaller than the floor buffer")
                        ctypes.memmove(flat.data_ptr(), src.data_ptr(), src.numel())
                self.push.send_multipart([self.ident, seq])
        except Exception as exc:  # reported by the next command's reply
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.sub.close()
            self.push.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.destroy(linger=0)


class _PoolWorker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.model: FlatModel | None = None
        self.flat: torch.Tensor | None = None
        self.floor_src: torch.Tensor | None = None
        self._floor_mm: mmap.mmap | None = None
        self.sub: Any = None
        self.responder: _Responder | None = None
        self.handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "model": self.cmd_model,
            "drop": self.cmd_drop,
            "join": self.cmd_join,
            "leave": self.cmd_leave,
            "respond": self.cmd_respond,
            "unrespond": self.cmd_unrespond,
            "touch": self.cmd_touch,
            "mem": self.cmd_mem,
            "ping": lambda _: {},
        }

    def cmd_model(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.cmd_drop({})
        self.model, self.flat = make_model(cmd["kind"], cmd["nbytes"], fill=False)
        return {"bytes": self.flat.numel()}

    def cmd_drop(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.cmd_leave({})
        self.cmd_unrespond({})
        self.model = self.flat = self.floor_src = None
        self._floor_mm = None
        _trim()
        return {}

    def cmd_join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A `zmqsync.Subscriber` as a user's worker has one: the public API, background
        apply; this process's main thread then waits for the next command (blocked in a
        read, as an idle main thread in ``time.sleep`` or ``wait_for_stop`` would be)."""
        from tools.bench.roles import subscriber

        self.cmd_leave({})
        t0 = time.perf_counter()
        sub = subscriber(
            cmd["address"],
            self.model,
            name=cmd["name"],
            mode=cmd["mode"],
            flat=bool(cmd.get("flat", False)),
            worker_id=f"bench-{self.index}",
            timeout=cmd["timeout"],
            shm_dir=cmd["shm_dir"],
        )
        sub.start()
        seconds = time.perf_counter() - t0
        self.sub = sub
        if cmd.get("flat") and cmd["mode"] == "copy" and self.model is not None:
            # the model's tensors moved into the subscriber's block: the floor copies into
            # the model's bytes there, not into the buffer they left (which, touched, held
            # a second model per worker: 8 copy workers of the LLM-shaped model ran the
            # host out of memory)
            self.flat = storage_bytes(next(iter(self.model.parameters())))
        return {"seconds": seconds, "version": sub.version}

    def cmd_leave(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self.sub is not None:
            self.sub.close()
            self.sub = None
        return {}

    def cmd_respond(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.cmd_unrespond({})
        if cmd.get("floor"):
            self._floor_mm, self.floor_src = _map_readonly(cmd["floor"], cmd["floor_bytes"])
        self.responder = _Responder(self, cmd["events"], cmd["acks"])
        return {}

    def cmd_unrespond(self, cmd: dict[str, Any]) -> dict[str, Any]:
        error = ""
        if self.responder is not None:
            error = self.responder.error
            self.responder.close()
            self.responder = None
        self.floor_src = None
        self._floor_mm = None  # unmapped when the last view goes
        if error:
            raise RuntimeError(f"responder failed: {error}")
        return {}

    def cmd_touch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Read every weight once, as a forward pass would (maps the pages it uses)."""
        total = 0.0
        if self.model is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    total += float(p.sum())
        return {"sum": total}

    def cmd_mem(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return read_memory("self", cmd.get("under"))

    def serve(self) -> int:
        ready = {"event": "ready", "pid": os.getpid(), "source": source_digest()}
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            reply: dict[str, Any] = {"id": cmd.get("id")}
            if cmd["cmd"] == "exit":
                self.cmd_drop({})
                print(json.dumps({**reply, "ok": True}), flush=True)
                return 0
            try:
                reply.update(self.handlers[cmd["cmd"]](cmd))
                reply["ok"] = True
            except Exception as exc:
                reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            print(json.dumps(reply), flush=True)
        self.cmd_drop({})  # stdin closed: the harness is gone
        return 0


def source_digest() -> str:
    """A digest of zmqsync's library sources on disk, in the checkout this harness is in.

    The harness compares every worker's with its own: a library edited while a run is
    going would mix two versions of the code in one table.
    """
    import hashlib

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(here))), "zmqsync")
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:12]


def pool_main(argv: list[str]) -> int:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness decides when we stop
    threads = os.environ.get("ZMQSYNC_BENCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    import zmqsync  # noqa: F401 - imported now, so the digest below is its code

    index = int(argv[argv.index("--index") + 1])
    return _PoolWorker(index).serve()


# --- torchrl --------------------------------------------------------------------------


def _receiver_view(scheme: Any, worker_idx: int) -> Any:
    """A copy of a sender's scheme that holds only worker `worker_idx`'s queues.

    torchrl hands every worker the whole scheme: 3 queues per worker, so 6·N file
    descriptors per worker. A forkserver passes at most ~250 descriptors to a new
    process (SCM_RIGHTS), so 64 receivers cannot start that way; each gets this copy
    instead. Only the plumbing of process start differs: the receiver uses exactly its
    own queues either way, and the sender's `send()` is torchrl's, untouched.
    """
    # torchrl keeps this plumbing in private attributes: they are read and replaced
    # here, on copies, and nothing else of torchrl's is touched (SLF001 below).
    view = copy.copy(scheme)  # __getstate__: flags reset, as pickling for a worker does
    for attr in ("_instruction_queues", "_ack_queues", "_weight_init_queues"):
        setattr(view, attr, {worker_idx: getattr(scheme, attr)[worker_idx]})
    shared = scheme._shared_transport  # noqa: SLF001
    transport = copy.copy(shared)
    transport._weight_queues = {worker_idx: view._weight_init_queues[worker_idx]}  # noqa: SLF001
    transport._params_map = {worker_idx: shared._params_map[worker_idx]}  # noqa: SLF001
    view._shared_transport = transport  # noqa: SLF001
    view._is_shutdown = True  # noqa: SLF001  (its __del__ must not close the sender's queues)
    return view


def _torchrl_receiver(
    scheme: Any, kind: str, nbytes: int, worker_idx: int, ready: Any, stop: Any
) -> None:
    """One torchrl worker, as a collector's: init_on_receiver, connect, then serve."""
    _die_with_parent()
    try:
        scheme._is_shutdown = False  # noqa: SLF001  (see _receiver_view)
        model, _ = make_model(kind, nbytes, fill=False)
        scheme.init_on_receiver(model_id="policy", model=model, worker_idx=worker_idx)
        scheme.connect(worker_idx=worker_idx)  # starts torchrl's background receiver
        ready.put((worker_idx, ""))
    except Exception as exc:
        ready.put((worker_idx, f"{type(exc).__name__}: {exc}"))
        return
    stop.wait()
    scheme.shutdown()


def torchrl_main(argv: list[str]) -> int:
    """Sender side; `argv[0]` is a JSON spec: workers, start_method, points.

    One generation of receivers per point (size × variant): each point's scheme is
    created with ``init_on_sender`` before its receivers start and ``connect()``-ed
    after, as a collector does; then sync ``send()`` is timed.
    """
    _die_with_parent()
    spec = json.loads(argv[0])
    n = int(spec["workers"])
    points: list[dict[str, Any]] = spec["points"]
    timeout = float(spec.get("connect_timeout", 300))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchrl
        from torchrl._utils import _get_mp_ctx
        from torchrl.weight_update import SharedMemWeightSyncScheme

    def emit(**record: Any) -> None:
        print(json.dumps(record), flush=True)

    ctx = _get_mp_ctx(spec.get("start_method") or None)
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "torchrl", "tools.bench.grid.worker"])
    emit(event="started", start_method=ctx.get_start_method(), torchrl=torchrl.__version__)
    cpu = torch.device("cpu")
    for point in points:
        kind, nbytes = point["kind"], point["nbytes"]
        trainer, _ = make_model(kind, nbytes, fill=True, grad=True)
        scheme = SharedMemWeightSyncScheme()
        if point["variant"] == "collector":
            # What a collector does with a CPU policy: the policy's own tensors become
            # the shared buffer (moved into shared memory in place).
            scheme.init_on_sender(model_id="policy", model=trainer, devices=[cpu] * n, ctx=ctx)
            own = None
        else:
            # The policy the collector holds is not the model being trained (a policy
            # factory, or a trainer on another device): the scheme owns a buffer and
            # send() copies the trainer's weights into it.
            own, _ = make_model(kind, nbytes, fill=True)
            scheme.init_on_sender(model_id="policy", model=own, devices=[cpu] * n, ctx=ctx)
        ready, stop = ctx.Queue(), ctx.Event()
        t0 = time.perf_counter()
        views = [_receiver_view(scheme, i) for i in range(n)]
        procs = [
            ctx.Process(
                target=_torchrl_receiver,
                args=(views[i], kind, nbytes, i, ready, stop),
                daemon=True,
            )
            for i in range(n)
        ]
        failed = ""
        try:
            for proc in procs:
                proc.start()
            scheme.connect()  # puts the shared buffer on every worker's queue
            deadline = time.monotonic() + timeout
            for got in range(n):
                try:
                    _, error = ready.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue.Empty:
                    raise RuntimeError(
                        f"only {got} of {n} receivers connected within {timeout:.0f} s"
                    ) from None
                if error:
                    raise RuntimeError(f"a torchrl receiver failed: {error}")
            start_s = time.perf_counter() - t0
            lat: list[float] = []
            begin = time.perf_counter()
            for i in range(point["warmup"] + point["iters"]):
                samples, spent = i - point["warmup"], time.perf_counter() - begin
                if (samples >= point["min_iters"] and spent > point["max_seconds"]) or (
                    samples >= 1 and spent > 3 * point["max_seconds"]
                ):
                    break
                t = time.perf_counter()
                scheme.send(weights=trainer)  # collector.update_policy_weights_(trainer)
                if i >= point["warmup"]:
                    lat.append(time.perf_counter() - t)
            emit(
                event="point",
                key=point["key"],
                variant=point["variant"],
                lat=lat,
                start_s=start_s,
            )
        except (RuntimeError, OSError) as exc:  # this point fails; the next ones still run
            failed = f"{type(exc).__name__}: {exc}"
            emit(event="point", key=point["key"], variant=point["variant"], error=failed)
        finally:
            stop.set()
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
            if failed:  # data nobody will read must not block the queues' feeder threads
                for attr in ("_instruction_queues", "_ack_queues", "_weight_init_queues"):
                    for q in getattr(scheme, attr, {}).values():
                        q.cancel_join_thread()
            scheme.shutdown()
            del scheme, views, trainer, own
            _trim()
    emit(event="done")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    role, rest = args[0], args[1:]
    if role == "pool":
        return pool_main(rest)
    if role == "torchrl":
        return torchrl_main(rest)
    print(f"unknown role {role!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
