"""A throwaway PKI for the metrics TLS tests, made with the `openssl` command line.

`make_pki(dir)` writes a CA, a server certificate for 127.0.0.1 and localhost, a client
certificate of that CA, and a client certificate of another CA (a scraper that has *a*
certificate, just not one the exporter trusts). EC P-256 keys: a whole set takes
~50 ms. The ``openssl`` CLI is used because it is on every machine that runs the suite
and the `cryptography` package is not a dependency.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

__all__ = ["Pki", "make_pki"]

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the PEM files `make_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # signed by another CA
    stranger_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        ["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)} failed: {done.stderr[-1000:]}")


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.crt",
             "-days", "2", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip


def _leaf(d: Path, name: str, ca: str, serial: int, extensions: str) -> None:
    (d / f"{name}.ext").write_text(extensions)
    _openssl("req", *_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-set_serial", str(serial), "-days", "2", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=d)  # fmt: skip


def make_pki(d: Path) -> Pki:
    """Write the CA and certificates into `d` (which must exist)."""
    if shutil.which("openssl") is None:
        raise AssertionError(
            "the metrics TLS tests need the openssl command (apt-get install openssl)"
        )
    _ca(d, "ca")
    _ca(d, "other-ca")
    server = "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    _leaf(d, "server", "ca", 2, server)
    _leaf(d, "client", "ca", 3, "extendedKeyUsage=clientAuth\n")
    _leaf(d, "stranger", "other-ca", 4, "extendedKeyUsage=clientAuth\n")
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Pki(
        ca=d / "ca.crt",
        server_cert=d / "server.crt",
        server_key=d / "server.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
        stranger_cert=d / "stranger.crt",
        stranger_key=d / "stranger.key",
    )
