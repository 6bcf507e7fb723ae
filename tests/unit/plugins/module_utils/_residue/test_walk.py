"""_residue.walk: globs checked, the defaults, a walk that never follows a symlink (real files, under tools/pidns-run)."""

from __future__ import annotations

import os
import socket
import tempfile
import typing as t
from pathlib import Path

import pytest
import yaml

from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, walk

ROOT = Path(__file__).resolve().parents[5]


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
        walk.parse_glob(kind, pattern)
    assert err.value.msg.startswith(f"{kind}: ") and message in err.value.msg and err.value.reason == "bad_arguments"


def test_role_defaults_are_the_modules() -> None:
    defaults = yaml.safe_load((ROOT / "roles/clean_slate/defaults/main.yml").read_text())
    specs = yaml.safe_load((ROOT / "roles/clean_slate/meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    for kind, module_default in zip(walk.KINDS, (walk.DEFAULT_SHM, walk.DEFAULT_SOCKETS, walk.DEFAULT_LOCKS, walk.DEFAULT_DIRS)):
        assert defaults[f"clean_slate_residue_{kind}"] == list(module_default)
        assert specs[f"clean_slate_residue_{kind}"]["default"] == list(module_default)
    assert defaults["clean_slate_residue_remove"] == list(module.DEFAULT_REMOVE)


def test_symlinks_are_not_followed_anywhere(tmp_path: Path, request_for: t.Callable[..., module.Request]) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "nccl-000009").write_bytes(b"x")
    (victim / "torchelastic_v").mkdir()
    (tmp_path / "shm").symlink_to(victim)  # a symlinked directory on the path
    (tmp_path / "torchelastic_link").symlink_to(victim / "torchelastic_v")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "loop").symlink_to(tmp_path / "cache")  # '**' must not descend into it
    (tmp_path / "cache" / "ok.lock").write_bytes(b"")
    r = module.run(request_for(tmp_path), check_mode=False)
    assert {x["path"] for x in r["removed"]} == {f"{tmp_path}/cache/ok.lock"}
    assert (victim / "nccl-000009").exists() and (victim / "torchelastic_v").is_dir()
    assert any("is a symbolic link or not a directory; it was not followed" in n for n in r["notes"])


def torch_shm_manager_residue(tmp: Path) -> tuple[Path, Path]:
    """What torch_shm_manager leaves when it is killed: a socket in ``mkdtemp(prefix="torch-shm-dir-")``."""
    d = Path(tempfile.mkdtemp(prefix="torch-shm-dir-", dir=tmp))
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "manager.sock"))
    s.close()  # closed without unlink: the file stays, as when the manager is SIGKILLed
    return d, d / "manager.sock"


@pytest.mark.parametrize("remove", [set(module.DEFAULT_REMOVE), {"sockets", "dirs"}])
def test_the_defaults_find_torch_shm_managers_socket_and_directory(short_tmp: Path, remove: set[str], defaults_under) -> None:
    d, sock = torch_shm_manager_residue(short_tmp)
    req = module.Request(globs=defaults_under("sockets", short_tmp) + defaults_under("dirs", short_tmp), remove=remove)
    r = module.run(req, check_mode=False)
    assert not sock.exists()
    assert [x["path"] for x in r["removed"] if x["kind"] == "sockets"] == [str(sock)]
    if "dirs" in remove:
        # Both globs matched in one run: the socket goes by its own glob, then the directory, found without it.
        assert not d.exists()
        assert [x["path"] for x in r["removed"] if x["kind"] == "dirs"] == [str(d)]
    else:
        assert d.is_dir() and [x["path"] for x in r["stale"]] == [str(d)]
    assert module.run(req, check_mode=False)["changed"] is False


