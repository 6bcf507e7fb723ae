"""Run a command in a private mount namespace where other users can reach this machine's Python,
optionally as root of a new user namespace with a shifted id map.

    python -I -S _nsview.py [--map BASE COUNT] [--expose PATH]... -- COMMAND [ARG...]

Why: on this machine (and many CI images) the interpreters live under /root (pyenv), which is
mode 0700, so any uid but 0 cannot start them. The command's mount namespace gets a /root of its
own (a tmpfs, mode 0755) holding bind mounts of the real /root entries named with --expose (their
own permissions unchanged: a 0700 .ssh stays private). Nothing outside the namespace changes.

--map BASE COUNT also does what Proxmox does for an unprivileged container
(``lxc.idmap: u 0 100000 65536``), without newuidmap: this process enters a new user namespace, a
forked helper that stayed outside writes its uid_map and gid_map (root may map any range), then it
becomes uid/gid 0 inside. Either way the command is exec'd and keeps this pid. Needs root.
"""

import ctypes
import os
import shutil
import sys
import tempfile

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enc(value):
    return None if value is None else os.fsencode(value)


def _mount(src, dst, fstype, flags, data=None) -> None:
    _check(libc.mount(_enc(src), _enc(dst), _enc(fstype), flags, _enc(data)), f"mount {src} on {dst}")


def root_view(expose: list) -> None:
    """A private mount namespace whose /root is traversable and shows only the exposed entries."""
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    names = sorted({p[len("/root/") :].split("/", 1)[0] for p in expose if p.startswith("/root/")} - {""})
    if not names or os.stat("/root").st_mode & 0o001:
        return
    hold = tempfile.mkdtemp(prefix="gpusim-rootview-")
    _mount("/root", hold, None, MS_BIND | MS_REC)
    _mount("gpusim-root", "/root", "tmpfs", 0, "mode=0755")
    for name in names:
        src = os.path.join(hold, name)
        if not os.path.exists(src):
            continue
        dst = os.path.join("/root", name)
        if os.path.isdir(src):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        _mount(src, dst, None, MS_BIND | MS_REC)
    _check(libc.umount2(os.fsencode(hold), MNT_DETACH), f"umount {hold}")
    os.rmdir(hold)


def enter_userns(base: int, count: int) -> None:
    me = os.getpid()
    r_go, w_go = os.pipe()
    r_done, w_done = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(w_go)
        os.close(r_done)
        os.read(r_go, 1)  # the parent is in its new user namespace now
        status = 0
        try:
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{me}/{name}", "w", encoding="ascii") as fh:
                    fh.write(f"0 {base} {count}\n")
        except OSError as exc:
            print(f"_nsview.py: writing the id maps: {exc}", file=sys.stderr)
            status = 1
        os.write(w_done, b"ok" if status == 0 else b"no")
        os._exit(status)
    os.close(r_go)
    os.close(w_done)
    _check(libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    os.write(w_go, b"x")
    answer = os.read(r_done, 2)
    os.waitpid(helper, 0)
    if answer != b"ok":
        raise SystemExit(1)
    os.setresgid(0, 0, 0)
    os.setgroups([])
    os.setresuid(0, 0, 0)


def main() -> int:
    args = sys.argv[1:]
    expose, idmap = [], None
    while args and args[0] != "--":
        if args[0] == "--expose" and len(args) > 1:
            expose.append(os.path.realpath(args[1]))
            args = args[2:]
        elif args[0] == "--map" and len(args) > 2:
            idmap = (int(args[1]), int(args[2]))
            args = args[3:]
        else:
            print("usage: _nsview.py [--map BASE COUNT] [--expose PATH]... -- COMMAND [ARG...]", file=sys.stderr)
            return 2
    command = args[1:]
    if not command:
        print("_nsview.py: no command", file=sys.stderr)
        return 2
    # Resolved before any uid switch: afterwards this interpreter may not read its own library.
    path = shutil.which(command[0]) or command[0]
    root_view(expose)
    if idmap:
        enter_userns(*idmap)
    os.execv(path, command)
    return 127


if __name__ == "__main__":
    sys.exit(main())
