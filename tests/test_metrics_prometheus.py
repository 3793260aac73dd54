"""The shipped Grafana dashboard and Prometheus alerts, against a real Prometheus.

`promtool test rules` runs the unit tests next to the rules (docs/prometheus/). Then a
real Prometheus server (127.0.0.1 only, a temporary storage dir, killed at the end)
scrapes a real ``zmqsync metrics`` over HTTPS with a client certificate, the scrape
config docs/metrics.md gives, beside a real trainer and worker; every expression of
docs/grafana/zmqsync-dashboard.json is then asked through Prometheus' HTTP API and must
answer without error and with series. The rules are loaded there too, and must be
healthy.

Debian's ``prometheus`` package has both programs. Where they are missing, the module
installs it once with apt-get, as tests/test_docker.py installs Docker (CI runs as root
on a fresh machine); without root or apt-get the tests are skipped, saying why.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers.tls_certs import Pki, make_pki
from tests.test_metrics import _publish, _trainer
from tests.test_peer_text import _free_port
from zmqsync._buffers import collect_garbage

RULES = ROOT / "docs" / "prometheus" / "zmqsync-alerts.yml"
RULE_TESTS = ROOT / "docs" / "prometheus" / "zmqsync-alerts.test.yml"
DASHBOARD = ROOT / "docs" / "grafana" / "zmqsync-dashboard.json"
# What Grafana puts in place of the dashboard's variables when every bus is chosen.
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$bus": ".*"}


def _install_prometheus() -> tuple[str, str]:
    """prometheus and promtool, installed from Debian's archive if missing (root only)."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if found[0] and found[1]:
        return found[0], found[1]
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("prometheus/promtool missing, and no root apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"],
    )
    logs = ""
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
        logs += done.stderr
    if os.path.isdir("/run/systemd/system"):  # the package's service listens on *:9090
        subprocess.run(["systemctl", "disable", "--now", "prometheus"], capture_output=True,
                       timeout=60, check=False)  # fmt: skip
    found = shutil.which("prometheus"), shutil.which("promtool")
    if not (found[0] and found[1]):
        pytest.skip(f"`apt-get install prometheus` did not provide both programs: {logs[-500:]}")
    return found[0], found[1]


@pytest.fixture(scope="module")
def prometheus_tools() -> tuple[str, str]:
    return _install_prometheus()


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    d = tmp_path / "pki"
    d.mkdir()
    return make_pki(d)


