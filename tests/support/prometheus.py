"""Debian's Prometheus and node_exporter on the loopback, and a dcgm-exporter-shaped endpoint for simulated GPUs: the
role's textfile metrics read as a real Prometheus reads them beside dcgm-exporter.

The binaries are Debian's prometheus and prometheus-node-exporter packages, unpacked (not installed: their packages
start services) into the checkout's .build/debian by make setup (tools/install-system-deps). One Prometheus serves every
query of a test: it is started once, before the run that writes the metrics (its first scrape comes about 5 s after it
starts), and stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import threading
import time
import typing as t
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from support.ansible import ROOT

UNPACKED = ROOT / ".build" / "debian" / "usr" / "bin"


def binary(name: str) -> str:
    """A binary of Debian's prometheus or prometheus-node-exporter package: unpacked by make setup, else installed."""
    path = UNPACKED / name
    found = str(path) if path.is_file() else shutil.which(name)
    assert found, f"{name} is missing: make setup unpacks Debian's prometheus and prometheus-node-exporter into {UNPACKED.parent.parent}"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcgm_text(nodes: t.Sequence[t.Any]) -> str:
    """What dcgm-exporter's /metrics serves for the simulated nodes' GPUs now: its label names, in its order, the host
    label as its releases spell it (the machine's hostname, not an inventory name)."""
    lines = []
    for field, helptext in (("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."), ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).")):
        lines += [f"# HELP {field} {helptext}", f"# TYPE {field} gauge"]
        for node in nodes:
            for g in node.gpus:
                used = node.memory(g.index)["used_mib"]
                value = used if field.endswith("USED") else g.total_mib - g.reserved_mib - used
                labels = (
                    f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="{g.pci_bus_id}",device="nvidia{g.minor}",modelName="{g.name}",'
                    f'Hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="580.159.04"'
                )
                lines.append(f"{field}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


def promtool_findings(text: str) -> tuple[int, set[str]]:
    """promtool check metrics on ``text``: its exit status and its findings."""
    check = subprocess.run([binary("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False)
    return check.returncode, {line.split(" ", 1)[1] for line in (check.stdout + check.stderr).splitlines() if line.strip()}


class _Dcgm(ThreadingHTTPServer):
    body: t.Callable[[], str] = str


class _DcgmHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = t.cast(_Dcgm, self.server).body().encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: t.Any) -> None:
        pass


def _query(port: int, expr: str) -> list[dict[str, t.Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.load(r)
    assert data["status"] == "success", data
    return list(data["data"]["result"])


class Prometheus:
    """A running Prometheus scraping node_exporter and the dcgm-exporter endpoint."""

    def __init__(self, port: int) -> None:
        self.port = port

    def query(self, expr: str) -> list[dict[str, t.Any]]:
        return _query(self.port, expr)

    def settle(self, timeout: float = 60) -> None:
        """Wait until both targets were scraped, successfully, after this call began: the queries then see the files
        and the GPUs as they are now."""
        since = time.time()
        deadline = time.monotonic() + timeout
        expr = f'count(timestamp(up{{job=~"node|dcgm"}} == 1) > {since:.3f}) == 2'
        while True:
            try:
                if _query(self.port, expr):
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, f"Prometheus did not scrape node_exporter and the dcgm-exporter endpoint within {timeout} s"
            time.sleep(0.1)


@contextlib.contextmanager
def prometheus(textfile_dir: Path, dcgm_body: t.Callable[[], str], work: Path) -> t.Iterator[Prometheus]:
    """node_exporter (its textfile collector alone, on ``textfile_dir``) and a dcgm-exporter endpoint serving
    ``dcgm_body()`` at each scrape, both scraped four times a second by one Prometheus. Prometheus 2.42 hands its first
    targets to the scrapers about 5 s after it starts, so start it before the work that writes the metrics, and call
    ``settle()`` after it."""
    dcgm = _Dcgm(("127.0.0.1", 0), _DcgmHandler)
    dcgm.body = dcgm_body
    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    node_port, prom_port = free_port(), free_port()
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 250ms}\n"
        "scrape_configs:\n"
        f"  - {{job_name: node, static_configs: [{{targets: ['127.0.0.1:{node_port}']}}]}}\n"
        f"  - {{job_name: dcgm, static_configs: [{{targets: ['127.0.0.1:{dcgm.server_address[1]}']}}]}}\n"
    )
    exporter = [binary("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{node_port}", "--collector.disable-defaults"]
    exporter += ["--collector.textfile", f"--collector.textfile.directory={textfile_dir}"]
    server = [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in (exporter, server)]
    try:
        yield Prometheus(prom_port)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        dcgm.shutdown()
