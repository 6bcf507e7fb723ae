"""What a Proxmox VE node does with a container's configuration, for the lab's real LXC containers.

pve-container turns ``/etc/pve/nodes/<node>/lxc/<vmid>.conf`` into ``/var/lib/lxc/<vmid>/config``
(``PVE::LXC::update_lxc_config``) and starts ``lxc-start -n <vmid>``; its pre-start hook makes the
``devN`` passthrough nodes under ``/var/lib/lxc/<vmid>/passthrough`` and its autodev hook bind-mounts
them into the container's ``/dev`` (``lxc_pve_hook.py`` here, beside this file). This module is the first
half: :func:`lxc_config` writes the LXC configuration from the PVE one, line by line as
``update_lxc_config`` does (pve-container 6.1, src/PVE/LXC.pm), and :func:`make_image` makes the
container's disk (a small root file system whose ``/usr`` is this machine's, see below).

Where the lab departs from a Proxmox VE node, and why (each is marked ``lab:`` in the written config):

* this machine mounts cgroup v1, so the device rules PVE writes as ``lxc.cgroup2.devices.allow``
  (``devN`` rules and raw keys alike) are written as ``lxc.cgroup.devices.allow``; PVE 8 and 9 write
  the cgroup2 form, which LXC turns into a BPF device program on ``/sys/fs/cgroup/lxc/<vmid>``;
* ``lxc.cgroup.relative = 1`` (PVE: 0): the container's cgroups nest under its node's, which is a
  directory of this run (``<run>/<node>/lxc/<vmid>/ns``), so that two labs on one machine never share a
  cgroup; the tail ``lxc/<vmid>/ns`` is PVE's layout;
* no AppArmor profile and no PVE seccomp file (this kernel has no AppArmor; Debian's LXC has no
  ``pve-userns.seccomp``), no memory or CPU limits (PVE writes them for cgroup2 controllers only);
* the network device is attached with ``lxc.net.N.link`` (PVE: its ``lxcnetaddbr`` script) and the
  address of ``net0`` is set by LXC, as PVE does with ``host-managed=1``: the image runs no network setup;
* ``lxc.environment`` carries the simulated driver's address (``GPUSIM_STATE``, ``GPUSIM_DEV_DIR``) into
  the container: what the kernel gives a real driver, the simulated one reads from the environment;
* the hooks are the lab's (``lxc_pve_hook.py``), named in the config; PVE's come from its LXC package.

The image: ``/usr`` is an overlay of this machine's ``/usr`` with a small upper layer per container (the
container's own ``/sbin/init``, the simulated driver's library and ``nvidia-smi`` where NVIDIA's
container hook puts them, ``libcuda.so.1`` beside it, the job binaries); ``/etc`` is the container's own (root, sshd, the loader
cache); the modules' Pythons are this machine's, bind-mounted read-only at their own paths, like a
``mpN`` bind mount point. The pre-start hook mounts it all in the container's private mount namespace.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pvesim import parse_conf

#: The hooks, as LXC runs them (through sh -c, the vmid, "lxc" and the hook type appended).
HOOK = f"/usr/bin/python3 -I {Path(__file__).resolve().parent / 'lxc_pve_hook.py'}"
LXC_CONFIG_PATH = "/usr/share/lxc/config"
#: PVE's default id map for unprivileged containers (/etc/subuid root:100000:65536).
ID_BASE, ID_COUNT = 100000, 65536
#: pve-container's default tty count (PVE::LXC::Config $confdesc->{tty}).
DEFAULT_TTY = 2
#: Where NVIDIA's container hook (nvidia-container-cli) puts the driver's library and tools.
LIB_DIR = "lib/x86_64-linux-gnu"


def parse_device(value: str) -> dict[str, Any]:
    """A ``devN`` value (``[[path=]<Path>][,deny-write=<1|0>][,gid=<int>][,mode=<0ddd>][,uid=<int>]``)."""
    out: dict[str, Any] = {}
    for part in value.split(","):
        key, eq, val = part.partition("=")
        if not eq:
            out["path"] = key
        else:
            out[key] = val
    return out


def devices(conf: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The ``devN`` entries of a parsed config, in key order."""
    keys = sorted((k for k in conf if re.fullmatch(r"dev\d+", k)), key=lambda k: int(k[3:]))
    return [(k, parse_device(str(conf[k]))) for k in keys]


