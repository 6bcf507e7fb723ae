"""_residue.walk: globs checked, the defaults, a walk that never follows a symlink (real files, under tools/pidns-run)."""

from __future__ import annotations

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
