# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Is a TCP port free for the next server? Read from /proc/net/tcp and tcp6.

Per port, in one network namespace (``/proc/<pid>/net`` of a process in it):

* ``listening``: a socket listens on it; the next ``bind`` fails with
  EADDRINUSE whatever its options. Its owner comes from the fd scan (the
  socket's inode).
* ``connected``: no listener, but live sockets of some process still use the
  port (connections an orphaned worker keeps). A server that sets
  SO_REUSEADDR (uvicorn, asyncio) binds; one that does not fails.
* ``time_wait``: only sockets the kernel keeps after their owner closed them
  (TIME_WAIT, or FIN_WAIT/LAST_ACK/CLOSING with no owner). They go away on
  their own, TIME_WAIT after 60 s on Linux; the table gives the time left.
* ``free``: nothing uses it.
"""

from __future__ import annotations

import socket
import struct
import time
import typing as t
from dataclasses import dataclass, field

LISTEN = 0x0A
TIME_WAIT = 0x06
USER_HZ = 100  # the timer column is in clock ticks (jiffies_delta_to_clock_t)
STATES = ("free", "listening", "connected", "time_wait")


@dataclass
class Sock:
    """One line of /proc/net/tcp or tcp6."""

    port: int
    state: int
    inode: int
    address: str
    remaining_s: float | None  # TIME_WAIT and other kernel-held sockets: seconds left on their timer


@dataclass
class PortState:
    """The verdict for one port."""

    port: int
    state: str
    listeners: list[Sock] = field(default_factory=list)
    connections: list[Sock] = field(default_factory=list)
    closing: list[Sock] = field(default_factory=list)

    @property
    def remaining_s(self) -> float | None:
        left = [s.remaining_s for s in self.closing if s.remaining_s is not None]
        return round(max(left), 2) if left else None


def _address(hexaddr: str) -> str:
    """The local address of a /proc/net/tcp line, readable (each 32-bit word is in host byte order)."""
    try:
        if len(hexaddr) == 8:
            return socket.inet_ntop(socket.AF_INET, struct.pack("=I", int(hexaddr, 16)))
        words = [struct.pack("=I", int(hexaddr[i : i + 8], 16)) for i in range(0, 32, 8)]
        return "[" + socket.inet_ntop(socket.AF_INET6, b"".join(words)) + "]"
    except (ValueError, OSError, struct.error):
        return hexaddr


def parse_tcp(text: str, ports: t.Container[int] | None = None) -> list[Sock]:
    """The sockets of a /proc/net/tcp(6) text whose local port is in ``ports`` (all when None)."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        addr, _sep, port_hex = parts[1].partition(":")
        try:
            port = int(port_hex, 16)
            if ports is not None and port not in ports:
                continue
            state = int(parts[3], 16)
            timer, _sep, when = parts[5].partition(":")
            inode = int(parts[9])
            remaining = None
            # Timer 3 is the TIME_WAIT timer; an orphaned socket in another state keeps its own timer.
            if state == TIME_WAIT or (inode == 0 and state != LISTEN and int(timer, 16) != 0):
                remaining = int(when, 16) / USER_HZ
        except ValueError:
            continue
        out.append(Sock(port=port, state=state, inode=inode, address=f"{_address(addr)}:{port}", remaining_s=remaining))
    return out


def read_tcp(netdir: str, ports: t.Container[int]) -> list[Sock]:
    """Sockets on ``ports`` in the namespace whose ``net`` directory is ``netdir`` (``/proc/self/net``, ``/proc/<pid>/net``)."""
    out: list[Sock] = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{netdir}/{name}", encoding="ascii", errors="replace") as fh:
                out.extend(parse_tcp(fh.read(), ports))
        except OSError:
            continue  # no IPv6 in this namespace
    return out


def classify(port: int, socks: t.Iterable[Sock]) -> PortState:
    """The state of ``port`` from its sockets."""
    ps = PortState(port=port, state="free")
    for s in socks:
        if s.port != port:
            continue
        if s.state == LISTEN:
            ps.listeners.append(s)
        elif s.state == TIME_WAIT or s.inode == 0:
            ps.closing.append(s)
        else:
            ps.connections.append(s)
    if ps.listeners:
        ps.state = "listening"
    elif ps.connections:
        ps.state = "connected"
    elif ps.closing:
        ps.state = "time_wait"
    return ps


def wait_closing(netdir: str, states: dict[int, PortState], timeout: float, interval: float = 0.1) -> float:
    """Wait up to ``timeout`` s while ports are only in ``time_wait``; update ``states``; return the seconds waited."""
    start = time.monotonic()
    waiting = [p for p, s in states.items() if s.state == "time_wait"]
    while waiting and time.monotonic() - start < timeout:
        time.sleep(min(interval, max(0.0, timeout - (time.monotonic() - start))))
        socks = read_tcp(netdir, set(waiting))
        for port in list(waiting):
            states[port] = classify(port, socks)
            if states[port].state != "time_wait":
                waiting.remove(port)
    return round(time.monotonic() - start, 3)
