"""The `zmqsync` command: thin argparse over the library. ``main(argv) -> int``.

Expected failures (`ZmqSyncError`, a bad address, a refused path) print one line and
exit 1; usage errors exit 2; Ctrl-C exits 130 and SIGTERM 143, after closing what the
command opened. Only this module configures logging.

Startup: operators run ``inspect``, ``sniff`` and ``gc`` in loops and containers, so
nothing here imports torch at module level, and those commands never do (`import
zmqsync` loads its public names lazily; tests/test_newcomer_cli.py checks it). Commands
that move tensors (demo, worker, bench, relay) import it inside their function.

Signals: SIGTERM (``docker stop``, systemd, ``kill``) raises KeyboardInterrupt in the
main thread, as Ctrl-C does, so every ``with`` block unwinds the same way: a publisher
unlinks its segment and socket files, the demo ends its workers. The commands that run
until stopped (worker, sniff, relay) catch both signals themselves, finish the line they
are on, print their summary and exit 0.

Any local process can be a peer on a bus, so every string a peer sent (a worker id, a
host, a STOP or ERROR reason, a bus name, a counter name, a tensor key) is shown with its
control characters escaped (`printable`) and, where rich renders it, as a `Text` object
or through `rich.markup.escape`, so ``[/bold]`` is printed and never parsed. ``--json``
output is ASCII-only JSON: control characters and non-ASCII text (a bidi override) come
out as ``\\uXXXX`` escapes and round-trip exactly through any JSON parser.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from . import _config
from ._errors import ConnectTimeout, ZmqSyncError
from ._text import printable

__all__ = ["main"]

# Error and log lines carry the library's own context around peer text: cut them later
# than a single field.
_LINE_LIMIT = 4096

_SECURITY_DOC = "docs/security.md"

_DESCRIPTION = """\
Move PyTorch weights from a trainer to worker processes on this host (shared memory +
ZeroMQ), and watch the buses that do it."""
_EPILOG = """\
examples:
  zmqsync demo                          a trainer and 4 verifying workers, then a summary
  zmqsync worker --name policy --verify join the bus 'policy' and check every version
  zmqsync inspect --name policy         manifest, buffers, workers and counters of a bus
  zmqsync sniff --name policy           every message on the bus, as it happens
  zmqsync gc                            remove what killed trainers left behind