def read_conf(path: Path) -> dict[str, Any]:
    """``PVE::LXC::Config->load_config`` of one file (live section only)."""
    return parse_conf(path.read_text(encoding="utf-8"), "lxc")


def unprivileged(conf: dict[str, Any]) -> bool:
    return bool(int(conf.get("unprivileged", 0) or 0)) or any(k == "lxc.idmap" for k, _v in conf.get("lxc", []))


def _v1(key: str) -> str:
    """A raw cgroup2 device key in the cgroup v1 form this machine needs (see the module docstring)."""
    return key.replace("lxc.cgroup2.devices.", "lxc.cgroup.devices.")


def _cpuset(cores: int) -> str | None:
    """PVE's cpuset for ``cores``: the node's CPUs when there are no more of them than ``cores``
    (PVE removes random members until ``cores`` are left; the lab keeps the lowest)."""
    cpus = sorted(os.sched_getaffinity(0))
    if not cpus:
        return None
    chosen = cpus[: max(1, cores)]
    ranges, start, prev = [], chosen[0], chosen[0]
    for c in chosen[1:]:
        if c != prev + 1:
            ranges.append(f"{start}-{prev}" if start != prev else str(start))
            start = c
        prev = c
    ranges.append(f"{start}-{prev}" if start != prev else str(start))
    return ",".join(ranges)


