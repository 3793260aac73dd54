"""docker-compose end to end, with a real Docker engine (docs/docker.md).

The module fixture makes the machine able to run it: it installs Debian's docker.io,
docker-compose and debootstrap when they are missing, starts ``dockerd`` (no bridge, no
iptables: containers here get no network but loopback) when no engine answers, builds a
base image from Debian's archive once (``docker/build-base.sh``; kept for later runs),
puts zmqsync's wheel and its dependencies into the build context
(``docker/build-wheels.sh``) and builds the image with ``--network none``. An engine it
started itself is stopped when the module's tests are done (unless containers it did not
make are running on it); one that was already running is left alone. The packages stay
installed and the base image stays built, for the next run.

Each test brings a compose project up under a unique name, checks what the containers
did from their JSON logs, and always takes the project down (``down -v``, then removes
by label whatever is left). Every subprocess call has a timeout.

It skips only where Docker cannot run at all (not Linux, or not root with no usable
engine, or the packages can be neither found nor installed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
COMPOSE = DOCKER_DIR / "docker-compose.yml"
TMPFS = DOCKER_DIR / "docker-compose.tmpfs.yml"
GPU = DOCKER_DIR / "docker-compose.gpu.yml"
CURVE = DOCKER_DIR / "docker-compose.curve.yml"
METRICS = DOCKER_DIR / "docker-compose.metrics.yml"
BASE_IMAGE = os.environ.get("ZMQSYNC_DOCKER_BASE_IMAGE", "zmqsync-base:bookworm")
IMAGE = "zmqsync:test"
WORKERS = ("worker-1", "worker-2", "worker-3")
PUBLISH_TIMEOUT_S = 5.0  # trainer.py --timeout default: the ack deadline of one publish
DOCKERD_LOG = "/var/log/zmqsync-test-dockerd.log"


def run(
    cmd: list[str],
    *,
    timeout: float,
    check: bool = True,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with a deadline; on failure raise with the tail of its output."""
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:], (exc.stderr or b"")[-3000:]
        raise AssertionError(f"{cmd} did not finish within {timeout} s: {out}") from None
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{cmd} exited {proc.returncode}\nstdout: {proc.stdout[-3000:]}\n"
            f"stderr: {proc.stderr[-3000:]}"
        )
    return proc


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    """The first truthy value of `predicate()`, polling until `timeout` seconds passed."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


# --- the engine, the images ------------------------------------------------------------


class Docker:
    """The docker and compose command lines of this machine."""

    def __init__(self, cli: str, compose: list[str]) -> None:
        self.cli, self.compose_cmd = cli, compose

    def __call__(self, *args: str, timeout: float = 60, check: bool = True) -> str:
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}
        return run([self.cli, *args], timeout=timeout, check=check, env=env).stdout

    def ids(self, project: str, service: str | None = None, kind: str = "ps") -> list[str]:
        """Containers (or volumes, networks) that compose labelled with `project`."""
        filters = ["--filter", f"label=com.docker.compose.project={project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        if kind == "ps":
            out = self("ps", "-aq", "--no-trunc", *filters)
        else:
            out = self(kind, "ls", "-q", *filters)
        return out.split()

    def inspect(self, ref: str) -> dict[str, Any]:
        return json.loads(self("inspect", ref))[0]

    def records(self, container: str) -> list[dict[str, Any]]:
        """The JSON lines a container printed on stdout (all its runs)."""
        out = run([self.cli, "logs", container], timeout=30).stdout
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None
    )


def _install_packages() -> None:
    missing = [
        pkg
        for pkg, exe in (
            ("docker.io", "dockerd"),
            ("docker-compose", "docker-compose"),
            ("debootstrap", "debootstrap"),
        )
        if _which(exe) is None
    ]
    if not missing:
        return
    if os.geteuid() != 0 or _which("apt-get") is None:
        pytest.skip(f"Docker cannot run here: {missing} missing, and no root apt-get to install")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = run(["apt-get", "update", "-q"], timeout=240, check=False, env=env)
    install = run(["apt-get", "install", "-y", "-q", *missing], timeout=400, check=False, env=env)
    if install.returncode != 0:
        pytest.skip(
            f"Docker cannot run here: `apt-get install {' '.join(missing)}` failed: "
            f"{(update.stderr + install.stderr)[-500:]}"
        )


def _engine() -> tuple[Docker, int | None]:
    """The engine's command lines, and the pid of a ``dockerd`` started here (else None)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Docker containers sharing /dev/shm need a Linux host")
    if os.geteuid() != 0 and not (
        shutil.which("docker") and run(["docker", "info"], timeout=30, check=False).returncode == 0
    ):
        pytest.skip("Docker cannot run here: not root and no usable Docker engine")
    if os.geteuid() == 0:
        _install_packages()
    # the engine's own client when Debian's is installed (other clients may be newer
    # than its API or want buildx)
    cli = "/usr/bin/docker" if os.access("/usr/bin/docker", os.X_OK) else shutil.which("docker")
    assert cli, "no docker command"
    started: int | None = None
    if run([cli, "info"], timeout=30, check=False).returncode != 0:
        dockerd = _which("dockerd")
        assert dockerd, "dockerd is missing although docker.io is installed"
        # detached (setsid, all output to a file), so that pytest's output capture and
        # its process group do not hold it; _stop_dockerd ends it after the tests
        launched = subprocess.run(
            [
                "sh",
                "-c",
                f'setsid "$0" --bridge=none --iptables=false >{DOCKERD_LOG} 2>&1 & echo $!',
                dockerd,
            ],
            timeout=10,
            check=True,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
        )
        started = int(launched.stdout.split()[-1])

        def answers() -> bool:
            return run([cli, "info"], timeout=30, check=False).returncode == 0

        try:
            wait_until(answers, 90, "dockerd to answer")
        except AssertionError:
            log = Path(DOCKERD_LOG).read_text(errors="replace")[-3000:]
            raise AssertionError(f"dockerd did not start; {DOCKERD_LOG}:\n{log}") from None
    if _which("docker-compose"):
        compose = [str(_which("docker-compose"))]
    elif run([cli, "compose", "version"], timeout=30, check=False).returncode == 0:
        compose = [cli, "compose"]
    else:
        if started is not None:
            _stop_dockerd(Docker(cli, []), started)
        pytest.skip("no docker-compose and no `docker compose` plugin")
    return Docker(cli, compose), started


