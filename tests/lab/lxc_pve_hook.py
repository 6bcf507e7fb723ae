"""pve-container's pre-start and autodev hooks, for the lab's real LXC containers (stdlib only).

LXC runs it as ``/usr/bin/python3 -I lxc_pve_hook.py <vmid> lxc <pre-start|autodev>`` (``lxc.hook.*`` in
the config that tests/lab/pvenode.py writes; the node's Debian Python), with ``LXC_ROOTFS_PATH`` and
``LXC_ROOTFS_MOUNT`` set.

pre-start (real root, in the monitor's private mount namespace: ``lxc.monitor.unshare = 1``), as
src/lxc-pve-prestart-hook: the container's disk is mounted on ``/var/lib/lxc/<vmid>/rootfs`` (here: the
lab's image, ``image.json``: ``/usr`` as an overlay and this machine's Pythons and the simulated
driver's state bound in), a tmpfs goes on ``/var/lib/lxc/<vmid>/passthrough``, every ``devN`` of the
container's configuration gets its node there, and ``passthrough/devices`` lists them
(``c:<major>:<minor>:/dev/<name>``). PVE mknods a node with the device's numbers; the simulated driver
tells its GPUs apart by inode (they all have /dev/zero's numbers), so the lab bind-mounts the node's
own device file there instead: the same inode, as the raw ``lxc.mount.entry`` way gives.

autodev (the container's root, in its mount namespace, before it pivots), as src/lxc-pve-autodev-hook:
each listed node is bind-mounted onto a regular file made at ``/dev/<name>`` of the container.
"""

import ctypes
import json
import os
import re
import socket
import stat
import sys

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC = 1, 32, 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


def mount(source, target, fstype=None, flags=0, data=None):
    args = [None if v is None else os.fsencode(v) for v in (source, target, fstype, data)]
    if _libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def load_config(vmid):
    """PVE::LXC::Config->load_config: /etc/pve/nodes/<this node>/lxc/<vmid>.conf, live section only."""
    node = socket.gethostname().split(".")[0]
    path = f"/etc/pve/nodes/{node}/lxc/{vmid}.conf"
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        sys.exit(f"Configuration file 'nodes/{node}/lxc/{vmid}.conf' does not exist")
    conf = {}
    for line in text.splitlines():
        if line.startswith("["):
            break
        m = re.match(r"^([a-z][a-z_]*\d*):\s*(.+?)\s*$", line)
        if m:
            conf[m.group(1)] = m.group(2)
    return conf


def passthrough_devices(conf):
    """(key, path, options) of every devN, in key order."""
    out = []
    for key in sorted((k for k in conf if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:])):
        opts = {}
        for part in conf[key].split(","):
            name, eq, value = part.partition("=")
            opts[name if eq else "path"] = value if eq else name
        out.append((key, opts.get("path"), opts))
    return out


def pre_start(vmid):
    base = f"/var/lib/lxc/{vmid}"
    rootdir = os.environ.get("LXC_ROOTFS_PATH") or f"{base}/rootfs"
    rootdir = rootdir.split(":", 1)[1] if rootdir.startswith("dir:") else rootdir
    conf = load_config(vmid)
    # The container's disk (PVE: mount_all of rootfs and mpN).
    with open(f"{base}/image.json", encoding="utf-8") as fh:
        image = json.load(fh)
    usr = image["usr"]
    mount("overlay", f"{rootdir}/usr", "overlay", 0, f"lowerdir={usr['lower']},upperdir={usr['upper']},workdir={usr['work']}")
    for b in image["binds"]:
        target = rootdir + b["target"]
        mount(b["source"], target, None, MS_BIND | MS_REC)
        if b["read_only"]:
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    # Device passthrough.
    pdir = f"{base}/passthrough"
    os.makedirs(pdir, exist_ok=True)
    mount("none", pdir, "tmpfs", 0, "size=8k")
    lines = []
    for key, path, _opts in passthrough_devices(conf):
        if path is None:
            sys.exit(f"Path is not defined for passthrough device {key}")
        try:
            st = os.stat(path)
        except OSError:
            sys.exit(f"Could not get mode or device ID of {path}")
        node = pdir + path
        os.makedirs(os.path.dirname(node), exist_ok=True)
        with open(node, "w", encoding="ascii"):
            pass
        mount(path, node, None, MS_BIND)  # PVE: mknod with st_rdev, chmod, chown to the mapped ids
        kind = "b" if stat.S_ISBLK(st.st_mode) else "c"
        lines.append(f"{kind}:{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}:{path}\n")
    if lines:
        with open(f"{pdir}/devices", "w", encoding="ascii") as fh:
            fh.writelines(lines)


def autodev(vmid):
    root = os.environ["LXC_ROOTFS_MOUNT"]
    try:
        with open(f"/var/lib/lxc/{vmid}/passthrough/devices", encoding="ascii") as fh:
            entries = fh.read().splitlines()
    except FileNotFoundError:
        return
    for line in entries:
        m = re.match(r"^(b|c):(\d+):(\d+):/dev/(\S+)\s*$", line)
        if not m or ".." in m.group(4):
            sys.stderr.write(f"invalid /var/lib/lxc/{vmid}/passthrough/devices entry: {line}\n")
            continue
        dev = m.group(4)
        target = f"{root}/dev/{dev}"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="ascii"):
            pass  # PVE: mknod S_IFREG, the mount point
        mount(f"/var/lib/lxc/{vmid}/passthrough/dev/{dev}", target, None, MS_BIND)


def main(argv):
    if len(argv) < 4 or argv[2] != "lxc":
        sys.exit("usage: lxc_pve_hook.py <vmid> lxc <pre-start|autodev>")
    vmid, kind = argv[1], argv[3]
    if not vmid.isdigit():
        sys.exit(f"got strange vmid '{vmid}'")
    {"pre-start": pre_start, "autodev": autodev}[kind](vmid)


if __name__ == "__main__":
    main(sys.argv)
