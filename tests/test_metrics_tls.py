"""The metrics exporter over TLS with client certificates, and what a scraper may cost.

A CA, a server certificate and client certificates are made at test time with the
``openssl`` CLI (tests/helpers/tls_certs.py). A real trainer, a real worker and a real
``zmqsync metrics`` process with ``--tls-cert/--tls-key/--tls-client-ca`` run side by
side: a scrape with the CA's client certificate gets the bus's metrics; one with no
certificate, one with another CA's and one in plain HTTP get nothing; an idle connection
stalls no one; and however many scrapes come, the publisher is asked at most once per
``--min-interval``.
"""

from __future__ import annotations

import http.client
import re
import signal
import socket
import ssl
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import zmqsync
from tests.helpers.tls_certs import Pki, make_pki
from tests.test_metrics import Samples, _publish, _trainer, parse, value
from tests.test_peer_text import _free_port
from zmqsync._buffers import collect_garbage
from zmqsync.cli import main
from zmqsync.metrics import ServerTLS, StateCollector, serve

REFUSED = (OSError, http.client.HTTPException)  # ssl.SSLError and URLError are OSErrors


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    return make_pki(d)


def _client(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A scraper's context: it trusts the test CA, and shows `cert` if given."""
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def tls_scrape(port: int, ctx: ssl.SSLContext, timeout: float = 5.0) -> Samples:
    url = f"https://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, context=ctx, timeout=timeout) as reply:
        assert reply.status == 200
        return parse(reply.read().decode())


def tls_scrape_until(
    port: int, ctx: ssl.SSLContext, ready: Callable[[Samples], bool], timeout: float = 30.0
) -> Samples:
    """Scrape until `ready(samples)`; the exporter may not listen yet at first."""
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        try:
            samples = tls_scrape(port, ctx)
        except REFUSED as exc:
            last = exc
        else:
            if ready(samples):
                return samples
            last = samples
        time.sleep(0.1)
    raise AssertionError(f"no ready scrape within {timeout} s; last: {last!r}")


def _plain_http(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return bytes(reply.read())


@pytest.mark.timeout(150)
def test_tls_exporter_answers_only_scrapers_with_a_certificate_of_its_ca(
    spawn, name, bus_dirs, pki
):
    procs = []
    try:
        trainer, _ = _trainer(spawn, name)
        procs.append(trainer)
        worker = spawn("worker", "--name", name, "--json", "--forever", "--worker-id", "wa")
        procs.append(worker)
        worker.wait_for(lambda r: r.get("event") == "joined")
        assert _publish(trainer, 1)["event"] == "published"
        port = _free_port()
        exporter = spawn(
            "metrics", "--name", name, "--port", str(port), "--min-interval", "60",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca),
        )  # fmt: skip
        procs.append(exporter)
        allowed = _client(pki, pki.client_cert, pki.client_key)
        s = tls_scrape_until(port, allowed, lambda s: value(s, "zmqsync_up", bus=name) == 1)
        assert value(s, "zmqsync_version", bus=name) == 1
        assert value(s, "zmqsync_workers", bus=name) == 1
        assert value(s, "zmqsync_worker_lag", bus=name, worker="wa") == 0

        idle = socket.create_connection(("127.0.0.1", port), timeout=5)  # sends nothing
        try:
            start = time.monotonic()
            for _ in range(10):  # served beside the idle connection, from one INSPECT
                assert value(tls_scrape(port, allowed), "zmqsync_version", bus=name) == 1
            assert time.monotonic() - start < 20
        finally:
            idle.close()
        for refused in (
            _client(pki),  # no certificate
            _client(pki, pki.stranger_cert, pki.stranger_key),  # another CA's
        ):
            with pytest.raises(REFUSED):
                tls_scrape(port, refused)
        with pytest.raises(REFUSED):
            _plain_http(port)
        assert value(tls_scrape(port, allowed), "zmqsync_up", bus=name) == 1  # still serving

        exporter.proc.send_signal(signal.SIGTERM)
        assert exporter.finish() == 143  # ended by SIGTERM (128 + 15), as every command
        assert "Traceback" not in exporter.stderr, exporter.stderr[-2000:]
    finally:
        for proc in procs:
            proc.kill()
        collect_garbage(str(bus_dirs[1]))


@pytest.mark.timeout(60)
def test_scrapes_share_one_inspect_per_min_interval(name):
    """Twenty scrapes within `min_interval` cost the publisher one INSPECT; they see the
    bus as it was then, a worker's last-seen time aged by the time since."""
    with (
        zmqsync.Publisher({"w": torch.zeros(64)}, name=name, heartbeat=5.0) as pub,
        zmqsync.Subscriber(name=name, model=None, worker_id="me") as sub,
    ):
        assert pub.wait_for_workers(1, timeout=10)
        cached = StateCollector(pub.address, name, timeout=5.0, min_interval=600)
        fresh = StateCollector(pub.address, name, timeout=5.0, min_interval=0)
        try:
            first = cached.sample()
            assert first is not None and first.version == 0
            pub.publish()
            assert sub.wait_for_version(1, timeout=10)
            time.sleep(0.05)  # so that the aging is visible
            later = [cached.sample() for _ in range(19)]
            assert cached.scrapes == 20 and cached.inspects == 1 and cached.failures == 0
            assert all(s is not None and s.version == 0 for s in later)
            assert later[-1] is not None
            assert later[-1].workers[0].silent_s >= first.workers[0].silent_s + 0.05
            for _ in range(3):
                now = fresh.sample()
                assert now is not None and now.version == 1
            assert fresh.inspects == 3
        finally:
            cached.close()
            fresh.close()
    with pytest.raises(ValueError, match="min_interval"):
        StateCollector("ipc:///nonexistent/x.sock", "x", min_interval=-1)


@pytest.mark.timeout(60)
def test_an_unanswered_inspect_is_reused_too(tmp_path):
    """A publisher that does not answer is not asked again within `min_interval`: a
    scraper hammering a stuck bus does not pile INSPECTs into its queue."""
    collector = StateCollector(f"ipc://{tmp_path}/nobody.sock", "x", timeout=0.3, min_interval=600)
    try:
        assert [collector.sample() for _ in range(5)] == [None] * 5
        assert collector.inspects == 1 and collector.failures == 1
    finally:
        collector.close()


def _bad_flags(pki: Pki, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    return {
        "missing cert": (["--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", key],
                         "TLS certificate '.*nope.crt': no such file"),
        "missing key": (["--tls-cert", cert, "--tls-key", str(tmp_path / "nope.key")],
                        "TLS key '.*nope.key': no such file"),
        "garbage cert": (["--tls-cert", str(garbage), "--tls-key", key],
                         "do not load .*both must be PEM"),
        "key of another cert": (["--tls-cert", cert, "--tls-key", str(pki.client_key)],
                                "do not load .*KEY_VALUES_MISMATCH"),
        "missing client CA": (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca",
                               str(tmp_path / "nope-ca.crt")], "client CA file .*no such file"),
        "garbage client CA": (["--tls-cert", cert, "--tls-key", key, "--tls-client-ca",
                               str(garbage)], "client CA file .*does not load"),
        "cert without key": (["--tls-cert", cert], "--tls-cert and --tls-key go together"),
        "client CA alone": (["--tls-client-ca", ca], "--tls-client-ca needs --tls-cert"),
    }  # fmt: skip


BAD = [
    "missing cert",
    "missing key",
    "garbage cert",
    "key of another cert",
    "missing client CA",
    "garbage client CA",
    "cert without key",
    "client CA alone",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", BAD)
def test_a_missing_or_bad_tls_file_is_one_line_and_exit_1(case, name, pki, tmp_path, capsys):
    """Checked before the bus is asked (there is none here) and before a port is bound."""
    flags, message = _bad_flags(pki, tmp_path)[case]
    assert main(["metrics", "--name", name, "--port", "0", *flags]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zmqsync metrics: ValueError: "), err
    assert re.search(message, lines[0]), lines[0]
    assert out == ""


@pytest.mark.timeout(60)
def test_serve_in_process_with_tls_and_a_worker_collector(name, pki):
    """`serve` is what a trainer or worker that exports its own metrics can call too."""
    from prometheus_client import CollectorRegistry

    from zmqsync.metrics import PublisherCollector

    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name) as pub:
        registry = CollectorRegistry()
        registry.register(PublisherCollector(pub))
        tls = ServerTLS(str(pki.server_cert), str(pki.server_key), str(pki.ca))
        server, thread = serve(registry, 0, tls=tls)
        try:
            port = server.server_address[1]
            s = tls_scrape(port, _client(pki, pki.client_cert, pki.client_key))
            with pytest.raises(REFUSED):
                tls_scrape(port, _client(pki))
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
    assert value(s, "zmqsync_up", bus=name) == 1