def lxc_config(vmid: int, conf: dict[str, Any], dev_root: str, environment: dict[str, str]) -> str:
    """The ``/var/lib/lxc/<vmid>/config`` pve-container writes for ``conf``.

    ``dev_root`` is where the node's device files are seen from here (``/`` on a node; the lab reads
    major:minor of ``devN`` paths through it). ``environment`` is the lab's ``lxc.environment``.
    """
    lines: list[str] = [f"# /var/lib/lxc/{vmid}/config: written from /etc/pve/nodes/<node>/lxc/{vmid}.conf as pve-container does"]
    lines += [
        "# lab: PVE writes 0; the container's cgroups nest under its node's (see tests/lab/pvenode.py)",
        "lxc.cgroup.relative = 1",
        f"lxc.cgroup.dir.monitor = lxc.monitor/{vmid}",
        f"lxc.cgroup.dir.container = lxc/{vmid}",
        "lxc.cgroup.dir.container.inner = ns",
    ]
    arch = conf.get("arch")
    if not arch:
        raise ValueError("missing 'arch' - internal error")
    lines.append(f"lxc.arch = {arch}")
    unpriv = unprivileged(conf)
    custom_idmap = any(k == "lxc.idmap" for k, _v in conf.get("lxc", []))
    ostype = conf.get("ostype") or "debian"
    inc = f"{LXC_CONFIG_PATH}/{ostype}.common.conf"
    lines.append(f"lxc.include = {inc if os.path.isfile(inc) else LXC_CONFIG_PATH + '/common.conf'}")
    if unpriv:
        inc = f"{LXC_CONFIG_PATH}/{ostype}.userns.conf"
        lines.append(f"lxc.include = {inc if os.path.isfile(inc) else LXC_CONFIG_PATH + '/userns.conf'}")
    lines += ["# lab: PVE's hooks come with its LXC package (common.conf.d); these are the lab's", f"lxc.hook.pre-start = {HOOK}", f"lxc.hook.autodev = {HOOK}"]
    if unpriv:
        lines.append("lxc.mount.auto = sys:mixed")
    for key, dev in devices(conf):
        if not dev.get("path"):
            raise ValueError(f"Path is not defined for passthrough device {key}")
        st = os.stat(os.path.join(dev_root, dev["path"].lstrip("/")))
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)):
            raise ValueError(f"{dev['path']} is not a device")
        kind = "b" if stat.S_ISBLK(st.st_mode) else "c"
        perms = "r" if str(dev.get("deny-write", "0")) in ("1", "true", "yes", "on") else "rw"
        rule = f"{kind} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        lines += [f"# {key}: {dev['path']} (lab: PVE writes lxc.cgroup2, this machine has cgroup v1)", f"lxc.cgroup.devices.allow = {rule} {perms}"]
        if perms == "r":
            lines.append(f"lxc.cgroup.devices.deny = {rule} w")
    lines.append("lxc.monitor.unshare = 1")
    if unpriv and not custom_idmap:
        lines += [f"lxc.idmap = u 0 {ID_BASE} {ID_COUNT}", f"lxc.idmap = g 0 {ID_BASE} {ID_COUNT}"]
    if str(conf.get("console", "1")) in ("0", "false", "no", "off"):
        lines.append("lxc.console.path = none")
    lines.append(f"lxc.tty.max = {int(conf.get('tty', DEFAULT_TTY))}")
    lines.append("lxc.environment = TERM=linux")
    lines.append(f"lxc.uts.name = {conf.get('hostname') or f'CT{vmid}'}")
    if "rootfs" not in conf:
        raise ValueError("missing 'rootfs' configuration")
    lines.append(f"lxc.rootfs.path = /var/lib/lxc/{vmid}/rootfs")
    for key in sorted(k for k in conf if re.fullmatch(r"net\d+", k)):
        ind = key[3:]
        net = dict(part.partition("=")[::2] for part in str(conf[key]).split(","))
        lines += [f"lxc.net.{ind}.type = veth", f"lxc.net.{ind}.veth.pair = veth{vmid}i{ind}"]
        if net.get("hwaddr"):
            lines.append(f"lxc.net.{ind}.hwaddr = {net['hwaddr']}")
        if net.get("name"):
            lines.append(f"lxc.net.{ind}.name = {net['name']}")
        lines.append(f"lxc.net.{ind}.mtu = {net.get('mtu') or 1500}")
        lines += [f"# lab: PVE attaches with lxc.net.{ind}.script.up = /usr/share/lxc/lxcnetaddbr", f"lxc.net.{ind}.link = {net.get('bridge', 'vmbr0')}"]
        if net.get("ip") and net["ip"] not in ("dhcp", "manual"):
            lines += ["# lab: as PVE with host-managed=1 (the image runs no network setup)", f"lxc.net.{ind}.ipv4.address = {net['ip']}"]
        if net.get("gw"):
            lines.append(f"lxc.net.{ind}.ipv4.gateway = {net['gw']}")
        lines.append(f"lxc.net.{ind}.flags = up")
    for variable in str(conf.get("env", "")).split("\0"):
        if variable:
            lines += ["# PVE (LXC 6): lxc.environment.runtime", f"lxc.environment = {variable}"]
    for name, value in environment.items():
        lines += ["# lab: the simulated driver's address", f"lxc.environment = {name}={value}"]
    had_cpuset = False
    for key, value in conf.get("lxc", []):
        had_cpuset = had_cpuset or key in ("lxc.cgroup2.cpuset.cpus", "lxc.cgroup.cpuset.cpus")
        if _v1(key) != key:
            lines.append(f"# lab: PVE passes {key} as written; this machine has cgroup v1")
        lines.append(f"{_v1(key)} = {value}")
    if not had_cpuset and conf.get("cores"):
        cpus = _cpuset(int(conf["cores"]))
        if cpus:
            lines.append(f"lxc.cgroup.cpuset.cpus = {cpus}")
    return "\n".join(lines) + "\n"


@dataclass
class Image:
    """A container's disk: the root file system skeleton, the upper layer of its ``/usr`` and the
    bind mounts of this machine's files it gets (``[source, target, read_only]``)."""

    rootfs: Path
    usr_upper: Path
    usr_work: Path
    binds: list[tuple[str, str, bool]] = field(default_factory=list)

    def spec(self) -> dict[str, Any]:
        """What the pre-start hook mounts (``/var/lib/lxc/<vmid>/image.json``)."""
        return {
            "usr": {"lower": "/usr", "upper": str(self.usr_upper), "work": str(self.usr_work)},
            "binds": [{"source": s, "target": t, "read_only": ro} for s, t, ro in self.binds],
        }


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def init_script(vmid: int) -> str:
    """The image's ``/sbin/init``: what a distribution's init does first (a tmpfs on ``/dev/shm``), then
    LXC's own init, ``init.lxc``, becomes PID 1 (it reaps every orphan and keeps one child)."""
    return (
        "#!/bin/sh\n"
        "# /sbin/init of the lab's container image (tests/lab/pvenode.py): /dev/shm as an init sets it up,\n"
        "# then LXC's init as PID 1. It reaps orphans; its one child keeps the container up.\n"
        "mkdir -p /dev/shm && mount -t tmpfs -o nosuid,nodev,mode=1777 shm /dev/shm\n"
        f"exec /usr/sbin/init.lxc --name {vmid} -- /bin/sleep infinity\n"
    )