def _alive(pid: int) -> bool:
    """`pid` runs and is not a zombie (a dockerd started here is not our child)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stop_dockerd(d: Docker, pid: int) -> None:
    """End the engine this module started: SIGTERM, then SIGKILL after 60 s.

    Containers of someone else (another test run that found the engine answering) keep
    it running: they would be killed with it.
    """
    with open(f"/proc/{pid}/comm") as f:
        assert f.read().strip() == "dockerd", f"pid {pid} is no longer our dockerd"
    others = d("ps", "-q", timeout=30, check=False).split()
    if others:
        print(f"dockerd (pid {pid}) left running: containers {others} still use it")
        return
    os.kill(pid, signal.SIGTERM)
    try:
        wait_until(lambda: not _alive(pid), 60, "dockerd to exit", poll=0.2)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 10, "dockerd to die", poll=0.2)
    print(f"dockerd (pid {pid}), started for these tests, stopped")


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    """A Docker engine that answers, and the image `IMAGE` built from this checkout."""
    started = time.monotonic()
    d, dockerd = _engine()
    try:
        yield from _images(d, started)
    finally:
        if dockerd is not None:
            _stop_dockerd(d, dockerd)


def _images(d: Docker, started: float) -> Iterator[Docker]:
    """Build the base image (once) and the image of this checkout; yield `d`."""
    engine_s = time.monotonic() - started
    base = BASE_IMAGE
    if run([d.cli, "image", "inspect", base], timeout=30, check=False).returncode != 0:
        if os.geteuid() == 0 and _which("debootstrap"):
            run(
                [str(DOCKER_DIR / "build-base.sh"), base],
                timeout=420,
                env={**os.environ, "DOCKER": d.cli},
            )
        else:  # a normal machine with a registry
            base = "python:3.11-slim"
    base_s = time.monotonic() - started - engine_s
    # as docs/docker.md runs it: the python3 on PATH, not this test's interpreter
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    run([str(DOCKER_DIR / "build-wheels.sh")], timeout=420, env=env)
    wheels_s = time.monotonic() - started - engine_s - base_s
    d(
        "build",
        "--network",
        "none",
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        "OFFLINE=1",
        "-t",
        IMAGE,
        str(DOCKER_DIR),
        timeout=600,
    )
    # earlier builds of the tag, now untagged and unused (a running one is kept)
    d("image", "prune", "-f", "--filter", "label=org.opencontainers.image.title=zmqsync")
    build_s = time.monotonic() - started - engine_s - base_s - wheels_s
    print(
        f"docker setup: engine {engine_s:.1f} s, base image {base_s:.1f} s, "
        f"wheels {wheels_s:.1f} s, image build {build_s:.1f} s"
    )
    yield d


def test_build_wheels_with_the_python3_on_path(tmp_path: Path) -> None:
    """docker/build-wheels.sh as docs/docker.md runs it, with whatever python3 the host
    has (a system one often has setuptools older than 70.1 and no `wheel`); no Docker
    needed. Run on a copy of the sources, so that docker/dist is left alone."""
    python3 = shutil.which("python3")
    if (
        python3 is None
        or run([python3, "-m", "pip", "--version"], timeout=60, check=False).returncode
    ):
        pytest.skip("no python3 with pip on PATH")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    shutil.copytree(ROOT / "zmqsync", tmp_path / "zmqsync", ignore=ignore)
    (tmp_path / "docker").mkdir()
    shutil.copy(DOCKER_DIR / "build-wheels.sh", tmp_path / "docker" / "build-wheels.sh")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    done = run([str(tmp_path / "docker" / "build-wheels.sh"), "--no-deps"], timeout=300, env=env)
    (wheel,) = (tmp_path / "docker" / "dist").glob("zmqsync-*.whl")
    assert done.stdout.strip() == f"build-wheels: {wheel}"


# --- a compose project ----------------------------------------------------------------


class Project:
    """One `docker-compose -p NAME` run of docker/docker-compose.yml (+ overrides)."""

    def __init__(self, d: Docker, files: list[Path], **env: str) -> None:
        self.d = d
        self.name = f"zstest{uuid.uuid4().hex[:10]}"
        self.files = files
        self.env = {**os.environ, "ZMQSYNC_IMAGE": IMAGE, **env}

    def compose(self, *args: str, timeout: float = 120) -> str:
        files = [arg for f in self.files for arg in ("-f", str(f))]
        cmd = [*self.d.compose_cmd, "-p", self.name, *files, *args]
        return run(cmd, timeout=timeout, env=self.env).stdout

    def container(self, service: str) -> str:
        ids = self.d.ids(self.name, service)
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def records(self, service: str) -> list[dict[str, Any]]:
        return self.d.records(self.container(service))

    def status(self, service: str) -> str:
        return str(self.d.inspect(self.container(service))["State"]["Status"])

    def event(self, event: str, **match: Any) -> Callable[[], dict[str, Any] | None]:
        """A predicate: the trainer's first `event` record with these fields, if any."""

        def find() -> dict[str, Any] | None:
            for rec in self.records("trainer"):
                if rec.get("event") == event and all(rec.get(k) == v for k, v in match.items()):
                    return rec
            return None

        return find

    def logs_tail(self) -> str:
        files = [arg for f in self.files for arg in ("-f", str(f))]
        cmd = [*self.d.compose_cmd, "-p", self.name, *files, "logs", "--no-color", "--tail=40"]
        proc = run(cmd, timeout=60, env=self.env, check=False)
        return proc.stdout[-20000:] + proc.stderr[-2000:]

    def down(self) -> None:
        """`down -v`, then remove by label anything left (also after a failed `up`)."""
        try:
            self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=180)
        finally:
            for cid in self.d.ids(self.name):
                self.d("rm", "-f", "-v", cid, timeout=60, check=False)
            for vol in self.d.ids(self.name, kind="volume"):
                self.d("volume", "rm", "-f", vol, timeout=60, check=False)
            for net in self.d.ids(self.name, kind="network"):
                self.d("network", "rm", net, timeout=60, check=False)

    @contextlib.contextmanager
    def running(self, services: list[str]) -> Iterator[list[str]]:
        """`up -d`, yielding the containers of `services`; on leaving: the logs' tail if
        the block failed, `down`, and (when it passed) nothing of the project left."""
        containers: list[str] = []
        try:
            self.compose("up", "-d", "--no-build", timeout=240)
            containers.extend(self.container(s) for s in services)
            yield containers
        except BaseException:
            print(self.logs_tail())
            raise
        finally:
            self.down()
        self.assert_gone(containers)

    def assert_gone(self, containers: list[str]) -> None:
        assert self.d.ids(self.name) == [], "containers left behind"
        assert self.d.ids(self.name, kind="volume") == [], "volumes left behind"
        assert self.d.ids(self.name, kind="network") == [], "networks left behind"
        root = self.d("info", "--format", "{{.DockerRootDir}}").strip()
        for cid in containers:  # its /dev/shm mount lived there
            assert not os.path.exists(os.path.join(root, "containers", cid)), cid


