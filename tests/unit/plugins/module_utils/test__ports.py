"""_ports: the TCP tables of /proc/net, read for real sockets of this namespace and for recorded kernel lines."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _ports

# Lines of a real /proc/net/tcp (kernel 6.18): a listener, both ends of a connection, and a TIME_WAIT socket.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   1: 0100007F:96CF 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 768675 1 000000004f7519af 100 0 0 10 0
   8: 0100007F:E9C4 0100007F:B003 01 00000000:00000000 00:00000000 00000000     0        0 768679 2 00000000d9310776 20 0 0 10 -1
  11: 0100007F:994B 0100007F:CB82 06 00000000:00000000 03:00001753 00000000     0        0 0 3 0000000041530798
  13: 0100007F:B003 0100007F:E9C4 01 00000000:00000000 00:00000000 00000000     0        0 768680 1 00000000bd5f5811 20 0 0 10 -1
"""
TCP6 = (
    "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    "   0: 00000000000000000000000001000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000"
    "     0        0 4242 1 0000000000000000 100 0 0 10 0\n"
)


def test_tcp_lines_are_classified_per_port() -> None:
    socks = _ports.parse_tcp(TCP) + _ports.parse_tcp(TCP6)
    assert _ports.classify(0x96CF, socks).state == "listening"
    assert _ports.classify(0x96CF, socks).listeners[0].address == "127.0.0.1:38607"
    tw = _ports.classify(0x994B, socks)
    assert tw.state == "time_wait" and tw.remaining_s == pytest.approx(59.71)
    assert _ports.classify(0xB003, socks).state == "connected"  # the server side of an established connection
    assert _ports.classify(0xE9C4, socks).state == "connected"  # a client's ephemeral port counts too
    assert _ports.classify(30000, socks).state == "free"
    six = _ports.classify(8000, socks)
    assert six.state == "listening" and six.listeners[0].address == "[::1]:8000" and six.listeners[0].inode == 4242
    assert [s.port for s in _ports.parse_tcp(TCP, {0x994B})] == [0x994B]


def test_real_sockets_are_read_from_this_namespace() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        state = _ports.classify(port, _ports.read_tcp("/proc/self/net", {port}))
        assert state.state == "listening" and state.listeners[0].inode == os.fstat(server.fileno()).st_ino
    finally:
        server.close()
    assert _ports.classify(port, _ports.read_tcp("/proc/self/net", {port})).state == "free"


def test_addresses_are_read_in_host_byte_order() -> None:
    assert _ports._address("0100007F") == "127.0.0.1"
    assert _ports._address("00000000000000000000000001000000") == "[::1]"
    assert _ports._address("not-hex!") == "not-hex!"  # left as the kernel printed it rather than guessed


def test_a_closing_socket_keeps_the_longest_time_left() -> None:
    closing = [_ports.Sock(port=8000, state=_ports.TIME_WAIT, inode=0, address="x", remaining_s=r) for r in (12.0, 59.714, None)]
    assert _ports.PortState(port=8000, state="time_wait", closing=closing).remaining_s == 59.71
    assert _ports.PortState(port=8000, state="free").remaining_s is None


def write_tcp(netdir: Path, lines: str) -> None:
    netdir.mkdir(exist_ok=True)
    (netdir / "tcp").write_text(TCP.splitlines()[0] + "\n" + lines)


def test_waiting_ends_as_soon_as_time_wait_is_over(tmp_path: Path) -> None:
    netdir = tmp_path / "net"
    write_tcp(netdir, "")  # the socket is gone: the table shows nothing on the port any more
    states = {0x994B: _ports.classify(0x994B, _ports.parse_tcp(TCP))}
    assert states[0x994B].state == "time_wait"
    waited = _ports.wait_closing(str(netdir), states, timeout=30, interval=0.01)
    assert states[0x994B].state == "free"
    assert waited < 5  # one poll, not the timeout (generous: the CI machine is loaded)


def test_waiting_gives_up_at_the_timeout_and_keeps_the_verdict(tmp_path: Path) -> None:
    netdir = tmp_path / "net"
    write_tcp(netdir, TCP.splitlines()[3] + "\n")  # still in TIME_WAIT
    states = {0x994B: _ports.classify(0x994B, _ports.parse_tcp(TCP)), 30000: _ports.PortState(port=30000, state="free")}
    start = time.monotonic()
    waited = _ports.wait_closing(str(netdir), states, timeout=0.3, interval=0.05)
    assert waited >= 0.3 and time.monotonic() - start >= 0.3
    assert (states[0x994B].state, states[30000].state) == ("time_wait", "free")


def test_nothing_to_wait_for_returns_at_once(tmp_path: Path) -> None:
    assert _ports.wait_closing(str(tmp_path / "missing"), {30000: _ports.PortState(port=30000, state="listening")}, timeout=30) < 1


def test_a_real_connection_is_connected_until_closed() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _addr = server.accept()
    server.close()  # no listener any more; the accepted socket still uses the port
    try:
        state = _ports.classify(port, _ports.read_tcp("/proc/self/net", {port}))
        assert state.state == "connected"
        assert os.fstat(accepted.fileno()).st_ino in {s.inode for s in state.connections}
    finally:
        client.close()
        accepted.close()
    # The side that closed first keeps the port in TIME_WAIT (or a closing state) with no owner.
    after = _ports.classify(port, _ports.read_tcp("/proc/self/net", {port}))
    assert after.state in ("time_wait", "free") and all(s.inode == 0 for s in after.closing)
