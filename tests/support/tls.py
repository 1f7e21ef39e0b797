"""A self-signed certificate for a test's TLS server, and a client context that trusts it."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path


def self_signed(folder: Path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a new certificate for ``name`` (DNS), and a client context that
    trusts that certificate alone (made by ``openssl``, one day valid)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    command = f"openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN={name}"
    san = f"subjectAltName=DNS:{name}"
    subprocess.run(
        [*command.split(), "-addext", san, "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))