def host_segments() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("zmqsync-policy-")}


def interfaces(d: Docker, container: str) -> list[str]:
    code = "import socket; print(' '.join(n for _, n in socket.if_nameindex()))"
    return d("exec", container, "python3", "-c", code).split()


def assert_volume_empty(d: Docker, volume: str) -> None:
    """Nothing left in `volume` (what close() must remove is gone before `down -v`)."""
    left = d(
        "run", "--rm", "--network", "none", "-v", f"{volume}:/volume", IMAGE, "ls", "-A", "/volume"
    )
    assert left.split() == [], left


def worker_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    summaries = [r for r in records if r.get("event") == "summary"]
    assert summaries, f"no summary line: {records[-3:]}"
    return summaries[-1]


def check_worker(name: str, records: list[dict[str, Any]], last: int) -> dict[str, Any]:
    """The worker applied `last` and verified the checksum of every version it applied."""
    applied = [r for r in records if r.get("event") == "applied"]
    assert applied, f"{name} applied nothing"
    for rec in applied:
        assert rec["ok"] is True, f"{name}: checksum mismatch {rec}"
        assert rec["expected"] is not None and rec["checksum"] == rec["expected"], rec
    assert any(r["version"] == last for r in applied), f"{name} never applied v{last}"
    summary = worker_summary(records)
    assert summary["last_version"] == last, summary
    assert summary["mismatches"] == [], summary
    assert summary["verified"] == summary["applied"] >= 1, summary
    return summary


