"""_residue, _holders and _ports against real files, processes and kernel tables (under tests/tools/pidns-run)."""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import typing as t
from pathlib import Path

import pytest
import yaml

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders, _ports, _residue
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

ROOT = Path(__file__).resolve().parents[4]

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


@pytest.mark.parametrize(
    ("kind", "pattern", "message"),
    [
        ("shm", "dev/shm/x*", "is not an absolute path glob"),
        ("shm", "/", "names the root directory itself"),
        ("shm", "/dev/shm/../x", "contains '.' or '..'"),
        ("locks", "/a/**/b/**", "must end with a name pattern"),
        ("locks", "/a/x**/lock", "'**' must be a whole path component"),
        ("dirs", "/tmp/*", "must end with a name that has literal characters"),
        ("dirs", "/tmp/**/torchelastic_*", "must end with a name that has literal characters"),
    ],
)
def test_bad_globs_are_refused_naming_the_option(kind: str, pattern: str, message: str) -> None:
    with pytest.raises(CleanSlateError) as err:
        _residue.parse_glob(kind, pattern)
    assert err.value.msg.startswith(f"{kind}: ") and message in err.value.msg and err.value.reason == "bad_arguments"


def test_role_defaults_are_the_modules() -> None:
    defaults = yaml.safe_load((ROOT / "roles/clean_slate/defaults/main.yml").read_text())
    specs = yaml.safe_load((ROOT / "roles/clean_slate/meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    for kind, module_default in zip(_residue.KINDS, (_residue.DEFAULT_SHM, _residue.DEFAULT_SOCKETS, _residue.DEFAULT_LOCKS, _residue.DEFAULT_DIRS)):
        assert defaults[f"clean_slate_residue_{kind}"] == list(module_default)
        assert specs[f"clean_slate_residue_{kind}"]["default"] == list(module_default)
    assert defaults["clean_slate_residue_remove"] == list(_residue.DEFAULT_REMOVE)


def request(tmp: Path, **kw) -> _residue.Request:
    globs = [
        _residue.parse_glob("shm", f"{tmp}/shm/nccl-*"),
        _residue.parse_glob("sockets", f"{tmp}/sock/*"),
        _residue.parse_glob("locks", f"{tmp}/cache/**/*.lock"),
        _residue.parse_glob("dirs", f"{tmp}/torchelastic_*"),
    ]
    return _residue.Request(globs=globs, remove=set(_residue.KINDS), **kw)


@pytest.fixture
def short_tmp() -> t.Iterator[Path]:
    """A test-owned directory with a short path (a unix socket path has 107 bytes at most)."""
    top = Path(tempfile.mkdtemp(prefix="u-"))
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def tree(short_tmp: Path) -> Path:
    tmp_path = short_tmp
    (tmp_path / "shm").mkdir()
    (tmp_path / "sock").mkdir()
    for i in range(3):
        (tmp_path / "shm" / f"nccl-{i:06d}").write_bytes(b"x" * 8192)
    (tmp_path / "shm" / "other-file").write_bytes(b"x")
    deep = tmp_path / "cache" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x.lock").write_bytes(b"")
    (tmp_path / "cache" / "top.lock").write_bytes(b"")
    run = tmp_path / "torchelastic_abc" / "r" / "attempt_0"
    run.mkdir(parents=True)
    (run / "error.json").write_text("{}")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "sock" / "dead"))
    s.close()
    return tmp_path


def test_everything_orphaned_goes_and_the_rest_of_the_directory_stays(tree: Path) -> None:
    r = _residue.run(request(tree), check_mode=False)
    assert {x["path"] for x in r["removed"]} == {
        *(f"{tree}/shm/nccl-{i:06d}" for i in range(3)),
        f"{tree}/sock/dead",
        f"{tree}/cache/a/b/c/x.lock",
        f"{tree}/cache/top.lock",
        f"{tree}/torchelastic_abc",
    }
    assert sorted(os.listdir(tree / "shm")) == ["other-file"]
    assert not (tree / "torchelastic_abc").exists() and (tree / "cache" / "a" / "b" / "c").is_dir()
    assert r["summary"]["kinds"]["shm"] == {"removed": 3, "bytes": 3 * 8192, "held": 0, "stale": 0}
    assert r["msg"].startswith("3 stale segments, 1 socket, 2 locks and 1 directory (")
    assert _residue.run(request(tree), check_mode=False)["changed"] is False


