"""A throwaway self-signed certificate for the simulator's HTTPS mode.

Generated with the ``openssl`` CLI when it is installed (a fresh key per
simulator); otherwise the pair committed beside this file is used. That pair
is a test fixture with no other use: never trust it outside the test suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FALLBACK_CERT = HERE / "certs" / "pvesim-test-only.crt"
FALLBACK_KEY = HERE / "certs" / "pvesim-test-only.key"

# A leaf that is its own trust anchor: CA:TRUE plus the key usages that
# Python 3.13's strict X.509 verification asks for, and SANs for 127.0.0.1
# and localhost so hostname checks pass when validate_certs is on.
OPENSSL_ARGS = [
    "req",
    "-x509",
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
    "-days",
    "3650",
    "-subj",
    "/CN=pvesim.invalid",
    "-addext",
    "subjectAltName=IP:127.0.0.1,DNS:localhost",
    "-addext",
    "basicConstraints=critical,CA:TRUE",
    "-addext",
    "keyUsage=critical,digitalSignature,keyCertSign",
    "-addext",
    "extendedKeyUsage=serverAuth",
]


def make_cert(directory: str | None = None) -> tuple[str, str, str | None]:
    """Return ``(certfile, keyfile, tmpdir)``; ``tmpdir`` is to be removed by the caller (None for the fallback)."""
    openssl = shutil.which("openssl")
    if openssl:
        tmp = directory or tempfile.mkdtemp(prefix="pvesim-tls-")
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        proc = subprocess.run([openssl, *OPENSSL_ARGS, "-keyout", key, "-out", cert], capture_output=True, text=True, check=False)
        if proc.returncode == 0:
            return cert, key, None if directory else tmp
        if not directory:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(FALLBACK_CERT), str(FALLBACK_KEY), None
