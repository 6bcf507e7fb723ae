"""The HTTP(S) front of the simulator: routing, auth, errors, latency, counting."""

from __future__ import annotations

import json
import re
import secrets
import shutil
import socket
import ssl
import threading
import time
import urllib.parse
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from .model import ApiError, Cluster
from .tls import make_cert

API_PREFIX = "/api2/json"

DEFAULT_TOKEN_ID = "root@pam!pvesim"
DEFAULT_TOKEN_SECRET = "5ce7ab1e-0000-4000-8000-00000000c0de"
DEFAULT_USER = "root@pam"
DEFAULT_PASSWORD = "pvesim-password"

_TOKEN_RE = re.compile(r"^PVEAPIToken[= ](?P<user>[^!\s]+)!(?P<tokenid>[^=\s]+)=(?P<secret>\S+)$")

Route = Callable[[re.Match[str], dict[str, str]], Any]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512

    def __init__(self, addr: tuple[str, int], handler: type[BaseHTTPRequestHandler], sim: PveSim) -> None:
        self.sim = sim
        super().__init__(addr, handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        # The TLS handshake runs here, in the request's own thread, so one slow
        # or failing client never blocks the accept loop.
        if self.sim.ssl_context is not None:
            try:
                request = self.sim.ssl_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-answer (timeouts, refused certificates) are part of the tests.
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Keep-alive clients (requests/urllib3) would otherwise meet Nagle + delayed ACK: ~40 ms per answer.
    disable_nagle_algorithm = True
    server_version = "pve-api-daemon/3.0"
    sys_version = ""
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.sim._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.sim._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server.sim._handle(self, "PUT")

    def do_DELETE(self) -> None:
        self.server.sim._handle(self, "DELETE")


class PveSim:
    """A simulated Proxmox VE API on 127.0.0.1.

    ``PveSim(cluster, tls=False, latency_ms=0, tokens=None, users=None)`` where
    ``cluster`` is a description dict (see the package docstring) or a loaded
    :class:`~pvesim.model.Cluster`. Use it as a context manager; ``.url``,
    ``.port``, ``.requests`` (``(method, path)`` pairs, path with query),
    ``.request_count`` and ``.reset_counter()`` are what tests read.
    ``tokens`` maps ``user@realm!tokenid`` to its secret, ``users`` maps
    ``user@realm`` to a password; both default to the description's ``auth``
    block, then to :data:`DEFAULT_TOKEN_ID` / :data:`DEFAULT_USER`.
    ``refresh(cluster)``, when given, runs before every answer (one at a time): what the
    multi-host lab uses to serve its real containers' configuration files and states.
    """

    def __init__(
        self,
        cluster: dict[str, Any] | Cluster,
        tls: bool = False,
        latency_ms: float = 0,
        tokens: dict[str, str] | None = None,
        users: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        auth_fail_delay: float = 0.0,
        max_parallel: int | None = None,
        refresh: Callable[[Cluster], None] | None = None,
    ) -> None:
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster(cluster)
        auth = self.cluster.desc.get("auth") or {}
        self.tokens = dict(tokens if tokens is not None else auth.get("tokens") or {DEFAULT_TOKEN_ID: DEFAULT_TOKEN_SECRET})
        self.users = dict(users if users is not None else auth.get("users") or {DEFAULT_USER: DEFAULT_PASSWORD})
        self.tls = tls
        self.latency = latency_ms / 1000.0
        # Real PVE answers a failed authentication after 3 s; 0 keeps tests fast.
        self.auth_fail_delay = auth_fail_delay
        self._parallel = threading.BoundedSemaphore(max_parallel) if max_parallel else None
        self._host = host
        self._want_port = port
        self._lock = threading.Lock()
        self.refresh = refresh
        self._refresh_lock = threading.Lock()
        self._requests: list[tuple[str, str]] = []
        self._in_flight = 0
        #: Most requests the simulator was answering at the same moment (for concurrency bounds).
        self.max_in_flight = 0
        self._tickets: dict[str, str] = {}
        self._responses: list[dict[str, Any]] = list(self.cluster.desc.get("responses", []))
        self.ssl_context: ssl.SSLContext | None = None
        self.cert_path: str | None = None
        self._tmpdir: str | None = None
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._routes: list[tuple[str, re.Pattern[str], Route]] = self._build_routes()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> PveSim:
        if self.tls:
            cert, key, self._tmpdir = make_cert()
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            self.ssl_context = ctx
            self.cert_path = cert
        self._httpd = _Server((self._host, self._want_port), _Handler, self)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="pvesim", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> PveSim:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ what tests read
    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("simulator not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self._host}:{self.port}"

    @property
    def ca_path(self) -> str | None:
        """The certificate to trust for ``validate_certs: true`` (TLS mode only)."""
        return self.cert_path

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._requests)

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self._requests)

    def reset_counter(self) -> None:
        with self._lock:
            self._requests.clear()
            self.max_in_flight = 0

    @property
    def token(self) -> tuple[str, str]:
        """One valid ``(token_id, secret)`` pair."""
        return next(iter(self.tokens.items()))

    def env(self) -> dict[str, str]:
        """``PROXMOX_*`` variables for a client of this simulator (token auth)."""
        token_id, secret = self.token
        return {"PROXMOX_URL": self.url, "PROXMOX_TOKEN_ID": token_id, "PROXMOX_TOKEN_SECRET": secret}

    def add_response(self, path: str, method: str = "GET", **answer: Any) -> None:
        """Override one path at runtime (same keys as the description's ``responses``)."""
        with self._lock:
            self._responses.insert(0, {"path": path, "method": method, **answer})

    def set_node_online(self, name: str, online: bool) -> None:
        self.cluster.nodes[name].online = online

    # ------------------------------------------------------------------ routing
    def _build_routes(self) -> list[tuple[str, re.Pattern[str], Route]]:
        c = self.cluster
        n = r"(?P<node>[^/]+)"
        v = r"(?P<vmid>[^/]+)"
        k = r"(?P<kind>lxc|qemu)"
        table: list[tuple[str, str, Route]] = [
            ("GET", r"/version", lambda m, q: c.version_info()),
            ("GET", r"/cluster/status", lambda m, q: c.cluster_status()),
            ("GET", r"/cluster/resources", lambda m, q: c.cluster_resources(q.get("type"))),
            ("GET", r"/cluster/mapping/(?P<mkind>pci|usb|dir)", lambda m, q: c.mapping(m["mkind"])),
            ("GET", r"/nodes", lambda m, q: c.nodes_list()),
            ("GET", rf"/nodes/{n}/{k}", lambda m, q: c.node_guests(m["node"], m["kind"])),
            ("GET", rf"/nodes/{n}/{k}/{v}/config", lambda m, q: c.guest_config(m["node"], m["kind"], m["vmid"], q.get("current"))),
            ("GET", rf"/nodes/{n}/{k}/{v}/status/current", lambda m, q: c.guest_status(m["node"], m["kind"], m["vmid"])),
            ("GET", rf"/nodes/{n}/{k}/{v}/snapshot", lambda m, q: c.snapshots(m["node"], m["kind"], m["vmid"])),
            ("GET", rf"/nodes/{n}/lxc/{v}/interfaces", lambda m, q: c.lxc_interfaces(m["node"], m["vmid"])),
            ("GET", rf"/nodes/{n}/qemu/{v}/agent/network-get-interfaces", lambda m, q: c.agent_interfaces(m["node"], m["vmid"])),
            ("GET", rf"/nodes/{n}/hardware/pci", lambda m, q: c.hardware_pci(m["node"], q.get("pci-class-blacklist"))),
            ("GET", rf"/nodes/{n}/network", lambda m, q: c.node_network(m["node"])),
            ("GET", r"/pools", lambda m, q: c.pool_list(q.get("poolid"))),
            ("GET", r"/pools/(?P<poolid>[^/]+)", lambda m, q: c.pool(m["poolid"])),
        ]
        return [(method, re.compile(f"^{pattern}/?$"), fn) for method, pattern, fn in table]

    def _override(self, method: str, path: str, query: str) -> dict[str, Any] | None:
        with self._lock:
            for r in self._responses:
                if r.get("method", "GET").upper() != method:
                    continue
                want_path, _unused, want_query = str(r["path"]).partition("?")
                if want_path.rstrip("/") != path.rstrip("/"):
                    continue
                if want_query and urllib.parse.parse_qs(want_query) != urllib.parse.parse_qs(query):
                    continue
                return r
        return None

    # ------------------------------------------------------------------ request handling
    def _handle(self, h: _Handler, method: str) -> None:
        raw_path = h.path
        with self._lock:
            self._requests.append((method, raw_path))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                with self._lock:
                    self._in_flight -= 1

        try:
            self._respond(h, method, raw_path, leave)
        finally:
            leave()

    def _respond(self, h: _Handler, method: str, raw_path: str, leave: Callable[[], None]) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else b""
        if self._parallel is not None:
            self._parallel.acquire()
        try:
            if self.latency:
                time.sleep(self.latency)
            if self.refresh is not None:
                with self._refresh_lock:
                    self.refresh(self.cluster)
            status, reason, payload = self._answer(h, method, raw_path, body)
        finally:
            if self._parallel is not None:
                self._parallel.release()
        if status == 401 and self.auth_fail_delay:
            time.sleep(self.auth_fail_delay)
        data = payload if isinstance(payload, bytes) else b""
        # The request stops counting as in flight before its answer is written: once the client has the
        # answer it may send its next request, which this thread would otherwise still count (a client
        # with 3 workers was seen with 4 in flight on a loaded machine).
        leave()
        try:
            h.send_response(status, reason)
            h.send_header("Cache-Control", "max-age=0")
            h.send_header("Pragma", "no-cache")
            h.send_header("Expires", formatdate(usegmt=True))
            if data:
                h.send_header("Content-Type", "application/json;charset=UTF-8")
            h.send_header("Content-Length", str(len(data)))
            # Headers and body leave in one write, as pveproxy sends them.
            h._headers_buffer.append(b"\r\n" + data)
            h.flush_headers()
        except (BrokenPipeError, ConnectionResetError, socket.timeout, ssl.SSLError):
            h.close_connection = True

    def _error_body(self, err: ApiError) -> bytes:
        if not err.body:
            return b""
        doc: dict[str, Any] = {"data": None}
        if err.errors:
            doc["errors"] = err.errors
        if self.cluster.error_message_field:
            doc["message"] = err.message + "\n"
        return _dumps(doc)

    def _answer(self, h: _Handler, method: str, raw_path: str, body: bytes) -> tuple[int, str, bytes]:
        split = urllib.parse.urlsplit(raw_path)
        path = urllib.parse.unquote(split.path)
        if not path.startswith(API_PREFIX + "/") and path != API_PREFIX:
            return 501, f"Method '{method} {path}' not implemented", b""
        rel = path[len(API_PREFIX) :] or "/"
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(split.query, keep_blank_values=True).items()}
        try:
            override = self._override(method, rel, split.query)
            if method == "POST" and rel.rstrip("/") == "/access/ticket":
                if override is not None:
                    return self._from_override(override)
                return 200, "OK", _dumps({"data": self._login(h, body)})
            self._authenticate(h)
            if override is not None:
                return self._from_override(override)
            for want, pattern, fn in self._routes:
                m = pattern.match(rel)
                if m and want == method:
                    return 200, "OK", _dumps({"data": fn(m, query)})
            raise ApiError(501, f"Method '{method} {rel}' not implemented")
        except ApiError as err:
            return err.status, err.message, self._error_body(err)

    def _from_override(self, r: dict[str, Any]) -> tuple[int, str, bytes]:
        status = int(r.get("status", 200))
        if status >= 400:
            err = ApiError(status, str(r.get("message", "simulated failure")), r.get("errors"), body=bool(r.get("json_body", True)))
            if "body" in r:
                return status, err.message, _dumps(r["body"])
            return status, err.message, self._error_body(err)
        if "body" in r:
            return status, str(r.get("reason", "OK")), _dumps(r["body"])
        return status, str(r.get("reason", "OK")), _dumps({"data": r.get("data")})

    # ------------------------------------------------------------------ auth
    def _authenticate(self, h: _Handler) -> None:
        header = h.headers.get("Authorization")
        if header:
            m = _TOKEN_RE.match(header.strip())
            if not m:
                raise ApiError(401, "invalid token value!", body=False)
            full = f"{m['user']}!{m['tokenid']}"
            if full not in self.tokens:
                raise ApiError(401, f"no such token '{m['tokenid']}' for user '{m['user']}'", body=False)
            if not secrets.compare_digest(self.tokens[full], m["secret"]):
                raise ApiError(401, "invalid token value!", body=False)
            return
        cookies = h.headers.get("Cookie") or ""
        ticket = None
        for part in cookies.split(";"):
            name, _unused, value = part.strip().partition("=")
            if name == "PVEAuthCookie":
                ticket = urllib.parse.unquote(value)
        if ticket is None:
            raise ApiError(401, "No ticket", body=False)
        with self._lock:
            valid = ticket in self._tickets
        if not valid:
            raise ApiError(401, "permission denied - invalid PVE ticket", body=False)

    def _login(self, h: _Handler, body: bytes) -> dict[str, Any]:
        ctype = h.headers.get("Content-Type") or ""
        if "json" in ctype:
            form = {k: str(v) for k, v in json.loads(body or b"{}").items()}
        else:
            form = {k: v[-1] for k, v in urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True).items()}
        user, password = form.get("username", ""), form.get("password", "")
        if "realm" in form and "@" not in user:
            user = f"{user}@{form['realm']}"
        if user not in self.users or not secrets.compare_digest(self.users[user], password):
            raise ApiError(401, "authentication failure", body=False)
        stamp = f"{int(time.time()):08X}"
        ticket = f"PVE:{user}:{stamp}::{secrets.token_urlsafe(48)}"
        with self._lock:
            self._tickets[ticket] = user
        return {
            "username": user,
            "ticket": ticket,
            "CSRFPreventionToken": f"{stamp}:{secrets.token_urlsafe(32)}",
            "clustername": self.cluster.name or "",
            "cap": {"vms": {"VM.Audit": 1}, "nodes": {"Sys.Audit": 1}},
        }


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")
