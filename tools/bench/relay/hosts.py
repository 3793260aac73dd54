"""Relay throughput between namespace hosts, beside a bare gloo send of the same bytes.

The hosts are those of tests/test_hosts.py (tests/helpers/netns.py): a root host
"hostr" and two relay hosts "hostb" and "hostc", each its own network, mount and UTS
namespace with its own /dev/shm, joined to hostr by veth links in 198.18.0.0/24. On
hostr one process holds the trainer's `Publisher` (a model of ``--size-mb`` MiB) and a
`RelayRoot` (``ack="relays"``); on hostb and hostc one process each holds a `Relay`.
The same three processes also form a bare gloo group of their own. For the size, in
the same run, measured in pairs back to back (the order alternating), so that both
methods of a pair see the same load:

* **gloo**: ``send`` of the model's flat bytes (the trainer's own tensor) from hostr to
  both relay hosts at once, one send each, each relay host receiving into a buffer of
  its own; timed on hostr until both receivers said (a one-element send back) that they
  have every byte;
* **relay**: the trainer publishes a version (the first 8 bytes change); the time is the
  relay root's own (`Relayed.seconds`): from the moment its subscriber holds the
  version to the moment both relays reported it announced on their own buses (the
  bytes received straight into a slot, the header checked, the local publish).

Needs root (namespaces), like the namespace tests::

    sudo .venv/bin/python -m tools.bench relay hosts --size-mb 512 --pairs 12 \\
        --out bench-hosts.json

Medians are reported, and relay/gloo as a ratio of throughputs three ways: the median
of the pairs' ratios (the headline: robust to a load that changes during the run), the
ratio of the medians, and of the best of each. Both methods share the machine's cores
with everything else running on it: compare within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.helpers.netns import ROOT_ADDRESS, Cluster, unavailable  # noqa: E402

BENCH_PORT = 29400  # the bench's own store, in hostr's network namespace (always free)
STORE_TIMEOUT = datetime.timedelta(seconds=300)
RELAY_HOSTS = ("hostb", "hostc")


# --- inside the hosts ---------------------------------------------------------------------


def _store(is_master: bool) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(ROOT_ADDRESS, BENCH_PORT, 3, is_master, STORE_TIMEOUT)  # type: ignore[attr-defined]


def _gloo_group(store: Any, rank: int) -> Any:
    import torch.distributed as dist

    from zmqsync.relay._wire import gloo_devices

    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = STORE_TIMEOUT
    opts._devices = gloo_devices(ROOT_ADDRESS)  # the address that reaches hostr
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/gloo/", store), rank, 3, opts)  # type: ignore[attr-defined]


def _gloo_send(pg: Any, buf: Any, flags: list[Any], tag: int) -> None:
    """hostr's side of one measurement: both sends, then both receivers' word."""
    sends = [pg.send([buf], rank, tag) for rank in (1, 2)]
    words = [pg.recv([flags[rank - 1]], rank, tag) for rank in (1, 2)]
    for work in sends + words:
        work.wait()


def _gloo_receive(pg: Any, buf: Any, flag: Any, tag: int) -> None:
    pg.recv([buf], 0, tag).wait()
    pg.send([flag], 0, tag).wait()


def _command(store: Any, index: int, cmd: dict[str, Any]) -> None:
    store.set(f"bench/cmd/{index}", json.dumps(cmd))


def _relay_host(rank: int) -> int:
    """A relay host's process: a Relay, and the receiving end of the gloo sends."""
    import torch

    import zmqsync

    store = _store(is_master=False)
    pg = _gloo_group(store, rank)
    relay: zmqsync.Relay | None = None
    buf: torch.Tensor | None = None
    flag = torch.ones(1)
    try:
        for index in range(1_000_000):
            store.wait([f"bench/cmd/{index}"])  # the store's timeout bounds every wait
            cmd = json.loads(store.get(f"bench/cmd/{index}"))
            if cmd["op"] == "stop":
                if relay is not None:
                    relay.close()
                store.set(f"bench/stopped/{rank}", "1")  # hostr's process hosts the store
                return 0
            if cmd["op"] == "join":
                relay = zmqsync.Relay(
                    name=cmd["name"],
                    tree=zmqsync.Branch(cmd["init_method"]),
                    timeout=120,
                    heartbeat=0.5,
                    security=zmqsync.Security(insecure=True),  # 198.18.0.0/24: namespaces here
                ).start()
            elif cmd["op"] == "gloo":
                if buf is None or buf.numel() != cmd["nbytes"]:
                    buf = torch.zeros(cmd["nbytes"], dtype=torch.uint8)  # faulted in once
                for rep in range(cmd["reps"]):
                    _gloo_receive(pg, buf, flag, cmd["tag"] + rep)
            elif cmd["op"] == "report":
                version = relay.version if relay is not None else -1
                store.set(f"bench/version/{rank}", str(version))
        return 1
    finally:
        if relay is not None:
            relay.close()