# ---------------------------------------------------------------------- issue 38: what the server profiles add
def test_a_socket_path_never_bound_counts_as_a_socket_only_while_empty(short_tmp: Path) -> None:
    # SGLang's PortArgs: NamedTemporaryFile(delete=False).name, then ZMQ's bind; a crash between the two leaves this.
    with tempfile.NamedTemporaryFile(delete=False, dir=short_tmp) as named:
        placeholder = named.name
    with tempfile.NamedTemporaryFile(delete=False, dir=short_tmp) as named:
        named.write(b"someone's data")  # another program's temp file with content: no socket path
        data = named.name
    bound = short_tmp / "tmpabcdefgh"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(bound))
    try:
        r = module.run(module.Request(globs=[walk.parse_glob("sockets", f"{short_tmp}/tmp????????")], remove={"sockets"}), check_mode=True)
    finally:
        s.close()
    assert {x["path"] for x in r["removed"]} == {placeholder} and {x["path"] for x in r["held"]} == {str(bound)}
    assert data not in {x["path"] for x in r["removed"] + r["held"] + r["kept"] + r["stale"]}


def test_a_directory_is_recognised_by_what_it_holds_and_nothing_else(short_tmp: Path) -> None:
    prometheus = Path(tempfile.mkdtemp(dir=short_tmp))
    (prometheus / "counter_4242.db").write_bytes(b"\0" * 8)
    (prometheus / "gauge_all_4242.db").write_bytes(b"\0" * 8)
    other = Path(tempfile.mkdtemp(dir=short_tmp))
    (other / "counter_1.db").write_bytes(b"x")
    (other / "build.log").write_bytes(b"x")  # one other file: not the Prometheus directory
    nested = Path(tempfile.mkdtemp(dir=short_tmp))
    (nested / "counter_2.db").mkdir()  # a directory of that name: not a file
    empty = Path(tempfile.mkdtemp(dir=short_tmp))
    glob = walk.parse_holding("dirs_holding", {"dir": f"{short_tmp}/tmp????????", "files": "*_[0-9]*.db"})
    notes: list[str] = []
    roots = walk.open_roots([])
    items, walkers = walk.collect([glob], roots, notes)
    try:
        assert [i.path for i in items] == [str(prometheus)] and notes == []
        assert items[0].kind == "dirs" and set(items[0].tree_names) == {prometheus.name, "counter_4242.db", "gauge_all_4242.db"}
    finally:
        for w in walkers:
            w.close()
        os.close(roots[0].fd)
    assert empty.is_dir() and nested.is_dir()


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"dir": "/tmp/*", "files": "*.db"}, "dirs: '/tmp/*' must end with a name that has literal characters"),
        ({"dir": "/tmp/tmp????????", "files": "a/*.db"}, "dirs_holding: files 'a/*.db' (for /tmp/tmp????????) must be a file name glob"),
        ({"dir": "/tmp/tmp????????", "files": "*"}, "must be a file name glob with literal characters"),
    ],
)
def test_a_bad_dirs_holding_entry_is_refused(entry: dict[str, str], words: str) -> None:
    with pytest.raises(CleanSlateError) as err:
        walk.parse_holding("dirs_holding", entry)
    assert err.value.reason == "bad_arguments" and words in err.value.msg, err.value.msg


@pytest.mark.parametrize(
    ("glob", "path", "match"),
    [
        ("/tmp/vllm_dist_*", "/tmp/vllm_dist_0123", True),
        ("/tmp/vllm_dist_*", "/tmp/x/vllm_dist_0123", False),
        ("/root/.cache/sglang/**/*.lock", "/root/.cache/sglang/triton/ab/k.lock", True),
        ("/root/.cache/sglang/**/*.lock", "/root/.cache/sglang/k.lock", True),
        ("/home/*/.cache/vllm/*.json", "/home/a/.cache/vllm/p.json", True),
        ("/tmp/sglang_weight_cache_*.ready", "/tmp/sglang_weight_cache_GPU-1.sock", False),
    ],
)
def test_a_path_is_matched_component_by_component_as_the_walker_matches(glob: str, path: str, match: bool) -> None:
    assert walk.path_matches(walk.parse_glob("files", glob), path) is match


def test_loky_and_prometheus_names_carry_their_creators_pid() -> None:
    assert walk.creator_pid("sem.loky-4242-abcd1234") == 4242
    assert walk.creator_pid("counter_77.db") == 77 and walk.creator_pid("gauge_livesum_9.db") == 9 and walk.creator_pid("histogram_5.db") == 5
    assert walk.creator_pid("sem.mp-abcd") is None and walk.creator_pid("counter_x.db") is None