Buses are found by name in $ZMQSYNC_RUNTIME_DIR (default $XDG_RUNTIME_DIR/zmqsync or
/tmp/zmqsync-UID), or by address: tcp://HOST:PORT or ipc:///path. Exit status: 0 on
success, 1 with a one-line reason on failure, 2 for a usage error, 130 after Ctrl-C,
143 after SIGTERM. Docs: README.md, docs/guide.md, docs/sniffer.md."""


class NoSuchBus(ZmqSyncError):
    """No publisher's socket file at the bus's ipc:// address: nothing to ask."""


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (exit status 143)."""


# --- arguments ---------------------------------------------------------------------------


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind`, and greater than 0 (usage error, exit 2, otherwise)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def check_address(address: str) -> str:
    """A ZeroMQ endpoint a bus can live at, or a one-line ValueError saying what is.

    Caught here, not by libzmq: ``localhost:5555`` or ``http://…`` would otherwise end
    in a zmq traceback ("Protocol not supported", "Invalid argument").
    """
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host and port.isdigit():
            return address
    raise ValueError(
        f"address {address!r} is not a bus address: use tcp://HOST:PORT (e.g. "
        "tcp://127.0.0.1:5555) or ipc:///path/to/bus.sock, or --name NAME for a bus on "
        "this host"
    )


def _address(args: argparse.Namespace) -> str:
    if args.address:
        return check_address(args.address)
    return _config.default_address(args.name)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "address",
        nargs="?",
        help="the bus's control address, tcp://HOST:PORT or ipc:///PATH (default: from --name)",
    )
    p.add_argument(
        "--name",
        default="weights",
        help="bus name on this host, as the trainer gave it (default: weights)",
    )


# --- finding buses -----------------------------------------------------------------------


def _socket_path(address: str) -> str | None:
    return address[len("ipc://") :] if address.startswith("ipc://") else None


def _buses_here() -> list[str]:
    """Names of the buses whose publisher answers in the runtime dir (ipc:// only)."""
    from ._gc import _refused

    try:
        directory = _config.runtime_dir()
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for entry in names:
        path = os.path.join(directory, entry)
        if entry.endswith(".sock") and not _refused(path):
            found.append(entry[: -len(".sock")])
    return found


def _where_are_buses(address: str) -> str:
    """A hint for an ipc:// bus that did not answer: which buses do, or that it is dead."""
    from ._gc import _refused

    path = _socket_path(address)
    if path is None:
        return ""
    if os.path.exists(path) and _refused(path):
        return f"; {path} is left over from a publisher that is gone (`zmqsync gc` removes it)"
    buses = _buses_here()
    listed = ", ".join(printable(b) for b in buses) if buses else "none"
    return f"; buses answering in {os.path.dirname(path)}: {listed}"


def _require_socket(address: str) -> None:
    """An ipc:// bus without its socket file cannot answer: say so now, not after the
    request's deadline, and name the buses that are there."""
    path = _socket_path(address)
    if path is not None and not os.path.exists(path):
        raise NoSuchBus(f"no bus at {address} (no such socket file){_where_are_buses(address)}")


# --- commands ----------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ._demo import check_resources, render, run_demo

    check_resources(workers=args.workers, size_mb=args.size_mb, slots=args.slots, mode=args.mode)
    console = Console()
    result = run_demo(
        workers=args.workers,
        updates=args.updates,
        size_mb=args.size_mb,
        mode=args.mode,
        slots=args.slots,
        timeout=args.timeout,
        console=console,
    )
    ok = render(result, workers=args.workers, mode=args.mode, console=console, updates=args.updates)
    return 0 if ok else 1


def cmd_worker(args: argparse.Namespace) -> int:
    from ._worker import run_worker

    address = check_address(args.address) if args.address else None
    try:
        return run_worker(
            address,
            name=args.name,
            mode=args.mode,
            apply=args.apply,
            verify=args.verify,
            as_json=args.json,
            report_digest=args.digest,
            worker_id=args.worker_id,
            until_version=args.until_version,
            forever=args.forever,
            timeout=args.timeout,
        )
    except ConnectTimeout as exc:
        raise ConnectTimeout(f"{exc}{_where_are_buses(_address(args))}") from exc


def _inspect(address: str, timeout: float, name: str | None = None) -> Any:
    import zmq

    from ._deadline import Deadline
    from ._errors import ProtocolError
    from ._protocol import Inspect, State
    from ._security import client_from_env
    from ._sockets import request

    ctx = zmq.Context()
    try:
        curve = client_from_env(name)
        secure = curve.apply if curve is not None else None
        reply = request(ctx, address, Inspect(""), deadline=Deadline(timeout), secure=secure)
    finally:
        ctx.destroy(linger=0)
    if not isinstance(reply, State):
        raise ProtocolError(f"expected STATE, got {reply.TYPE}: {getattr(reply, 'reason', '')}")
    return reply


def _ask(address: str, timeout: float, name: str | None = None) -> Any:
    """One INSPECT; a one-line error that names the buses here when nobody answers."""
    _require_socket(address)
    try:
        return _inspect(address, timeout, name)
    except ConnectTimeout as exc:
        raise ConnectTimeout(f"{exc}{_where_are_buses(address)}") from exc


def _wait_for_bus(address: str, timeout: float, name: str | None = None) -> Any:
    """INSPECT, retried until a publisher answers or `timeout` passes."""
    from ._deadline import Deadline

    deadline = Deadline(timeout)
    while True:
        try:
            return _inspect(address, min(1.0, deadline.remaining() or 1.0), name)
        except ConnectTimeout as exc:
            if deadline.expired():
                raise ConnectTimeout(f"{exc}{_where_are_buses(address)}") from exc


def _access(address: str, name: str | None = None) -> dict[str, Any]:
    """Who besides its owner can join the bus at `address`, as far as an inspector can tell.

    A tcp:// bus with CURVE answers only clients with keys, so an answer to an inspector
    that had none ($ZMQSYNC_CURVE_CLIENT unset) means the bus has no CURVE. On loopback
    that opens it to every local user: anyone can inspect it, join as a worker and, by
    never acking, stall every publish until its deadline. An ipc:// bus lives in a
    runtime dir only its user can enter (0700), so it says nothing there.

    Returns:
        ``curve``: whether this inspector connected with CURVE keys; ``open_to``:
        ``"local users"`` (loopback tcp, no CURVE), ``"network"`` (any other tcp, no
        CURVE: the publisher was started with ``insecure=True``) or None.
    """
    from ._security import client_from_env, is_loopback

    curve = client_from_env(name) is not None
    open_to: str | None = None
    if address.startswith("tcp://") and not curve:
        open_to = "local users" if is_loopback(address) else "network"
    return {"curve": curve, "open_to": open_to, "see": _SECURITY_DOC}


def _access_warning(address: str, access: dict[str, Any]) -> str | None:
    """One line for the human output, or None when nothing is open."""
    who = {"local users": "any local user", "network": "any host that can reach it"}
    if access["open_to"] not in who:
        return None
    return (
        f"warning: {printable(address)} has no CURVE: {who[access['open_to']]} can join this "
        "bus (inspect it, join as a worker, stall publishes by never acking); "
        f"see {_SECURITY_DOC} to require keys"
    )


def _relay_tree(address: str, timeout: float) -> dict[str, Any] | None:
    """The bus's relay tree, or None. The relay package imports torch: it is loaded only
    when a relay root's socket file lies next to the bus."""
    path = _socket_path(address)
    if path is None or not os.path.exists(f"{path}.relay"):  # _sockets.sibling_endpoint
        return None
    from .relay import inspect_relays

    return inspect_relays(address, timeout)


def cmd_inspect(args: argparse.Namespace) -> int:
    from ._protocol import to_plain

    address = _address(args)
    reply = _ask(address, args.timeout, args.name)
    access = _access(address, args.name)
    relays = _relay_tree(address, min(args.timeout, 1.0))  # None: no relay root
    if args.json:
        plain = to_plain(reply)
        for buf in plain["buffers"]:
            buf.pop("handle")  # IPC handle bytes are for subscribers, not for screens
        if relays is not None:
            plain["relays"] = relays
        plain["access"] = access
        # ASCII only: control characters and non-ASCII peer text (a bidi override)
        # become \uXXXX escapes, exact for a parser and inert on a terminal.
        print(json.dumps(plain, indent=2, ensure_ascii=True))
    else:
        _print_state(reply, _access_warning(address, access))
        if relays is not None:
            _print_relays(relays)
    return 0


def _print_relays(tree: Mapping[str, Any]) -> None:
    """The relay tree (`inspect_relays`) as tables: the relays, then each relay's workers.

    Relay ids, hosts and worker ids come from other hosts: every string is escaped
    (`printable`) and handed to rich as `Text`, never parsed as markup.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(value: object) -> Text:
        return Text(printable(value))

    console = Console()
    console.print(
        Text.assemble(
            ("relay root", "bold"),
            f" {printable(tree['tree'])} pid {tree['pid']}  version {tree['version']}  "
            f"generation {tree['generation']}  ack={printable(tree['ack'])}",
        )
    )
    relays = Table(title=f"relays ({len(tree['relays'])})")
    columns = ("relay", "host", "pid", "state", "rank", "gen", "version", "acked", "workers")
    for col in (*columns, "last seen"):
        relays.add_column(col)
    for r in tree["relays"]:
        relays.add_row(
            cell(r["relay_id"]),
            cell(r["host"]),
            str(r["pid"]),
            cell(r["state"]),
            str(r["rank"]),
            str(r["generation"]),
            str(r["version"]),
            str(r["acked"]),
            str(len(r["workers"])),
            f"{r['last_seen']:.2f} s ago",
        )
    console.print(relays)
    for r in tree["relays"]:
        if not r["workers"]:
            continue
        title = Text(f"workers of relay {printable(r['relay_id'])} ({len(r['workers'])})")
        table = Table(title=title)
        for col in ("worker", "pid", "host", "mode", "version", "last seen"):
            table.add_column(col)
        for w in r["workers"]:
            table.add_row(
                cell(w["worker_id"]),
                str(w["pid"]),
                cell(w["host"]),
                cell(w["mode"]),
                str(w["version"]),
                f"{w['last_seen']:.2f} s ago",
            )
        console.print(table)


def _print_state(state: Any, warning: str | None = None) -> None:
    """The STATE as tables. Every string in it came from a peer: each is escaped
    (`printable`) and handed to rich as `Text`, which rich never parses for markup or
    emoji codes."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(value: object) -> Text:
        return Text(printable(value))

    console = Console()
    console.print(
        Text.assemble(
            ("bus", "bold"),
            f" {printable(repr(state.name))} id {printable(state.bus)} pid {state.pid}  "
            f"version {state.version}  seq {state.seq}  slots {list(state.slot_versions)}  "
            f"heartbeat {state.heartbeat} s",
        )
    )
    if warning is not None:
        console.print(Text(warning, style="bold yellow"), soft_wrap=True)
    buffers = Table(title="buffers")
    for col in ("kind", "device", "segment", "bytes"):
        buffers.add_column(col)
    for b in state.buffers:
        buffers.add_row(cell(b.kind), cell(b.device), cell(b.segment), f"{b.size:,}")
    console.print(buffers)
    manifest = Table(title=f"manifest ({len(state.manifest)} tensors)")
    for col in ("name", "dtype", "shape", "bytes", "offset"):
        manifest.add_column(col)
    for s in state.manifest[:200]:
        manifest.add_row(
            cell(s.name), cell(s.dtype), str(list(s.shape)), f"{s.nbytes:,}", str(s.offset)
        )
    console.print(manifest)
    workers = Table(title=f"workers ({len(state.workers)})")
    for col in ("worker", "pid", "host", "mode", "transport", "version", "lag", "last seen"):
        workers.add_column(col)
    for w in state.workers:
        lag = state.version - w.version if w.version >= 0 else "-"
        workers.add_row(
            cell(w.worker_id),
            str(w.pid),
            cell(w.host),
            cell(w.mode),
            # why a worker reads the CPU copy of CUDA weights, when it does
            cell(f"{w.transport} ({w.transport_note})" if w.transport_note else w.transport),
            str(w.version),
            str(lag),
            f"{w.last_seen:.2f} s ago",
        )
    console.print(workers)
    counters = ", ".join(f"{printable(k)}={v}" for k, v in sorted(state.counters.items()))
    console.print(Text(f"counters: {counters or '-'}"))


@contextlib.contextmanager
def _signals_set(stop: Any) -> Iterator[None]:
    """Ctrl-C and SIGTERM set `stop` (a threading.Event) for as long as the block runs:
    a loop that checks it ends between two items, and prints what it has."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def cmd_sniff(args: argparse.Namespace) -> int:
    import threading

    from rich.console import Console
    from rich.markup import escape

    from ._deadline import Deadline
    from ._sniff import Sniffer, Summary, read_recording, to_json, to_line, write_record

    # emoji off: ":thumbs_up:" in a worker id is shown as typed (to_line escapes markup)
    out = Console(highlight=False, soft_wrap=True, emoji=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        if args.replay:
            records = read_recording(stack.enter_context(open(args.replay, "rb")))
            summary = Summary(set())
        else:
            address = _address(args)
            if args.wait:
                state = _wait_for_bus(address, args.timeout, args.name)
            else:
                state = _ask(address, args.timeout, args.name)
            sniffer = stack.enter_context(Sniffer(state, address))
            if sniffer.fallback:
                err.print(
                    "zmqsync sniff: this bus has no tap (start the publisher with tap=True "
                    "or ZMQSYNC_TAP=1); showing the events socket only: no acks, no hellos"
                )
            records = sniffer.records(Deadline(args.duration), stop)
            summary = Summary(
                {w.worker_id for w in state.workers}, acks_visible=not sniffer.fallback
            )
        recording = stack.enter_context(open(args.record, "wb")) if args.record else None
        stack.enter_context(_signals_set(stop))  # from here on a signal ends the loop
        shown = 0
        for record in records:
            if recording is not None:
                write_record(recording, record)
            done = summary.add(record)
            if args.type and record.type not in args.type:
                continue
            if args.worker and record.peer not in args.worker:
                continue
            if args.json:  # ASCII-only JSON, as for inspect --json
                print(json.dumps(to_json(record), ensure_ascii=True), flush=True)
            else:
                out.print(to_line(record, colour=True))
                if done:  # names the missing workers: peer text
                    out.print(f"[bold]  {escape(printable(done, limit=_LINE_LIMIT))}[/]")
            shown += 1
            if args.count and shown >= args.count:
                break
            if args.exit_on_stop and record.type == "stop" and not record.msg.session:
                break
            if stop.is_set():  # a replay has no deadline to poll: stop between records
                break
        err.print(f"zmqsync sniff: {shown} messages shown; {summary.final()}")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from ._gc import collect_garbage, collect_sockets

    directory = _config.shm_dir(args.shm_dir)
    runtime = args.runtime_dir or _config.runtime_dir()
    for path, what in ((directory, "--shm-dir"), (runtime, "--runtime-dir")):
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path} ({what}) is not a directory: nothing to collect")
    removed = collect_garbage(directory)
    sockets = collect_sockets(runtime)
    for path in (*removed, *sockets):
        print(f"removed {path}")
    print(f"{len(removed)} leaked segment(s) removed from {directory}")
    print(f"{len(sockets)} dead socket file(s) removed from {runtime}")
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """Run a relay root (``--root``) or a relay until SIGTERM/SIGINT; ``--json`` prints
    one line per event (started, relayed or published, closed)."""
    import contextlib
    import signal
    import threading

    from .relay import Relay, Relayed, RelayRoot

    stop = threading.Event()

    def emit(record: dict[str, Any]) -> None:
        if args.json:  # ASCII only, as for inspect --json: relay ids come from peers
            print(json.dumps(record, ensure_ascii=True), flush=True)

    def relayed(r: Relayed) -> None:
        emit(
            {
                "event": "relayed",
                "version": r.version,
                "generation": r.generation,
                "relays": list(r.relays),
                "missing": list(r.missing),
                "seconds": r.seconds,
            }
        )

    node: RelayRoot | Relay
    if args.root and args.curve:
        raise ValueError(
            "--curve makes keys for a relay's own bus; a root joins the trainer's bus with "
            "the keys the trainer left (--name) or $ZMQSYNC_CURVE_CLIENT"
        )
    if args.root:
        node = RelayRoot(
            args.address,
            name=args.name,
            init_method=args.init_method,
            backend=args.backend,
            ack=args.ack,
            timeout=args.timeout,
            on_timeout=args.on_timeout,
            heartbeat=args.heartbeat,
            chunk_mb=args.chunk_mb,
            collective_timeout=args.collective_timeout,
            device=args.device,
            insecure=args.insecure,
            on_relayed=relayed,
        )
    else:
        node = Relay(
            args.address,
            name=args.name,
            init_method=args.init_method,
            relay_id=args.relay_id,
            slots=args.slots,
            timeout=args.timeout,
            on_timeout=args.on_timeout,
            heartbeat=args.heartbeat,
            device=args.device,
            insecure=args.insecure,
            on_update=lambda v: emit({"event": "published", "version": v}),
            join_timeout=args.connect_timeout,
            curve=True if args.curve else None,
        )

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    with contextlib.ExitStack() as stack:
        for signum in (signal.SIGTERM, signal.SIGINT):
            stack.callback(signal.signal, signum, signal.signal(signum, on_signal))
        stack.enter_context(node)
        started: dict[str, Any] = {"event": "started", "role": "root" if args.root else "relay"}
        if isinstance(node, RelayRoot):
            started.update(tree=node.tree, init_method=node.init_method_url, address=node.address)
        else:
            started.update(relay_id=node.relay_id)
        emit(started)
        while not stop.wait(0.2):
            pass
    emit({"event": "closed", "version": node.version})
    return 0


def _add_relay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", nargs="?", help="this host's bus address (default: from --name)")
    p.add_argument("--name", default="weights", help="bus name (default: weights)")
    p.add_argument("--root", action="store_true", help="run the root, next to the trainer's bus")
    p.add_argument("--init-method", default=None, help="env:// (default) or tcp://HOST:PORT")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--ack", choices=("tree", "relays"), default="tree", help="root: what acks mean")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per version (s)")
    p.add_argument("--on-timeout", choices=("evict", "raise"), default="evict")
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument(
        "--chunk-mb", type=float, default=_config.RELAY_CHUNK_MB, help="root: MiB per collective"
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="root: timeout of each collective (s); default: ~6 heartbeats, at least 1 s",
    )
    p.add_argument("--relay-id", default=None, help="relay: id on the tree (default: host name)")
    p.add_argument("--slots", type=int, default=2, help="relay: slots of the local bus")
    p.add_argument("--device", default=None, help="CUDA device of the NCCL staging buffer")
    p.add_argument("--connect-timeout", type=float, default=60.0, help="relay: wait for a root (s)")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback rendezvous address"
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="relay: CURVE on the local bus, its workers' keys left in the runtime dir (a "
        "root needs no flag: it finds a curve=True trainer's keys as a worker does)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per event")


def cmd_bench(args: argparse.Namespace) -> int:
    from ._bench import run_from_args

    return run_from_args(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqsync",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        help="show the library's log lines from this level on: DEBUG, INFO, WARNING (default)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        help="a trainer and N worker processes, every version verified, then a summary",
        description="Start a trainer and N `zmqsync worker --verify` processes on this host, "
        "publish a policy K times, and print the bus's publish latency, the verified round "
        "trip and each worker's counts. Exit 1 if any worker missed a version or a checksum.",
    )
    p.add_argument(
        "--workers",
        type=_positive(int),
        default=4,
        metavar="N",
        help="worker processes (default 4)",
    )
    p.add_argument(
        "--updates",
        type=_positive(int),
        default=20,
        metavar="N",
        help="versions to publish after the warm-up (default 20)",
    )
    p.add_argument(
        "--size-mb",
        type=_positive(float),
        default=64.0,
        metavar="MIB",
        help="size of the policy in MiB (default 64); refused if the host cannot hold it",
    )
    p.add_argument(
        "--mode",
        choices=("copy", "alias"),
        default="copy",
        help="copy: each worker copies into its own tensors (default); alias: workers "
        "compute on the shared buffer itself",
    )
    p.add_argument(
        "--slots",
        type=_positive(int),
        default=2,
        metavar="N",
        help="copies of the policy in shared memory (default 2)",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=60.0,
        metavar="S",
        help="deadline (s) for the workers to join and for each publish (default 60)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "worker",
        help="a standalone subscriber: join a bus, apply every version, report",
        description="Join a bus and hold its weights: say when it joined, each version "
        "applied (a live line on a terminal, JSON lines with --json), when the publisher "
        "went away and came back, and a summary at the end (also on Ctrl-C or SIGTERM). "
        "Ends when the publisher closes the bus, unless --forever.",
    )
    _add_target(p)
    p.add_argument(
        "--mode",
        choices=("copy", "alias"),
        default="copy",
        help="copy into the worker's own tensors (default), or alias the shared buffer",
    )
    p.add_argument(
        "--apply",
        choices=("background", "manual"),
        default="background",
        help="apply each version as it arrives (default), or only at the worker's poll",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each version against the _checksum tensor the trainer publishes "
        "(an error if the bus has none)",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="with --json: each version's blake2b digest in its line, checked against nothing",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON line per event (joined, applied, ...)"
    )
    p.add_argument("--worker-id", default=None, help="id on the bus (default: HOST-PID-RANDOM)")
    p.add_argument(
        "--until-version",
        type=_non_negative_int,
        default=None,
        help="exit once this version (or a newer one) is applied",
    )
    p.add_argument(
        "--forever",
        action="store_true",
        help="keep waiting for a new publisher after this one closes the bus",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=30.0,
        help="how long to wait for a publisher to answer (s, default 30)",
    )
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "inspect",
        help="manifest, buffers, workers and counters of a bus",
        description="Ask a bus's publisher once for its state and print it.",
    )
    _add_target(p)
    p.add_argument("--json", action="store_true", help="the state as JSON")
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=3.0,
        help="how long to wait for the answer (s, default 3)",
    )
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "sniff",
        help="watch a bus: every message, ack latencies, gaps",
        description="Print every message on a bus as it happens (from the publisher's tap), "
        "a line per fully acked version, and a summary at the end (also on Ctrl-C or "
        "SIGTERM). See docs/sniffer.md.",
    )
    _add_target(p)
    p.add_argument("--json", action="store_true", help="one JSON object per message")
    p.add_argument("--count", type=_positive(int), default=None, help="stop after N messages shown")
    p.add_argument("--duration", type=_positive(float), default=None, help="stop after S seconds")
    p.add_argument("--type", action="append", help="only these message types (repeatable)")
    p.add_argument("--worker", action="append", help="only messages of these workers")
    p.add_argument("--record", metavar="FILE", help="save every frame seen to FILE")
    p.add_argument("--replay", metavar="FILE", help="show a recording instead of a live bus")
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=3.0,
        help="how long to wait for the bus to answer (s, default 3)",
    )
    p.add_argument(
        "--wait", action="store_true", help="retry until a publisher answers (up to --timeout)"
    )
    p.add_argument(
        "--exit-on-stop", action="store_true", help="exit when the publisher closes the bus"
    )
    p.set_defaults(func=cmd_sniff)

    p = sub.add_parser(
        "bench",
        help="benchmarks: zmqsync vs floors, torchrl, naive pickle",
        description="Measure zmqsync against a memcpy floor, raw ZeroMQ, torchrl and a "
        "pickled state_dict. See docs/benchmarks.md.",
    )
    from ._bench import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "relay",
        help="carry a bus to other hosts over torch.distributed",
        description="Run a relay root next to the trainer's bus (--root), or a relay on "
        "another host, until SIGTERM or Ctrl-C. See docs/multi-host.md.",
    )
    _add_relay_arguments(p)
    p.set_defaults(func=cmd_relay)

    p = sub.add_parser(
        "gc",
        help="remove segments and socket files left by killed processes",
        description="Remove shared-memory segments that no process maps any more and "
        "ipc:// socket files that no publisher listens on. Safe while buses run.",
    )
    p.add_argument(
        "--shm-dir",
        default=None,
        help="where segments live (default: $ZMQSYNC_SHM_DIR or /dev/shm)",
    )
    p.add_argument(
        "--runtime-dir",
        default=None,
        help="where socket files live (default: $ZMQSYNC_RUNTIME_DIR or the user's)",
    )
    p.set_defaults(func=cmd_gc)
    return parser


class _PrintableFormatter(logging.Formatter):
    """Log lines whose message is escaped with `printable`.

    The library logs peer text (a STOP reason, a worker's host, a fallback reason from
    a WELCOME); on a terminal that text must not move the cursor or, with a newline,
    forge a log line of its own. Only the message is escaped: a traceback below it
    keeps its lines.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message, limit=_LINE_LIMIT)
        return super().formatMessage(record)


def _expected(exc: BaseException) -> bool:
    """Failures that get one line (no traceback): the library's own errors, timeouts,
    refused values and paths, and libzmq's errors (a port in use, a path it may not
    bind), whose message names what failed."""
    if isinstance(exc, ZmqSyncError | TimeoutError | ValueError | OSError):
        return True
    zmq = sys.modules.get("zmq")
    return zmq is not None and isinstance(exc, zmq.ZMQError)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises `_Terminated` (a KeyboardInterrupt) in the main thread while the
    command runs, so that ``kill`` and ``docker stop`` unwind what Ctrl-C unwinds."""

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    try:
        with _terminate_as_interrupt():
            return int(args.func(args))
    except KeyboardInterrupt as exc:
        return 143 if isinstance(exc, _Terminated) else 130
    except Exception as exc:
        if not _expected(exc):
            raise
        # a ProtocolError quotes what the peer said ("... refused us: <reason>")
        reason = printable(exc, limit=_LINE_LIMIT)
        print(f"zmqsync {args.command}: {type(exc).__name__}: {reason}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
