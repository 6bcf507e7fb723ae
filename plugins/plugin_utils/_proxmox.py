# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""The Proxmox VE API client of the ``gpuops.clean_slate.proxmox`` inventory (controller side).

Job: fetch JSON from ``<url>/api2/json`` and nothing else. :class:`ProxmoxClient` is a small
GET client over ``ansible.module_utils.urls`` (``Request.open``, which ``open_url`` wraps) with
token or ticket auth, errors that name the URL, the HTTP status and PVE's own message, and an
optional response cache; :func:`fetch_all` runs requests with bounded concurrency;
:func:`make_unsafe` marks what came back as untrusted. What the answers mean is
:mod:`._proxmox_config`'s job.

Secrets (token secret, password, ticket) live only in request headers and bodies; no message,
repr or log line contains them.
"""

from __future__ import annotations

import json
import threading
import typing as t
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from urllib.error import HTTPError, URLError

from ansible.module_utils.urls import ConnectionError as UrlConnectionError
from ansible.module_utils.urls import Request, make_context

try:
    from ansible.utils.unsafe_proxy import wrap_var as _wrap_var
except ImportError:  # pragma: no cover - removed in a future ansible-core; data from JSON carries no trust then
    _wrap_var = None


def make_unsafe(value: t.Any) -> t.Any:
    """Mark API data so Jinja never templates it (``{{ }}`` in a guest description stays text)."""
    return _wrap_var(value) if _wrap_var is not None else value


class ProxmoxApiError(Exception):
    """A failed API call: names the method and URL, the HTTP status and PVE's message, never a secret."""

    def __init__(self, method: str, url: str, status: int | None, message: str, errors: dict[str, t.Any] | None = None, hint: str | None = None) -> None:
        self.method = method
        self.url = url
        self.status = status
        self.message = message
        self.errors = errors or {}
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        status = f"HTTP {self.status} " if self.status is not None else ""
        text = f"Proxmox VE API {self.method} {self.url}: {status}{self.message}"
        if self.errors:
            text += " (" + "; ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) + ")"
        if self.hint:
            text += f" - {self.hint}"
        return text

    @property
    def unreachable(self) -> bool:
        """595/596: PVE could not reach (or does not know) the node that owns the resource."""
        return self.status in (595, 596)


def token_header(token_id: str, token_secret: str, user: str | None = None) -> str:
    """``PVEAPIToken=user@realm!tokenid=secret`` from the full ``user@realm!tokenid`` or from ``user`` + bare ``tokenid``."""
    token_id, token_secret = token_id.strip(), token_secret.strip()
    if "!" not in token_id:
        if not user:
            raise ValueError("token_id must be the full user@realm!tokenid, or set user as well")
        token_id = f"{user.strip()}!{token_id}"
    owner = token_id.split("!", 1)[0]
    if "@" not in owner:
        raise ValueError(f"the token's user {owner!r} has no realm; write it as user@realm (for example root@pam)")
    return f"PVEAPIToken={token_id}={token_secret}"


