"""_residue against real files, processes and kernel tables (under tools/pidns-run).

Its parts have their own files: test__holders.py (who holds a file), test__ports.py (the TCP tables).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

import pytest
import yaml

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _residue
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

ROOT = Path(__file__).resolve().parents[4]


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


def torch_shm_manager_residue(tmp: Path) -> tuple[Path, Path]:
    """What torch_shm_manager leaves when it is killed: a socket in ``mkdtemp(prefix="torch-shm-dir-")``."""
    d = Path(tempfile.mkdtemp(prefix="torch-shm-dir-", dir=tmp))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "manager.sock"))
    s.close()  # closed without unlink: the file stays, as when the manager is SIGKILLed
    return d, d / "manager.sock"


def default_globs(kind: str, tmp: Path) -> list[_residue.Glob]:
    """The module's own defaults for /tmp, moved under a test-owned directory."""
    defaults = {"sockets": _residue.DEFAULT_SOCKETS, "dirs": _residue.DEFAULT_DIRS}[kind]
    return [_residue.parse_glob(kind, g.replace("/tmp/", f"{tmp}/", 1)) for g in defaults if g.startswith("/tmp/")]


@pytest.mark.parametrize("remove", [set(_residue.DEFAULT_REMOVE), {"sockets", "dirs"}])
def test_the_defaults_find_torch_shm_managers_socket_and_directory(short_tmp: Path, remove: set[str]) -> None:
    d, sock = torch_shm_manager_residue(short_tmp)
    req = _residue.Request(globs=default_globs("sockets", short_tmp) + default_globs("dirs", short_tmp), remove=remove)
    r = _residue.run(req, check_mode=False)
    assert not sock.exists()
    assert [x["path"] for x in r["removed"] if x["kind"] == "sockets"] == [str(sock)]
    if "dirs" in remove:
        # Both globs matched in one run: the socket goes by its own glob, then the directory, found without it.
        assert not d.exists()
        assert [x["path"] for x in r["removed"] if x["kind"] == "dirs"] == [str(d)]
    else:
        assert d.is_dir() and [x["path"] for x in r["stale"]] == [str(d)]
    assert _residue.run(req, check_mode=False)["changed"] is False


def test_a_directory_with_a_socket_a_live_process_is_bound_to_is_held(short_tmp: Path, hold) -> None:
    """A bound socket holds no fd on its file: only the unix tables tell, for a directory glob alone too."""
    d = Path(tempfile.mkdtemp(prefix="torch-shm-dir-", dir=short_tmp))
    manager = hold("bind", d / "manager.sock")
    req = _residue.Request(globs=default_globs("dirs", short_tmp), remove={"dirs"})
    r = _residue.run(req, check_mode=False)
    assert (d / "manager.sock").exists()
    assert [(x["path"], [h["pid"] for h in x["holders"]], x["holders"][0]["how"]) for x in r["held"]] == [(str(d), [manager.pid], ["bound"])]
    assert r["removed"] == []


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


def residue_params(**kw: t.Any) -> dict[str, t.Any]:
    p: dict[str, t.Any] = {kind: [] for kind in _residue.KINDS}
    p.update(remove=["shm"], users=[], containers=[], pct_path=None, ports=[8000], time_wait_timeout=0.0, patterns=[], protect=[])
    p.update(fail_on=["listening"], list_limit=200)
    p.update(kw)
    return p


@pytest.mark.parametrize(
    ("option", "value"),
    [("time_wait_timeout", float("nan")), ("time_wait_timeout", 86401), ("list_limit", -1), ("containers", [99]), ("pct_path", "/nonexistent/pct")],
)
def test_the_modules_options_are_refused_before_any_container_is_looked_up(option: str, value: t.Any) -> None:
    looked_up: list[int] = []
    with pytest.raises(CleanSlateError) as err:
        _residue.build_request(residue_params(**{option: value}), lambda: looked_up.append(1) or [])
    assert (err.value.reason, err.value.details["option"], looked_up) == ("bad_arguments", option, [])
    req = _residue.build_request(residue_params(), lambda: looked_up.append(1) or [])
    assert looked_up == [1] and req.ports == [8000] and req.remove == {"shm"}


def test_the_diff_shows_what_went_and_what_is_left() -> None:
    result = {"removed": [{"path": "/dev/shm/a"}, {"path": "/dev/shm/b"}], "errors": [{"path": "/dev/shm/c"}]}
    assert _residue.diff(result, check_mode=False) == {"before": "/dev/shm/a\n/dev/shm/b\n/dev/shm/c\n", "after": "/dev/shm/c\n"}
    assert _residue.diff(result, check_mode=True) == {"before": "/dev/shm/a\n/dev/shm/b\n", "after": ""}