# --- the tests --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_three_workers_kill_and_restart(docker: Docker) -> None:
    """Trainer + 3 workers + sniffer sharing the trainer's IPC and network namespaces."""
    before = host_segments()
    project = Project(docker, [COMPOSE], ZMQSYNC_UPDATES="40", ZMQSYNC_INTERVAL="0.5")
    services = ["trainer", *WORKERS, "sniffer"]
    with project.running(services):
        trainer = project.container("trainer")

        # isolation: only loopback, in one namespace that the trainer owns; no network
        for service in services:
            host_config = docker.inspect(project.container(service))["HostConfig"]
            want = "none" if service == "trainer" else f"container:{trainer}"
            assert host_config["NetworkMode"] == want, (service, host_config["NetworkMode"])
            if service in WORKERS:
                assert host_config["IpcMode"] == f"container:{trainer}", service
        trainer_config = docker.inspect(trainer)["HostConfig"]
        assert trainer_config["IpcMode"] == "shareable"
        assert trainer_config["ShmSize"] == 256 * 2**20
        assert docker.ids(project.name, kind="network") == []
        started = wait_until(project.event("started"), 120, "the trainer to start")
        assert interfaces(docker, trainer) == ["lo"]
        assert interfaces(docker, project.container("worker-1")) == ["lo"]
        segment = started["segments"][0]

        # everyone joins and applies; the segment lives in the trainer's shared /dev/shm
        wait_until(project.event("joined"), 180, "3 workers to join")

        def all_at(version: int) -> bool:
            return all(
                any(
                    r.get("event") == "applied" and r["version"] >= version
                    for r in project.records(w)
                )
                for w in WORKERS
            )

        wait_until(lambda: all_at(3), 120, "every worker to apply version 3")
        wait_until(
            lambda: any(
                r.get("type") == "ack" and r.get("worker_id") == "worker-3"
                for r in project.records("sniffer")
            ),
            120,
            "the sniffer to see worker-3's acks",
        )
        shm = docker("exec", project.container("worker-1"), "ls", "/dev/shm").split()
        assert segment in shm, shm
        assert segment not in os.listdir("/dev/shm")  # not the host's /dev/shm

        # SIGKILL worker-3: the trainer drops it and goes on
        victim = project.container("worker-3")
        docker("kill", victim)
        killed_at = time.time()
        published = [r for r in project.records("trainer") if r["event"] == "published"]
        killed_version = published[-1]["version"]
        dropped = wait_until(
            lambda: next(
                (
                    r
                    for r in project.records("trainer")
                    if r["event"] == "published"
                    and r["ts"] > killed_at
                    and "worker-3" not in r["workers"]
                ),
                None,
            ),
            60,
            "the trainer to drop the killed worker",
        )
        assert project.status("trainer") == "running"
        lines_before_restart = len(docker.records(victim))

        # a restarted worker-3 container re-joins and catches up
        docker("start", victim)
        done = wait_until(project.event("done"), 300, "the trainer to finish", poll=1.0)
        for w in WORKERS:
            wait_until(lambda w=w: project.status(w) == "exited", 60, f"{w} to exit")

        # the trainer: every version published, none waited for the dead worker for long
        trainer_records = project.records("trainer")
        assert done["rc"] == 0, trainer_records[-5:]
        last = done["version"]
        published = [r for r in trainer_records if r["event"] == "published"]
        assert [r["version"] for r in published] == list(range(1, last + 1))
        assert all(r["ms"] < (PUBLISH_TIMEOUT_S + 2) * 1e3 for r in published), published
        after_kill = [r for r in published if r["ts"] > killed_at]
        assert dropped in after_kill
        assert any("worker-3" not in r["acked"] for r in after_kill)
        assert sorted(published[-1]["acked"]) == list(WORKERS)
        closed = next(r for r in trainer_records if r["event"] == "closed")
        assert closed["segments"] == [], "close() left a segment in /dev/shm"

        # every worker applied the last version, each one verified
        for w in WORKERS:
            cid = project.container(w)
            assert docker.inspect(cid)["State"]["ExitCode"] == 0, w
            records = docker.records(cid)
            if w == "worker-3":
                records = records[lines_before_restart:]  # its second run
            summary = check_worker(w, records, last)
            if w == "worker-3":
                assert summary["versions"][0] > killed_version, summary  # caught up

        # the sniffer saw every worker's acks, the eviction and the re-join
        docker("stop", "-t", "5", project.container("sniffer"), timeout=60)
        seen = docker.records(project.container("sniffer"))
        assert seen, "the sniffer printed nothing"
        for rec in seen:
            assert {"ts", "dir", "type", "peer"} <= set(rec), rec
        for w in WORKERS:
            acked = {r["version"] for r in seen if r["type"] == "ack" and r["worker_id"] == w}
            assert last in acked, f"sniffer: no ack of v{last} from {w}"
        acks3 = {r["version"] for r in seen if r["type"] == "ack" and r["worker_id"] == "worker-3"}
        assert min(acks3) <= killed_version < max(acks3), acks3
        assert any(
            r["type"] == "stop" and r["dir"] == "out" and r["peer"] == "worker-3" for r in seen
        ), "sniffer: no STOP evicting worker-3"
        assert any(
            r["type"] == "hello" and r["peer"] == "worker-3" and r["ts"] > killed_at for r in seen
        ), "sniffer: worker-3 did not re-join"
        assert all(r["dir"] == "in" for r in seen if r["type"] == "ack")
    assert host_segments() == before


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_tmpfs_volume_variant(docker: Docker) -> None:
    """Private IPC namespaces; the segment lives in a tmpfs volume shared by all."""
    project = Project(docker, [COMPOSE, TMPFS], ZMQSYNC_UPDATES="12", ZMQSYNC_INTERVAL="0.4")
    with project.running(["trainer", *WORKERS, "sniffer"]):
        for service in ("trainer", *WORKERS):
            assert docker.inspect(project.container(service))["HostConfig"]["IpcMode"] == "private"
        (volume,) = docker.ids(project.name, kind="volume")
        options = docker.inspect(volume)["Options"]
        assert options["type"] == "tmpfs", options

        started = wait_until(project.event("started"), 120, "the trainer to start")
        assert started["shm_dir"] == "/segments"
        segment = started["segments"][0]
        wait_until(project.event("joined"), 180, "3 workers to join")
        worker = project.container("worker-1")
        assert segment in docker("exec", worker, "ls", "/segments").split()
        assert segment not in docker("exec", worker, "ls", "/dev/shm").split()

        done = wait_until(project.event("done"), 300, "the trainer to finish", poll=1.0)
        assert done["rc"] == 0
        for w in WORKERS:
            wait_until(lambda w=w: project.status(w) == "exited", 60, f"{w} to exit")
            check_worker(w, project.records(w), done["version"])
        # close() unlinked the segment: the volume is empty before `down -v` drops it
        assert_volume_empty(docker, volume)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_curve_variant(docker: Docker) -> None:
    """CURVE on the trainer's bus; the workers and the sniffer take the keys from the
    trainer's runtime dir, a shared volume. Every publish must be acked by all workers
    within 2 s, under the 3 s a silent worker is given (6 heartbeats): acked by the
    RECEIVE itself, never after a re-join."""
    project = Project(
        docker,
        [COMPOSE, CURVE],
        ZMQSYNC_UPDATES="12",
        ZMQSYNC_INTERVAL="0.4",
        ZMQSYNC_PUBLISH_TIMEOUT="2",
    )
    address = "tcp://127.0.0.1:5555"
    with project.running(["trainer", *WORKERS, "sniffer"]):
        started = wait_until(project.event("started"), 120, "the trainer to start")
        assert started["curve"] is True
        worker = project.container("worker-1")
        assert docker("exec", worker, "ls", "/run/zmqsync").split() == ["policy.curve"]
        # with the keys, inspect answers; without them (same network namespace) nothing
        state = json.loads(docker("exec", worker, "zmqsync", "inspect", address, "--json"))
        assert state["access"]["curve"] is True
        no_keys = ["-e", "ZMQSYNC_CURVE_CLIENT=", "-e", "ZMQSYNC_RUNTIME_DIR=/tmp/nokeys"]
        denied = run(
            [docker.cli, "exec", *no_keys, worker, "zmqsync", "inspect", address, "--timeout", "2"],
            timeout=60,
            check=False,
        )
        assert denied.returncode == 1 and "ConnectTimeout" in denied.stderr, denied.stderr

        joined = wait_until(project.event("joined"), 180, "3 workers to join")
        done = wait_until(project.event("done"), 300, "the trainer to finish", poll=1.0)
        assert done["rc"] == 0
        published = [r for r in project.records("trainer") if r["event"] == "published"]
        assert [r["version"] for r in published] == list(range(1, done["version"] + 1))
        for rec in published:
            assert rec["missing"] == [] and rec["acked"] == list(WORKERS), rec
        ms = sorted(r["ms"] for r in published)
        print(f"curve compose: publish p50 {ms[len(ms) // 2]} ms, max {ms[-1]} ms")
        assert joined["ts"] < published[0]["ts"]
        for w in WORKERS:
            wait_until(lambda w=w: project.status(w) == "exited", 60, f"{w} to exit")
            records = project.records(w)
            check_worker(w, records, done["version"])
            assert [r["event"] for r in records].count("joined") == 1, w
        # the sniffer read the tap through CURVE: every worker's last ack
        docker("stop", "-t", "5", project.container("sniffer"), timeout=60)
        seen = docker.records(project.container("sniffer"))
        for w in WORKERS:
            acked = {r["version"] for r in seen if r["type"] == "ack" and r["worker_id"] == w}
            assert done["version"] in acked, f"sniffer: no ack of the last version from {w}"
        # close() removed the keys: the volume is empty before `down -v` drops it
        (volume,) = docker.ids(project.name, kind="volume")
        assert_volume_empty(docker, volume)