def _root_host(size_mb: float, pairs: int, warmup: int, chunk_mb: float) -> int:
    """hostr's process: the trainer's Publisher, the RelayRoot, the sending end of gloo."""
    import torch

    import zmqsync

    store = _store(is_master=True)
    pg = _gloo_group(store, 0)
    nbytes = int(size_mb * 2**20)
    payload = {"w": torch.zeros(nbytes, dtype=torch.uint8)}
    flags = [torch.zeros(1), torch.zeros(1)]
    samples: list[dict[str, float]] = []
    index, version = 0, 0
    with (
        zmqsync.Publisher(payload, name="bench", timeout=300) as pub,
        zmqsync.RelayRoot(
            name="bench",
            tree=zmqsync.Tree(f"tcp://{ROOT_ADDRESS}:0", chunk_mb=chunk_mb, collective_timeout=60),
            ack="relays",
            timeout=120,
            security=zmqsync.Security(insecure=True),  # 198.18.0.0/24: namespaces here
        ) as root,
    ):
        _command(store, index, {"op": "join", "name": "bench", "init_method": root.init_method_url})
        index += 1
        if not root.wait_for_relays(2, timeout=300):
            raise SystemExit(f"the relays did not join: {root.relays}")

        def gloo() -> float:
            nonlocal index
            _command(store, index, {"op": "gloo", "nbytes": nbytes, "reps": 1, "tag": index})
            t0 = time.perf_counter()
            _gloo_send(pg, payload["w"], flags, index)
            index += 1
            return time.perf_counter() - t0

        def relay() -> tuple[float, float]:
            nonlocal version
            version += 1
            payload["w"][:8] = version  # other bytes each version
            t0 = time.perf_counter()
            handle = pub.publish(weights=payload)
            elapsed = time.perf_counter() - t0
            last = root.last
            assert not handle.missing and last is not None, handle
            assert last.version == version and not last.missing, last
            return last.seconds, elapsed

        for n in range(warmup + pairs):  # back to back, in turns first: one load for both
            if n % 2:
                (relay_s, publish_s), gloo_s = relay(), gloo()
            else:
                gloo_s, (relay_s, publish_s) = gloo(), relay()
            if n >= warmup:
                samples.append({"gloo": gloo_s, "relay": relay_s, "publish": publish_s})
            print(f"pair {n}: gloo {gloo_s:.3f} s, relay {relay_s:.3f} s", file=sys.stderr)
        _command(store, index, {"op": "report"})
        index += 1
        for rank in (1, 2):
            store.wait([f"bench/version/{rank}"])
            got = int(store.get(f"bench/version/{rank}"))
            assert got == version, f"relay host {rank} holds version {got}, not {version}"
    _command(store, index, {"op": "stop"})
    store.wait([f"bench/stopped/{rank}" for rank in (1, 2)])
    print(json.dumps(_summary(nbytes, samples)), flush=True)
    return 0