HOLDER = textwrap.dedent(
    """
    import fcntl, mmap, os, socket, sys, time
    mode, path = sys.argv[1], sys.argv[2]
    keep = []
    if mode == "cwd":
        os.chdir(path)
    elif mode == "bind":
        s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); keep.append(s)
    else:
        fd = os.open(path, os.O_RDWR)
        if mode == "map":
            keep.append(mmap.mmap(fd, 4096)); os.close(fd)
        elif mode == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX); keep.append(fd)
        else:
            keep.append(fd)
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def hold():
    procs: list[subprocess.Popen] = []

    def _hold(mode: str, path: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, mode, str(path)], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield _hold
    for p in procs:
        p.kill()
        p.wait()


def test_holders_are_found_by_inode_whatever_the_path(tree: Path, hold) -> None:
    shm = tree / "shm"
    p_map = hold("map", shm / "nccl-000000")
    p_fd = hold("fd", shm / "nccl-000001")
    p_cwd = hold("cwd", tree / "torchelastic_abc" / "r")
    p_lock = hold("flock", tree / "cache" / "top.lock")
    (tree / "sock" / "dead").unlink()
    p_bind = hold("bind", tree / "sock" / "dead")
    # Another name for a held segment: the holder's fd shows the first name, the inode is the same.
    os.link(shm / "nccl-000001", shm / "nccl-alias")
    r = _residue.run(request(tree), check_mode=False)
    held = {x["path"]: {h["pid"]: h["how"] for h in x["holders"]} for x in r["held"]}
    assert held[f"{shm}/nccl-000000"] == {p_map.pid: ["fd", "mmap"]}  # Python's mmap keeps a dup of the fd
    # One item per inode: whichever name was listed first stands for both.
    alias = {f"{shm}/nccl-000001", f"{shm}/nccl-alias"} & set(held)
    assert len(alias) == 1 and held[alias.pop()] == {p_fd.pid: ["fd"]}
    assert held[f"{tree}/torchelastic_abc"] == {p_cwd.pid: ["cwd"]}
    assert held[f"{tree}/cache/top.lock"] == {p_lock.pid: ["fd", "lock"]}
    assert held[f"{tree}/sock/dead"] == {p_bind.pid: ["bound"]}
    assert {x["path"] for x in r["removed"]} == {f"{shm}/nccl-000002", f"{tree}/cache/a/b/c/x.lock"}
    assert all(Path(p).exists() for p in held)


def test_a_file_replaced_after_the_judgement_is_left_alone(tree: Path) -> None:
    notes: list[str] = []
    roots = _residue.open_roots([])
    items, walkers = _residue.collect(request(tree), roots, notes)
    try:
        by_name = {i.name: i for i in items}
        # A new job creates a segment under the same name between the scan and the unlink.
        (tree / "shm" / "nccl-000000").unlink()
        (tree / "shm" / "nccl-000000").write_bytes(b"new")
        _residue.remove(by_name["nccl-000000"])
        assert by_name["nccl-000000"].verdict == "skipped" and "changed since it was judged" in by_name["nccl-000000"].why
        assert (tree / "shm" / "nccl-000000").read_bytes() == b"new"
        # A file that appears in a judged directory stops its removal before anything inside is gone.
        (tree / "torchelastic_abc" / "r" / "late.json").write_text("{}")
        _residue.remove(by_name["torchelastic_abc"])
        assert by_name["torchelastic_abc"].verdict == "skipped" and "late.json appeared" in by_name["torchelastic_abc"].why
        assert (tree / "torchelastic_abc" / "r" / "attempt_0" / "error.json").exists()
        # A regular file with another hard link: an fd through the other name is not provably absent.
        os.link(tree / "shm" / "nccl-000001", tree / "hardlink")
        _residue.remove(by_name["nccl-000001"])
        assert by_name["nccl-000001"].verdict == "skipped" and "hard links" in by_name["nccl-000001"].why
        _residue.remove(by_name["nccl-000002"])
        assert by_name["nccl-000002"].verdict == "removed" and not (tree / "shm" / "nccl-000002").exists()
    finally:
        for w in walkers:
            w.close()
        for r in roots:
            os.close(r.fd)


def test_symlinks_are_not_followed_anywhere(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "nccl-000009").write_bytes(b"x")
    (victim / "torchelastic_v").mkdir()
    (tmp_path / "shm").symlink_to(victim)  # a symlinked directory on the path
    (tmp_path / "torchelastic_link").symlink_to(victim / "torchelastic_v")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "loop").symlink_to(tmp_path / "cache")  # '**' must not descend into it
    (tmp_path / "cache" / "ok.lock").write_bytes(b"")
    r = _residue.run(request(tmp_path), check_mode=False)
    assert {x["path"] for x in r["removed"]} == {f"{tmp_path}/cache/ok.lock"}
    assert (victim / "nccl-000009").exists() and (victim / "torchelastic_v").is_dir()
    assert any("is a symbolic link or not a directory; it was not followed" in n for n in r["notes"])


def test_check_mode_changes_nothing_and_counts_bytes(tree: Path) -> None:
    r = _residue.run(request(tree), check_mode=True)
    assert r["changed"] is True and r["summary"]["removed"] == 7
    assert r["summary"]["kinds"]["shm"]["bytes"] == 3 * 8192
    assert "would be removed" in r["msg"]
    assert len(os.listdir(tree / "shm")) == 4 and (tree / "torchelastic_abc").is_dir()


def test_list_limit_cuts_lists_not_counts(tree: Path) -> None:
    r = _residue.run(request(tree, list_limit=2), check_mode=True)
    assert len(r["removed"]) == 2 and r["summary"]["removed"] == 7 and r["truncated"] is True


def test_locks_table_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    path.write_bytes(b"")
    with open(path, "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        st = os.fstat(fh.fileno())
        locks = _holders.read_locks({(st.st_dev, st.st_ino)})
        assert [(h.pid, h.how) for h in locks[(st.st_dev, st.st_ino)]] == [(os.getpid(), "lock")]
    assert _holders.read_locks({(st.st_dev, st.st_ino)}) == {}


def test_lock_lines_of_every_kind_are_parsed(tmp_path: Path) -> None:
    text = (
        "1: POSIX  ADVISORY  WRITE 1234 00:2a:183 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 1240 00:2a:183 0 EOF\n"
        "2: OFDLCK ADVISORY  READ  -1 00:2a:184 0 0\n"
        "3: FLOCK  ADVISORY  WRITE 99 fd:01:184 0 EOF\n"
        "4: LEASE  ACTIVE    READ  77 00:2a:185 0 EOF\n"
    )
    path = tmp_path / "locks"
    path.write_text(text)
    dev = os.makedev(0, 0x2A)
    found = _holders.read_locks({(dev, 183), (dev, 184), (dev, 185)}, str(path))
    assert [h.pid for h in found[(dev, 183)]] == [1234, 1240]
    assert [h.pid for h in found[(dev, 184)]] == [-1]  # the fd:01 line is another device
    assert [h.pid for h in found[(dev, 185)]] == [77]


def test_zombies_are_seen_without_signalling_anything() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            scan = _holders.scan(_holders.Watch())
            if any(z[0] == pid for z in scan.zombies):
                break
            time.sleep(0.01)
        assert (pid, os.getpid()) in [(z[0], z[1]) for z in scan.zombies]
    finally:
        os.waitpid(pid, 0)


def test_human_sizes() -> None:
    assert [_residue.human(n) for n in (512, 4096, 3 * 1024**3 + 100 * 1024**2)] == ["512 B", "4.0 KiB", "3.1 GiB"]


def test_container_users_are_mapped_to_the_hosts_uids() -> None:
    """An unprivileged container (user namespace 0 -> 100000): its names and uids as the host sees them."""
    proc = subprocess.Popen(["unshare", "--user", "sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.readlink(f"/proc/{proc.pid}/exe").rpartition("/")[2] != "sleep":
            time.sleep(0.01)
        # What Proxmox's lxc.idmap does for an unprivileged container (root of the host writes the map).
        Path(f"/proc/{proc.pid}/uid_map").write_text("0 100000 65536\n")
        fd = os.open(f"/proc/{proc.pid}/root", os.O_RDONLY | os.O_DIRECTORY)
        try:
            root = _residue.Root(fd=fd, vmid=129, init_pid=proc.pid, scope=None)
            assert _residue.resolve_users(["root", "1000"], root) == {100000, 101000}
            with pytest.raises(CleanSlateError, match="users: no user named 'no-such-user' in container 129"):
                _residue.resolve_users(["no-such-user"], root)
        finally:
            os.close(fd)
    finally:
        proc.kill()
        proc.wait()
