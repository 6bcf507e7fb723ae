"""First process of a lab hypervisor: makes the machine a Proxmox VE node would be, then becomes its init.

Run by the lab (tests/lab/builder.py) as ``python -I node_init.py CONFIG_JSON`` (the venv's Python: the
test kit's path finds gpusim) through ``unshare --pid --fork --mount-proc --uts`` inside the node's
network namespace, so everything here is private to the node. In order:

* the host name (``pve1``): pct and PVE's hooks read the node's name from it;
* its cgroups: the node's directory of this run (``<run>/<node>``) in every hierarchy, so that LXC's
  ``lxc/<vmid>`` cgroups of this run never meet another run's;
* a ``/dev`` of its own (gpusim.devns.private_dev: null, zero, pts, shm, ...) with the simulated GPUs'
  device files bind-mounted at ``/dev/nvidia*`` (same inodes), where a node has them;
* ``/sys`` of its own network namespace (LXC checks ``/sys/class/net/<bridge>``), its cgroups kept;
* ``/var/lib/lxc`` (this run's directory of the node), ``/run/lxc`` (a tmpfs: LXC's locks);
* ``/etc`` as an overlay (writes stay in the node) with ``/etc/pve`` as pmxcfs shows it: ``nodes/``
  shared by every node of the lab, ``local``, ``lxc`` and ``qemu-server`` pointing at this node's;
* ``/usr/sbin`` with ``pct`` (tests/sim/bin/pct) in it, read-only;

then execs gpusim's reaping init (``_sbinit.py READY_FD``), which tells the lab it is ready.
"""

import json
import os
import socket
import sys
import tempfile

from gpusim.devns import private_dev
from lab.lxc_pve_hook import mount  # mount(2) through libc, as the container hooks use it

MS_RDONLY, MS_BIND, MS_MOVE, MS_REC = 1, 4096, 8192, 16384


def main():
    cfg = json.loads(sys.argv[1])
    socket.sethostname(cfg["hostname"])
    for procs in cfg["cgroup_procs"]:
        with open(procs, "w", encoding="ascii") as fh:
            fh.write(f"{os.getpid()}\n")
    private_dev()
    for name in sorted(os.listdir(cfg["dev_dir"])):
        if name.startswith("nvidia"):
            source, target = os.path.join(cfg["dev_dir"], name), f"/dev/{name}"
            if os.path.isdir(source):  # nvidia-caps/
                os.mkdir(target)
                mount(source, target, None, MS_BIND | MS_REC)
                continue
            with open(target, "w", encoding="ascii"):
                pass
            mount(source, target, None, MS_BIND)
    sysfs = tempfile.mkdtemp(prefix="sysfs-", dir=cfg["scratch"])
    mount("sysfs", sysfs, "sysfs")
    mount("/sys/fs/cgroup", f"{sysfs}/fs/cgroup", None, MS_BIND | MS_REC)
    mount(sysfs, "/sys", None, MS_MOVE)
    os.makedirs("/run/lxc", exist_ok=True)
    mount("gpuops-lab-lxc-run", "/run/lxc", "tmpfs", 0, "mode=0755")
    os.makedirs("/var/lib/lxc", exist_ok=True)
    mount(cfg["lxc_dir"], "/var/lib/lxc", None, MS_BIND)
    mount("gpuops-lab-etc", "/etc", "overlay", 0, f"lowerdir=/etc,upperdir={cfg['etc_upper']},workdir={cfg['etc_work']}")
    os.makedirs("/etc/pve", exist_ok=True)
    mount("gpuops-lab-pve", "/etc/pve", "tmpfs", 0, "mode=0755")
    os.mkdir("/etc/pve/nodes")
    mount(cfg["cluster_nodes"], "/etc/pve/nodes", None, MS_BIND)
    node = cfg["hostname"]
    for link, target in (("local", f"nodes/{node}"), ("lxc", f"nodes/{node}/lxc"), ("qemu-server", f"nodes/{node}/qemu-server")):
        os.symlink(target, f"/etc/pve/{link}")
    mount("gpuops-lab-sbin", "/usr/sbin", "overlay", MS_RDONLY, f"lowerdir={cfg['sbin_dir']}:/usr/sbin")
    os.execv(sys.executable, [sys.executable, "-I", "-S", cfg["sbinit"], str(cfg["ready_fd"])])


if __name__ == "__main__":
    main()