def _summary(nbytes: int, samples: list[dict[str, float]]) -> dict[str, Any]:
    """Medians, and the ratios of throughput relay/gloo: of the medians, the median of
    each pair's (the two measured back to back), and of the best of each."""
    med = {k: statistics.median(s[k] for s in samples) for k in ("gloo", "relay", "publish")}
    best = {k: min(s[k] for s in samples) for k in ("gloo", "relay")}
    return {
        "size_mib": nbytes / 2**20,
        "receivers": 2,
        "pairs": len(samples),
        "gloo_ms": med["gloo"] * 1e3,
        "relay_ms": med["relay"] * 1e3,
        "publish_ms": med["publish"] * 1e3,
        # bytes delivered per second, both receivers counted
        "gloo_gbs": 2 * nbytes / med["gloo"] / 1e9,
        "relay_gbs": 2 * nbytes / med["relay"] / 1e9,
        "ratio_of_medians": med["gloo"] / med["relay"],
        "ratio_paired": statistics.median(s["gloo"] / s["relay"] for s in samples),
        "ratio_of_best": best["gloo"] / best["relay"],
        "samples_ms": [{k: round(v * 1e3, 1) for k, v in s.items()} for s in samples],
    }


# --- outside: the hosts and their processes -----------------------------------------------


def _read_result(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The JSON line hostr's process prints at the end."""
    assert proc.stdout is not None
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], min(1.0, end - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return dict(json.loads(line))
    raise SystemExit(f"no result from hostr within {timeout} s (exit status {proc.poll()})")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    shm_mb = int(3 * args.size_mb) + 64  # a relay host's bus: 2 slots, and its header
    cluster = Cluster(RELAY_HOSTS, shm_mb=shm_mb)
    procs: list[subprocess.Popen[str]] = []
    runtime = tempfile.TemporaryDirectory(prefix="zmqsync-bench-hosts-")
    try:
        for hostname, host in cluster.hosts.items():
            home = Path(runtime.name, hostname)
            home.mkdir(mode=0o700)
            env = dict(os.environ, ZMQSYNC_RUNTIME_DIR=str(home), ZMQSYNC_SHM_DIR="/dev/shm")
            env.pop("GLOO_SOCKET_IFNAME", None)  # gloo binds the address that reaches hostr
            if hostname == "hostr":
                role = ["--role", "root", "--size-mb", str(args.size_mb)]
                role += ["--pairs", str(args.pairs), "--warmup", str(args.warmup)]
                role += ["--chunk-mb", str(args.chunk_mb)]
            else:
                role = ["--role", "relay", "--rank", str(1 + RELAY_HOSTS.index(hostname))]
            procs.append(
                subprocess.Popen(
                    [*host.prefix(), sys.executable, __file__, *role],
                    env=env,
                    stdout=subprocess.PIPE if hostname == "hostr" else subprocess.DEVNULL,
                    text=True,
                )
            )
        result = _read_result(procs[0], args.timeout)
        for proc in procs:
            proc.wait(60)
        return result
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        leftovers = cluster.close()
        runtime.cleanup()
        if any(leftovers.values()):
            print(f"killed what was left in the hosts: {leftovers}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("bench", "root", "relay"), default="bench")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--size-mb", type=float, default=512.0, help="MiB")
    p.add_argument("--pairs", type=int, default=12, help="gloo/relay pairs measured")
    p.add_argument("--warmup", type=int, default=2, help="pairs first, not counted")
    p.add_argument("--chunk-mb", type=float, default=16.0, help="the relay's chunk size")
    p.add_argument("--timeout", type=float, default=900.0, help="for the whole run (s)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.role == "relay":
        return _relay_host(args.rank)
    if args.role == "root":
        return _root_host(args.size_mb, args.pairs, args.warmup, args.chunk_mb)
    why = unavailable()
    if why is not None:
        print(f"bench_hosts: namespace hosts: {why}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    result = _run(args)
    result["meta"] = {
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "chunk_mib": args.chunk_mb,
        "warmup": args.warmup,
        "link": "veth, hostr's end a port of a bridge; MTU 1500",
    }
    print(
        f"{args.size_mb:.0f} MiB to 2 relay hosts: gloo send {result['gloo_ms']:.0f} ms "
        f"({result['gloo_gbs']:.2f} GB/s), relay {result['relay_ms']:.0f} ms "
        f"({result['relay_gbs']:.2f} GB/s); relay/gloo: {result['ratio_paired']:.2f} "
        f"(median of {result['pairs']} pairs), {result['ratio_of_medians']:.2f} (of the "
        f"medians), {result['ratio_of_best']:.2f} (of the best); "
        f"trainer publish() {result['publish_ms']:.0f} ms"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