def make_image(
    base: Path,
    vmid: int,
    hostname: str,
    unpriv: bool,
    files: dict[str, Path],
    binds: list[tuple[str, str, bool]],
    driver_version: str,
) -> Image:
    """Make the container's disk under ``base`` (``/var/lib/lxc/<vmid>`` as the node sees it).

    ``files`` go into ``/usr`` (path relative to it -> file to copy), ``binds`` are this machine's
    directories the container sees read-only (or not) at the same path. For an unprivileged container
    everything is owned by its root, host uid 100000, as on a Proxmox VE node.
    """
    rootfs = base / "rootfs"
    image = Image(rootfs=rootfs, usr_upper=base / "usr-upper", usr_work=base / "usr-work", binds=list(binds))
    for d in ("usr", "etc", "root", "tmp", "dev", "proc", "sys", "run/sshd", "var/tmp", "var/log", "opt", "etc/ssh", "root/.ssh"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for link, target in (("bin", "usr/bin"), ("sbin", "usr/sbin"), ("lib", "usr/lib"), ("lib64", "usr/lib64")):
        if os.path.islink(f"/{link}") or not os.path.exists(f"/{link}"):
            (rootfs / link).symlink_to(target)
        else:
            (rootfs / link).mkdir()
    (rootfs / "root").chmod(0o700)
    (rootfs / "root" / ".ssh").chmod(0o700)
    for d in ("tmp", "var/tmp"):
        (rootfs / d).chmod(0o1777)
    etc = rootfs / "etc"
    users = ["root:x:0:0:root:/root:/bin/bash", "sshd:x:100:65534::/run/sshd:/usr/sbin/nologin", "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin"]
    _write(etc / "passwd", "\n".join(users) + "\n")
    _write(etc / "group", "root:x:0:\nvideo:x:44:\nnogroup:x:65534:\n")
    _write(etc / "shadow", "root:*:20000:0:99999:7:::\nsshd:*:20000:0:99999:7:::\n", 0o640)
    _write(etc / "hostname", hostname + "\n")
    _write(etc / "hosts", f"127.0.0.1\tlocalhost\n127.0.1.1\t{hostname}\n")
    _write(etc / "resolv.conf", "")
    for name in ("nsswitch.conf", "ld.so.conf", "ld.so.cache"):
        if os.path.exists(f"/etc/{name}"):
            shutil.copy2(f"/etc/{name}", etc / name)
    if os.path.isdir("/etc/ld.so.conf.d"):
        shutil.copytree("/etc/ld.so.conf.d", etc / "ld.so.conf.d")
    (etc / "os-release").symlink_to("../usr/lib/os-release")
    upper = image.usr_upper
    for d in ("sbin", "bin", LIB_DIR, "local/bin"):
        (upper / d).mkdir(parents=True, exist_ok=True)
    image.usr_work.mkdir(parents=True, exist_ok=True)
    _write(upper / "sbin" / "init", init_script(vmid), 0o755)
    for rel, src in files.items():
        dest = upper / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    for soname in ("libnvidia-ml.so.1", "libcuda.so.1"):
        lib = upper / LIB_DIR / soname
        if lib.exists():
            # As the driver's packages and NVIDIA's hook lay it out: the versioned file and the soname link.
            versioned = soname[: -len("1")] + driver_version
            lib.rename(lib.with_name(versioned))
            lib.symlink_to(versioned)
    for _source, target, _ro in binds:
        (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (base / "image.json").write_text(json.dumps(image.spec(), indent=1) + "\n")
    if unpriv:
        for top in (rootfs, upper, image.usr_work):
            _chown_tree(top, ID_BASE)
    return image


def _chown_tree(top: Path, base: int) -> None:
    """Shift the owner of everything under ``top`` by ``base`` (root becomes the container's root)."""
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [*dirnames, *filenames]:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            os.lchown(p, base + st.st_uid, base + st.st_gid)
    st = os.lstat(top)
    os.lchown(top, base + st.st_uid, base + st.st_gid)
