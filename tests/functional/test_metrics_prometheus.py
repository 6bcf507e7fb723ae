"""The role's node_exporter metrics beside dcgm-exporter, read by real Prometheus (issue 31).

The role runs on a simulated node and writes its textfile metrics; Debian's node_exporter (its textfile collector
pointed at that directory) and a dcgm-exporter-shaped endpoint (the simulated GPUs, served on the loopback as
dcgm-exporter serves them) are scraped by Debian's Prometheus, all on the loopback, started and stopped here. Every
join the guide gives ("Records", "Joins with dcgm-exporter") is run as written there and must return what it says;
promtool's check reports the camelCase labels kept from dcgm-exporter, and nothing else.
"""

from __future__ import annotations

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

from gpusim import Node
from support.ansible import ROOT, local_inventory, run_playbook

UNPACKED = ROOT / ".build" / "debian" / "usr" / "bin"
GUIDE = ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst"

#: The guide's joins, each with the series it must return here: host-a cleaned GPU 0, host-b's GPU 1 holds memory no
#: process holds (its clean failed), both hosts' files in the one textfile directory of the node, as a hypervisor
#: holds its containers' files.
JOINS = {
    # dcgm-exporter's series, with the host the clean names.
    "DCGM_FI_DEV_FB_USED * on(UUID) group_left(host) group by (UUID, host) (clean_slate_gpu_used_mib)": {("0", "host-a"): 0, ("1", "host-b"): 4096},
    # The GPUs, as dcgm-exporter reads them, of hosts whose last clean failed.
    ("DCGM_FI_DEV_FB_USED * on(UUID) group_left(host) (group by (UUID, host) (clean_slate_gpu_used_mib) and on(host) (clean_slate_last_run_success == 0))"): {
        ("1", "host-b"): 4096
    },
    # dcgm-exporter's GPUs on the nodes where a clean failed: node_exporter and dcgm-exporter on the same machine,
    # scraped at the same address on two ports.
    (
        'label_replace(DCGM_FI_DEV_FB_USED, "node", "$1", "instance", "(.+):[0-9]+")'
        ' and on(node) label_replace(clean_slate_last_run_success == 0, "node", "$1", "instance", "(.+):[0-9]+")'
    ): {("0", None): 0, ("1", None): 4096},
}
#: The guide's alerts, and the hosts each fires for here.
ALERTS = {
    "clean_slate_last_run_success == 0": {"host-b"},
    "time() - clean_slate_last_run_timestamp_seconds > 86400": set(),
}


def binary(name: str) -> str:
    """A binary of Debian's prometheus or prometheus-node-exporter package: unpacked by make setup
    (tools/install-system-deps), else installed."""
    path = UNPACKED / name
    found = str(path) if path.is_file() else shutil.which(name)
    assert found, f"{name} is missing: make setup unpacks Debian's prometheus and prometheus-node-exporter into {UNPACKED.parent.parent}"
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dcgm_text(node: Node) -> str:
    """What dcgm-exporter's /metrics serves for the node's GPUs now: its label names, in its order, the host label
    as its releases spell it (the machine's hostname, not an inventory name)."""
    lines = []
    for field, helptext in (("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)."), ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).")):
        lines += [f"# HELP {field} {helptext}", f"# TYPE {field} gauge"]
        for g in node.gpus:
            used = node.memory(g.index)["used_mib"]
            value = used if field.endswith("USED") else g.total_mib - g.reserved_mib - used
            labels = (
                f'gpu="{g.index}",UUID="{g.uuid}",pci_bus_id="{g.pci_bus_id}",device="nvidia{g.minor}",modelName="{g.name}",'
                f'Hostname="gpu-node-1",DCGM_FI_DRIVER_VERSION="580.159.04"'
            )
            lines.append(f"{field}{{{labels}}} {value}")
    return "\n".join(lines) + "\n"


class Dcgm(ThreadingHTTPServer):
    body = ""


class DcgmHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = t.cast(Dcgm, self.server).body.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: t.Any) -> None:
        pass


def query(port: int, expr: str) -> list[dict[str, t.Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.load(r)
    assert data["status"] == "success", data
    return list(data["data"]["result"])


def test_the_guides_joins_with_dcgm_exporter_work_in_prometheus(tmp_path: Path) -> None:
    guide = " ".join(GUIDE.read_text().split())
    for expr in [*JOINS, *ALERTS]:
        assert expr in guide, f"the guide does not give this query as tested: {expr}"
    prom_dir = tmp_path / "textfile"
    prom_dir.mkdir()
    with Node(gpus=2, seed="dcgm") as n:
        sb = n.sandbox()
        try:
            worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
            n.set_fault(orphan={1: 4096})  # held by no process: host-b's clean cannot free it
            common = {"clean_slate_device_dir": str(n.dev_dir), "clean_slate_metrics_dir": str(prom_dir), "clean_slate_verify_timeout": 0.5}
            hosts = {"host-a": {**common, "clean_slate_gpus": "0"}, "host-b": {**common, "clean_slate_gpus": "1"}}
            run = run_playbook(
                ROOT / "playbooks" / "clean_slate.yml", inventory=local_inventory(tmp_path / "hosts.yml", hosts), env=n.env(), wrapper=sb.nsenter_prefix()
            )
            assert run.rc == 2 and not worker.alive(), run.output
            dcgm = Dcgm(("127.0.0.1", 0), DcgmHandler)
            dcgm.body = dcgm_text(n)
        finally:
            sb.stop()
    assert sorted(p.name for p in prom_dir.iterdir()) == ["clean_slate_host-a.prom", "clean_slate_host-b.prom"]

    # promtool: the label names kept from dcgm-exporter (UUID, modelName) are its one finding, as for dcgm-exporter's own output.
    promtool = binary("promtool")
    for text in [*(p.read_text() for p in prom_dir.iterdir()), dcgm.body]:
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False)
        findings = {line.split(" ", 1)[1] for line in (check.stdout + check.stderr).splitlines() if line.strip()}
        assert check.returncode == 3 and findings == {"label names should be written in 'snake_case' not 'camelCase'"}, check

    threading.Thread(target=dcgm.serve_forever, daemon=True).start()
    node_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: node, static_configs: [{{targets: ['127.0.0.1:{node_port}']}}]}}\n"
        f"  - {{job_name: dcgm, static_configs: [{{targets: ['127.0.0.1:{dcgm.server_address[1]}']}}]}}\n"
    )
    procs = [
        subprocess.Popen(
            [binary("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{node_port}", "--collector.disable-defaults", "--collector.textfile",
             f"--collector.textfile.directory={prom_dir}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ),
    ]  # fmt: skip
    try:
        # Until both targets were scraped (Prometheus takes a moment to start, then scrapes each second).
        deadline = time.monotonic() + 60
        while True:
            try:
                ready = query(
                    prom_port, 'count(up{job=~"node|dcgm"} == 1) == 2 and count(clean_slate_last_run_success) == 2 and count(DCGM_FI_DEV_FB_USED) == 2'
                )
            except OSError:
                ready = []
            if ready or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert ready, "Prometheus did not scrape node_exporter and the dcgm-exporter endpoint within 60 s"
        # node_exporter read both files whole.
        assert [float(r["value"][1]) for r in query(prom_port, "node_textfile_scrape_error")] == [0.0]
        for expr, want in JOINS.items():
            got = {(r["metric"]["gpu"], r["metric"].get("host")): float(r["value"][1]) for r in query(prom_port, expr)}
            assert got == want, (expr, got)
        for expr, hosts in ALERTS.items():
            assert {r["metric"]["host"] for r in query(prom_port, expr)} == hosts, expr
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
