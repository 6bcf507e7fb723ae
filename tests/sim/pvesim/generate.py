"""Generated clusters for benchmarks: N nodes x M guests with a realistic mix.

Per node, deterministic for a given seed: two thirds LXC, one third QEMU;
about 65 % running, 30 % stopped, 5 % templates; about 12 % of the containers
use a GPU (rotating through every passthrough variant: ``devN``, raw
cgroup2 + mount entries, the NVIDIA hook style, cgroup v1 with ``=``
separators), about 10 % of the VMs pass an NVIDIA GPU through ``hostpciN``
and 5 % pass a NIC. Only some GPU guests carry a ``gpu`` tag, so nobody can
find them by tag alone. ``meta.gpu`` on each guest is the ground truth.
"""

from __future__ import annotations

import random
from typing import Any

NVIDIA_H100 = {"class": "0x030200", "vendor": "0x10de", "device": "0x2330", "vendor_name": "NVIDIA Corporation", "device_name": "GH100 [H100 SXM5 80GB]"}
INTEL_NIC = {"class": "0x020000", "vendor": "0x8086", "device": "0x1521", "vendor_name": "Intel Corporation", "device_name": "I350 Gigabit Network Connection"}


def _lxc_gpu_conf(variant: int, gpu: int, name: str) -> str:
    dev = f"/dev/nvidia{gpu}"
    head = f"arch: amd64\nhostname: {name}\nmemory: 16384\nostype: ubuntu\nrootfs: local-lvm:subvol-disk,size=16G\n"
    if variant == 0:
        return head + f"dev0: {dev},gid=44\ndev1: /dev/nvidiactl,gid=44\ndev2: /dev/nvidia-uvm,gid=44\n"
    if variant == 1:
        return head + (
            "lxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.allow: c 508:* rwm\n"
            f"lxc.mount.entry: {dev} dev/nvidia{gpu} none bind,optional,create=file\n"
            "lxc.mount.entry: /dev/nvidiactl dev/nvidiactl none bind,optional,create=file\n"
            "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file 0 0\n"
        )
    if variant == 2:
        return head + (
            "lxc.cgroup.devices.allow: c 195:* rwm\n"
            "lxc.hook.pre-start: sh -c '[ ! -f /dev/nvidia-uvm ] && /usr/bin/nvidia-modprobe -c0 -u'\n"
            "lxc.environment: NVIDIA_VISIBLE_DEVICES=all\nlxc.hook.mount: /usr/share/lxc/hooks/nvidia\n"
        )
    return head + f"lxc.cgroup.devices.allow = c 195:{gpu} rwm\nlxc.mount.entry = {dev} dev/nvidia{gpu} none bind,optional,create=file\n"


def benchmark_cluster(nodes: int = 3, guests_per_node: int = 300, seed: int = 20260101, gpus_per_node: int = 8) -> dict[str, Any]:
    """A cluster description (see the package docstring) with ``nodes * guests_per_node`` guests."""
    rng = random.Random(seed)
    desc: dict[str, Any] = {"name": f"bench-{nodes}x{guests_per_node}", "pve_version": "8.2.4", "nodes": [], "guests": []}
    vmid = 1000
    for n in range(nodes):
        node = f"pve{n + 1}"
        pci = [{"id": f"0000:{0x17 + 0x10 * g:02x}:00.0", "iommugroup": 20 + g, **NVIDIA_H100} for g in range(gpus_per_node)]
        pci.append({"id": "0000:02:00.0", "iommugroup": 2, **INTEL_NIC})
        desc["nodes"].append({"name": node, "ip": f"10.10.0.{11 + n}", "pci": pci})
        for i in range(guests_per_node):
            vmid += 1
            kind = "lxc" if i % 3 else "qemu"
            roll = rng.random()
            template = roll < 0.05
            status = "stopped" if template or roll < 0.35 else "running"
            name = f"{'ct' if kind == 'lxc' else 'vm'}-{node}-{i:03d}"
            if i % 97 == 5:
                name = "scratch"  # the same name on every node
            guest: dict[str, Any] = {"vmid": vmid, "node": node, "type": kind, "name": name, "status": status, "template": template, "meta": {"gpu": False}}
            tags = rng.choice([[], [], ["web"], ["batch"], ["db"]])
            gpu_roll = rng.random()
            if kind == "lxc" and not template and gpu_roll < 0.12:
                variant = rng.randrange(4)
                guest["conf"] = _lxc_gpu_conf(variant, rng.randrange(gpus_per_node), name)
                guest["meta"] = {"gpu": True, "variant": variant}
                tags = rng.choice([["gpu"], ["ml"], [], ["gpu", "train"]])
            elif kind == "qemu" and not template and gpu_roll < 0.10:
                gpu = rng.randrange(gpus_per_node)
                guest["conf"] = f"name: {name}\nmachine: q35\nmemory: 65536\nhostpci0: {0x17 + 0x10 * gpu:02x}:00,pcie=1,x-vga=1\n"
                guest["meta"] = {"gpu": True, "variant": "hostpci"}
                tags = rng.choice([["gpu"], ["ml"], []])
            elif kind == "qemu" and not template and gpu_roll < 0.15:
                guest["conf"] = f"name: {name}\nmemory: 4096\nhostpci0: 0000:02:00.0\n"
            if kind == "qemu" and rng.random() < 0.5:
                guest.setdefault("config", {})["agent"] = "1"
            if tags:
                guest["tags"] = tags
            desc["guests"].append(guest)
    return desc


def gpu_guests(desc: dict[str, Any]) -> set[int]:
    """Ground truth: the vmids the generator gave a GPU."""
    return {int(g["vmid"]) for g in desc["guests"] if g.get("meta", {}).get("gpu") is True}
