"""Hosts as Linux namespaces: each its own network, mount and UTS namespace.

A `Host` is one holder process made by ``unshare(1)``: its own host name, its own tmpfs
at /dev/shm, its own loopback, and nothing else until a `Cluster` gives it a link. The
holder reads its stdin until EOF, so the namespaces end with the process that made them
(even one that is SIGKILLed). Commands run inside a host through ``nsenter(1)``, with
``setpriv --pdeathsig KILL`` so that they die with their parent too.

A `Cluster` is a root host and relay hosts, each relay host joined to the root host by
a veth pair: ``eth0`` on the relay host; on the root host an end named after the relay
host, a port of the bridge ``br0``. Addresses come from 198.18.0.0/24 (RFC 2544's
benchmarking range, used by nothing on these machines); every interface lives in a
namespace made here, so nothing is added to, or routed through, the machine's own
network, and two clusters at once (two test runs) cannot collide.

    root host "hostr": br0 198.18.0.1 ─┬─ port "hostb" ══ veth ══ eth0 198.18.0.2 "hostb"
                                       └─ port "hostc" ══ veth ══ eth0 198.18.0.3 "hostc"

Used by tests/test_hosts.py and tools/bench/relay/hosts.py. Needs root (CAP_SYS_ADMIN and
CAP_NET_ADMIN), util-linux (unshare, nsenter, setpriv) and iproute2 (ip, tc).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBNET = "198.18.0"  # RFC 2544 benchmarking range, /24: never routed, unused here
ROOT_ADDRESS = f"{SUBNET}.1"
ROOT_IFNAME = "br0"
RELAY_IFNAME = "eth0"
STEP_S = 10.0  # deadline of one setup command (ip, tc, mount)


# what a host needs, tried in a throwaway namespace (gone when the probe exits): its own
# name, a tmpfs, a veth pair, a bridge, a shaped link, and setpriv's death signal
_PROBE = (
    "hostname zmqsync-probe && mount -t tmpfs -o size=1m zmqsync-probe /dev/shm && "
    "ip link set lo up && ip link add probe0 type veth peer name probe1 && "
    "ip link add probebr type bridge && ip link set probe1 master probebr && "
    "tc qdisc replace dev probe0 root tbf rate 1mbit burst 64kb latency 400ms && "
    "setpriv --pdeathsig KILL -- true"
)


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here; None if they can."""
    if os.geteuid() != 0:
        return "making network, mount and UTS namespaces needs root (CAP_SYS_ADMIN)"
    for tool in ("unshare", "nsenter", "setpriv", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux / iproute2)"
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--"]
            + ["sh", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=STEP_S,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return f"cannot make namespace hosts here: {probe.stderr.strip()[:200]}"
    return None


class Host:
    """One "host": a holder process in its own network, mount and UTS namespaces.

    Args:
        hostname: its host name (UTS namespace).
        shm_mb: size of its /dev/shm tmpfs.
        etc_hosts: a file bind-mounted on its /etc/hosts (its mount namespace).
    """

    def __init__(self, hostname: str, *, shm_mb: int = 1024, etc_hosts: str | None = None) -> None:
        self.hostname = hostname
        self._shells: list[Shell] = []
        hosts = f"mount --bind {etc_hosts} /etc/hosts && " if etc_hosts else ""
        script = (
            f"hostname {hostname} && {hosts}"
            f"mount -t tmpfs -o size={shm_mb}m,mode=1777 zmqsync-{hostname} /dev/shm && "
            "ip link set lo up && echo ready && exec cat >/dev/null"
        )
        self.holder = subprocess.Popen(
            ["unshare", "--net", "--mount", "--uts", "--propagation", "private", "--"]
            + ["sh", "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pid = self.holder.pid
        assert self.holder.stdout is not None
        ready, _, _ = select.select([self.holder.stdout], [], [], STEP_S)
        line = self.holder.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"host {hostname} did not come up: {line!r}")
        self.netns = os.readlink(f"/proc/{self.pid}/ns/net")

    def prefix(self) -> list[str]:
        """argv prefix that runs a command inside this host (dies with its parent)."""
        return [
            "nsenter",
            f"--target={self.pid}",
            "--net",
            "--mount",
            "--uts",
            f"--wd={ROOT}",
            "setpriv",
            "--pdeathsig",
            "KILL",
            "--",
        ]

    def sh(
        self,
        command: str,
        *,
        check: bool = True,
        timeout: float = STEP_S,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """Run a short shell command inside this host; its stdout."""
        done = subprocess.run(
            [*self.prefix(), "sh", "-c", command],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{self.hostname}: {command!r} failed: {done.stderr.strip()}")
        return done.stdout

    @property
    def shm(self) -> Path:
        """This host's /dev/shm, seen from outside (through the holder's root)."""
        return Path(f"/proc/{self.pid}/root/dev/shm")

    def processes(self) -> list[int]:
        """Pids of the processes in this host's network namespace, the holder and the
        shells of `shell()` excluded."""
        own = {self.pid} | {shell.proc.pid for shell in self._shells}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in own:
                continue
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == self.netns:
                    found.append(int(entry))
            except OSError:  # gone, or a kernel thread
                continue
        return found

    def counters(self, ifname: str) -> tuple[int, int]:
        """(bytes received, bytes sent) by `ifname` of this host."""
        with open(f"/proc/{self.pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == ifname:
                    fields = rest.split()
                    return int(fields[0]), int(fields[8])
        raise KeyError(f"{self.hostname} has no interface {ifname}")

    def kill_all(self) -> list[int]:
        """SIGKILL every process in this host but the holder; their pids.

        Only while the holder lives: it pins the namespace, so no other namespace can
        have its inode. A pidfd pins each process while its namespace is checked again.
        """
        for shell in self._shells:
            shell.close()
        if self.holder.poll() is not None:
            return []
        killed = []
        for pid in self.processes():
            try:
                fd = os.pidfd_open(pid)
            except OSError:  # exited meanwhile
                continue
            try:
                if os.readlink(f"/proc/{pid}/ns/net") == self.netns:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                    killed.append(pid)
            except OSError:
                pass
            finally:
                os.close(fd)
        return killed

    def shell(self) -> Shell:
        """A shell kept running in this host: its commands start without nsenter's cost.
        Not one of `processes()`; `kill_all()` and `close()` end it."""
        shell = Shell(self)
        self._shells.append(shell)
        return shell

    def close(self) -> None:
        """End the holder: the namespaces go with the last process in them. Idempotent."""
        for shell in self._shells:
            shell.close()
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(STEP_S)
        for pipe in (self.holder.stdin, self.holder.stdout, self.holder.stderr):
            if pipe is not None:
                pipe.close()


class Shell:
    """One ``sh`` inside a host, reading commands from a pipe: a command runs as soon as
    it is written (a fork of the shell), where `Host.sh` first starts nsenter, setpriv
    and a shell, which can take a few hundred milliseconds on a loaded machine."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.proc = subprocess.Popen(
            [*host.prefix(), "sh"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def run(self, command: str, *, timeout: float = STEP_S) -> None:
        """Run `command`; return once it succeeded.

        Raises:
            RuntimeError: it failed, or did not finish within `timeout`.
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"if {command}; then echo ok; else echo failed; fi\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        answer = self.proc.stdout.readline().strip() if ready else "no answer"
        if answer != "ok":
            raise RuntimeError(f"{self.host.hostname}: {command!r}: {answer}")

    def close(self) -> None:
        """End the shell. Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STEP_S)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class Cluster:
    """A root host and relay hosts, each relay host on a veth link to the root host.

    Args:
        relays: host names of the relay hosts (at most 253).
        shm_mb: size of every host's /dev/shm.
    """

    def __init__(self, relays: Sequence[str] = ("hostb", "hostc"), *, shm_mb: int = 1024):
        self.hosts: dict[str, Host] = {}
        self.addresses = {"hostr": ROOT_ADDRESS}
        self.addresses.update({name: f"{SUBNET}.{n}" for n, name in enumerate(relays, start=2)})
        self._etc = tempfile.TemporaryDirectory(prefix="zmqsync-hosts-")
        self.etc_hosts = os.path.join(self._etc.name, "hosts")
        with open(self.etc_hosts, "w") as f:  # every host resolves every host's name
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{address} {name}\n" for name, address in self.addresses.items())
        self._shell: Shell | None = None
        try:
            self.root = self._add("hostr", shm_mb)
            self.root.sh(
                f"ip link add {ROOT_IFNAME} type bridge && "
                f"ip addr add {ROOT_ADDRESS}/24 dev {ROOT_IFNAME} && "
                f"ip link set {ROOT_IFNAME} up"
            )
            for hostname in relays:
                self._link(self._add(hostname, shm_mb), self.addresses[hostname])
        except BaseException:
            self.close()
            raise
        self._etc.cleanup()  # bind-mounted in every host already: nothing left if we die

    def _add(self, hostname: str, shm_mb: int) -> Host:
        host = Host(hostname, shm_mb=shm_mb, etc_hosts=self.etc_hosts)
        self.hosts[hostname] = host
        return host

    def _link(self, host: Host, address: str) -> None:
        # made inside the relay host, its peer moved straight into the root host: no end
        # ever appears in the machine's own network namespace
        host.sh(
            f"ip link add {RELAY_IFNAME} type veth peer name {host.hostname} "
            f"netns {self.root.pid} && "
            f"ip addr add {address}/24 dev {RELAY_IFNAME} && ip link set {RELAY_IFNAME} up"
        )
        self.root.sh(f"ip link set {host.hostname} master {ROOT_IFNAME} up")
        deadline = time.monotonic() + STEP_S
        while time.monotonic() < deadline:
            state = host.sh(f"cat /sys/class/net/{RELAY_IFNAME}/operstate").strip()
            if state == "up":
                return
            time.sleep(0.05)
        raise RuntimeError(f"{host.hostname}: link did not come up")

    @property
    def relay_hosts(self) -> list[Host]:
        return [h for name, h in self.hosts.items() if name != "hostr"]

    def link(self, hostname: str, up: bool) -> None:
        """Take the link of relay host `hostname` down (its port on the root host) or up.

        Through a shell kept in the root host, so the link changes within milliseconds
        of the call (a test that cuts a transfer midway needs that)."""
        if self._shell is None:
            self._shell = self.root.shell()
        self._shell.run(f"ip link set {hostname} {'up' if up else 'down'}")

    def shape(self, hostname: str, mbit: float | None) -> None:
        """Limit what the root host sends to `hostname` to `mbit` Mbit/s (None: no limit)."""
        if mbit is None:
            self.root.sh(f"tc qdisc del dev {hostname} root", check=False)
            return
        self.root.sh(
            f"tc qdisc replace dev {hostname} root tbf rate {mbit}mbit burst 64kb latency 400ms"
        )

    def sent_to(self, hostname: str) -> int:
        """Bytes the root host has sent on the link of `hostname`."""
        return self.root.counters(hostname)[1]

    def close(self) -> dict[str, list[int]]:
        """End every host, with its links and mounts; SIGKILL what still ran there.
        Returns those pids by host (empty lists when everything had exited). Idempotent."""
        leftovers = {name: host.kill_all() for name, host in self.hosts.items()}
        for host in self.hosts.values():
            host.close()
        self._etc.cleanup()
        return leftovers