# run inside the exporter's container: the scrape as Prometheus would make it
_SCRAPE = (
    "import urllib.request; "
    "print(urllib.request.urlopen('http://127.0.0.1:9108/metrics', timeout=10).read().decode())"
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_metrics_variant(docker: Docker) -> None:
    """`zmqsync metrics` beside the unmodified trainer, in its network namespace: the
    scrape (parsed with prometheus-client's parser) shows the trainer's versions and its
    three workers; once the trainer has exited, zmqsync_up 0."""
    from prometheus_client.parser import text_string_to_metric_families

    project = Project(docker, [COMPOSE, METRICS], ZMQSYNC_UPDATES="30", ZMQSYNC_INTERVAL="0.3")

    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        exporter = project.container("exporter")
        out = run([docker.cli, "exec", exporter, "python", "-c", _SCRAPE], timeout=60, check=False)
        if out.returncode != 0:
            return None
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(out.stdout)
            for s in family.samples
        }

    def up(value: float) -> Callable[[], Any]:
        def check() -> Any:
            samples = scrape()
            if samples and samples.get(("zmqsync_up", (("bus", "policy"),))) == value:
                return samples
            return None

        return check

    with project.running(["trainer", *WORKERS, "sniffer", "exporter"]):
        wait_until(project.event("joined"), 180, "3 workers to join")
        wait_until(project.event("published", version=3), 120, "version 3")
        samples = wait_until(up(1.0), 120, "the exporter to report the bus")
        version = samples[("zmqsync_version", (("bus", "policy"),))]
        assert version >= 3
        assert samples[("zmqsync_workers", (("bus", "policy"),))] == 3
        for w in WORKERS:
            acked = samples[("zmqsync_worker_version", (("bus", "policy"), ("worker", w)))]
            assert version - 2 <= acked <= version, (w, acked, version)
        assert samples[("zmqsync_publishes_total", (("bus", "policy"),))] == version
        done = wait_until(project.event("done"), 300, "the trainer to finish", poll=1.0)
        assert done["rc"] == 0
        wait_until(up(0.0), 120, "zmqsync_up 0 once the trainer is gone")


@pytest.mark.slow  # its fixture may install Docker and build the images
@pytest.mark.timeout(300)
def test_compose_files_are_valid(docker: Docker) -> None:
    """Every variant parses; the GPU one shares the PID namespace and reserves GPUs."""
    for files, expected in (
        ([COMPOSE], ["ipc: shareable", "network_mode: none", "shm_size"]),
        ([COMPOSE, TMPFS], ["ipc: private", "/segments", "type: tmpfs"]),
        ([COMPOSE, GPU], ["pid: service:trainer", "capabilities", "driver: nvidia"]),
        ([COMPOSE, CURVE], ["--curve", "ZMQSYNC_CURVE_CLIENT: /run/zmqsync/policy.curve"]),
        ([COMPOSE, METRICS], ["zmqsync metrics tcp://127.0.0.1:5555 --port 9108"]),
    ):
        out = Project(docker, files).compose("config", timeout=60)
        for text in expected:
            assert text in out, (files, text)