@pytest.mark.timeout(600)
def test_alert_rules_pass_promtool_check_and_their_unit_tests(prometheus_tools):
    promtool = prometheus_tools[1]
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        done = subprocess.run(
            [promtool, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent
        )
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
        assert "SUCCESS" in done.stdout + done.stderr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the dashboard, variables filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"an unknown variable in {panel['title']!r}: {expr}"
            out.append((panel["title"], expr))
    return out


def test_the_dashboard_is_importable_json():
    """What Grafana's import needs: a datasource input every panel and target use, ids
    and positions, and only the metrics the exporter exports."""
    d = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"]
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["title"]
    for p in d["panels"]:
        assert p["datasource"] == ds and all(t["datasource"] == ds for t in p["targets"])
        assert (
            set(p["gridPos"]) == {"h", "w", "x", "y"}
            and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        )
        assert p["type"] in {r["id"] for r in d["__requires"] if r["type"] == "panel"}
    assert [v["name"] for v in d["templating"]["list"]] == ["bus"]
    assert len(dashboard_queries()) >= 15


def _get(url: str, timeout: float = 10.0) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:  # a bad query: 400 with Prometheus' error
        return json.loads(exc.read())


class PrometheusServer:
    """A Prometheus on 127.0.0.1 with its storage in `d`, killed by `close()`."""

    def __init__(self, binary: str, config: Path, d: Path) -> None:
        self.port = _free_port()
        self.log = d / "prometheus.log"
        self.base = f"http://127.0.0.1:{self.port}"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={d / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=d,
                start_new_session=True,
            )  # fmt: skip

    def query(self, expr: str) -> dict[str, Any]:
        answer: dict[str, Any] = _get(
            f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        )
        return answer

    def wait(self, predicate, timeout: float, what: str, poke=None) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.tail()}")
            try:
                got = predicate()
            except (urllib.error.URLError, ConnectionError):
                got = None
            if got:
                return got
            if poke is not None:
                poke()
            time.sleep(0.5)
        raise AssertionError(f"not {what} within {timeout} s; prometheus said: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _config(d: Path, exporter_port: int, pki: Pki) -> Path:
    """docs/metrics.md's scrape config over TLS, with the rules, every second."""
    text = f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {RULES}
scrape_configs:
  - job_name: zmqsync
    scheme: https
    tls_config:
      ca_file: {pki.ca}
      cert_file: {pki.client_cert}
      key_file: {pki.client_key}
    static_configs:
      - targets: ["127.0.0.1:{exporter_port}"]
"""
    path = d / "prometheus.yml"
    path.write_text(text)
    return path


@pytest.mark.timeout(600)
def test_every_dashboard_expression_answers_from_a_real_prometheus(
    spawn, name, bus_dirs, tmp_path, pki, prometheus_tools
):
    procs, server = [], None
    try:
        trainer, _ = _trainer(spawn, name)
        procs.append(trainer)
        worker = spawn("worker", "--name", name, "--json", "--forever", "--worker-id", "wa")
        procs.append(worker)
        worker.wait_for(lambda r: r.get("event") == "joined")
        port = _free_port()
        exporter = spawn(
            "metrics", "--name", name, "--port", str(port), "--timeout", "0.5",
            "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--tls-client-ca", str(pki.ca),
        )  # fmt: skip
        procs.append(exporter)
        server = PrometheusServer(prometheus_tools[0], _config(tmp_path, port, pki), tmp_path)
        published = [0]

        def publish() -> None:
            published[0] += 1
            assert _publish(trainer, published[0])["event"] == "published"

        def scraped_enough() -> bool:
            # a few scrapes of a bus that is up, with publishes among them, so that
            # every rate() and histogram_quantile() has two samples in its window
            r = server.query(f'count_over_time(zmqsync_up{{bus="{name}"}}[1m]) >= 6')["data"]
            return bool(r["result"]) and published[0] >= 6

        server.wait(scraped_enough, 240, "scraped six times", poke=publish)
        publish()
        publish()
        targets = _get(f"{server.base}/api/v1/targets")["data"]["activeTargets"]
        assert [(t["health"], t["scrapeUrl"]) for t in targets] == [
            ("up", f"https://127.0.0.1:{port}/metrics")
        ], targets

        absent = server.query('zmqsync_no_such_metric{bus=~".*"}')  # the check can fail
        assert absent["status"] == "success" and absent["data"]["result"] == []
        failures = []
        for title, expr in dashboard_queries():
            answer = server.query(expr)
            result = answer.get("data", {}).get("result")
            if answer.get("status") != "success" or not result:
                failures.append(f"{title}: {expr} -> {answer}")
            elif "histogram_quantile" in expr:  # publishes in the window: a number
                values = [float(r["value"][1]) for r in result]
                if not all(math.isfinite(v) and v > 0 for v in values):
                    failures.append(f"{title}: {expr} -> {values}")
        assert failures == [], "\n".join(failures)

        lag = server.query(f'zmqsync_worker_lag{{bus="{name}"}}')["data"]["result"]
        assert [r["metric"]["worker"] for r in lag] == ["wa"]
        match = urllib.parse.urlencode({"match[]": "zmqsync_up"})
        buses = _get(f"{server.base}/api/v1/label/bus/values?{match}")
        assert buses["data"] == [name]  # the dashboard's $bus variable

        groups = _get(f"{server.base}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules
        firing = [
            a["labels"]["alertname"] for a in _get(f"{server.base}/api/v1/alerts")["data"]["alerts"]
        ]
        assert firing == [], firing  # fmt: skip
    finally:
        if server is not None:
            server.close()
        for proc in procs:
            proc.kill()
        collect_garbage(str(bus_dirs[1]))