class ProxmoxClient:
    """GET-only JSON client for ``<url>/api2/json``.

    :param cached: answers from an earlier run (path -> data); a path found there makes no request.
    :param opener: ``Request().open``-like callable ``(method, url, **kwargs)``, replaceable in tests.

    Requests go through ``ansible.module_utils.urls.Request.open`` (what ``open_url`` calls) with one
    TLS context built once per client: ``open_url`` builds a context per request, and loading the
    system CA bundle each time costs ~20 ms of CPU, which dominates a run of hundreds of requests.
    """

    def __init__(
        self,
        url: str,
        *,
        token_id: str | None = None,
        token_secret: str | None = None,
        user: str | None = None,
        password: str | None = None,
        validate_certs: bool = True,
        ca_path: str | None = None,
        timeout: int = 10,
        cached: t.Mapping[str, t.Any] | None = None,
        opener: t.Callable[..., t.Any] | None = None,
    ) -> None:
        self.base = url.rstrip("/")
        if not self.base.endswith("/api2/json"):
            self.base += "/api2/json"
        self._user = user
        self._password = password
        self._token = token_header(token_id, token_secret, user) if token_id and token_secret else None
        if self._token is None and not (user and password):
            raise ValueError("set token_id and token_secret (API token), or user and password (ticket)")
        self.auth_kind = "token" if self._token else "password"
        self.validate_certs = validate_certs
        self.ca_path = ca_path
        self.timeout = timeout
        self._opener = opener or Request().open
        self._context: t.Any = None
        self._cached: dict[str, t.Any] = dict(cached or {})
        self._headers: dict[str, str] | None = None
        self._lock = threading.Lock()
        #: Successful answers of this run, path -> data (what the inventory cache stores).
        self.responses: dict[str, t.Any] = {}
        #: HTTP requests actually sent.
        self.request_count = 0

    def __repr__(self) -> str:
        return f"ProxmoxClient({self.base!r}, auth={self.auth_kind})"

    def url(self, path: str) -> str:
        return self.base + path

    def _hint(self, status: int | None) -> str | None:
        if status == 401:
            if self.auth_kind == "token":
                return "authentication failure: check token_id/token_secret (token_id is user@realm!tokenid)"
            return "authentication failure: check user/password (user is user@realm, for example root@pam)"
        if status == 403:
            return "permission denied: the user or token lacks a privilege (Sys.Audit, VM.Audit); privilege-separated tokens need their own ACLs"
        if status in (595, 596):
            return "the node is offline or unreachable from the API endpoint"
        return None

    def _send(self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> t.Any:
        url = self.url(path)
        with self._lock:
            self.request_count += 1
        try:
            # Request.open builds a context for plain HTTP too when given none.
            if self._context is None:
                with self._lock:
                    if self._context is None:
                        self._context = make_context(cafile=self.ca_path, validate_certs=self.validate_certs)
            resp = self._opener(
                method,
                url,
                data=data,
                headers=headers or {},
                validate_certs=self.validate_certs,
                ca_path=self.ca_path,
                timeout=self.timeout,
                http_agent="gpuops.clean_slate.proxmox",
                follow_redirects="none",
                use_netrc=False,
                context=self._context,
            )
            body = resp.read()
        except HTTPError as exc:
            raise self._http_error(method, url, exc) from None
        except (URLError, UrlConnectionError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            hint = None
            if "CERTIFICATE_VERIFY_FAILED" in str(reason) or "certificate verify failed" in str(reason):
                hint = "the server certificate is not trusted: set ca_path to its CA, or validate_certs: false"
            raise ProxmoxApiError(method, url, None, f"cannot connect: {reason}", hint=hint) from None
        try:
            doc = json.loads(body.decode("utf-8")) if body else {}
        except ValueError:
            raise ProxmoxApiError(method, url, getattr(resp, "status", None), "the answer is not JSON") from None
        return doc.get("data") if isinstance(doc, dict) else doc

    def _http_error(self, method: str, url: str, exc: HTTPError) -> ProxmoxApiError:
        status = int(exc.code)
        message = str(exc.reason or "").strip()
        errors: dict[str, t.Any] = {}
        try:
            raw = exc.read() if exc.fp is not None else b""
            doc = json.loads(raw.decode("utf-8")) if raw else {}
        except (ValueError, OSError):
            doc = {}
        if isinstance(doc, dict):
            # libpve-http-server-perl >= 5.2 repeats the message in the body; older servers only use the reason phrase.
            if isinstance(doc.get("message"), str) and doc["message"].strip():
                message = doc["message"].strip()
            if isinstance(doc.get("errors"), dict):
                errors = doc["errors"]
        return ProxmoxApiError(method, url, status, message or "error", errors, self._hint(status))

    def _auth_headers(self) -> dict[str, str]:
        with self._lock:
            if self._headers is not None:
                return self._headers
        if self._token:
            headers = {"Authorization": self._token}
        else:
            form = urllib.parse.urlencode({"username": self._user or "", "password": self._password or ""}).encode()
            data = self._send("POST", "/access/ticket", form, {"Content-Type": "application/x-www-form-urlencoded"})
            ticket = data.get("ticket") if isinstance(data, dict) else None
            if not ticket:
                raise ProxmoxApiError("POST", self.url("/access/ticket"), 200, "no ticket in the answer", hint=self._hint(401))
            headers = {"Cookie": "PVEAuthCookie=" + urllib.parse.quote(str(ticket), safe="")}
        with self._lock:
            self._headers = headers
        return headers

    def prepare(self, paths: t.Iterable[str]) -> None:
        """Log in now if any of ``paths`` will need a request (a no-op for tokens and fully cached runs)."""
        with self._lock:
            missing = any(p not in self._cached for p in paths)
        if missing:
            self._auth_headers()

    def get(self, path: str) -> t.Any:
        """GET ``path`` (relative to ``/api2/json``) and return its ``data``; served from the cache when present."""
        with self._lock:
            if path in self._cached:
                self.responses[path] = self._cached[path]
                return self._cached[path]
        data = self._send("GET", path, headers=self._auth_headers())
        with self._lock:
            self.responses[path] = data
        return data


def fetch_all(client: ProxmoxClient, paths: t.Sequence[str], max_workers: int) -> dict[str, t.Any]:
    """GET every path with at most ``max_workers`` in flight; each value is the data or the :class:`ProxmoxApiError`."""
    unique = list(dict.fromkeys(paths))
    if not unique:
        return {}

    def one(path: str) -> tuple[str, t.Any]:
        try:
            return path, client.get(path)
        except ProxmoxApiError as exc:
            return path, exc

    # Authenticate once before fanning out, so N threads do not each log in (and not at all when all is cached).
    client.prepare(unique)
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(unique))), thread_name_prefix="proxmox-inv") as pool:
        return dict(pool.map(one, unique))
