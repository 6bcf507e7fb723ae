"""The documented examples do what the README says (issue 31): gpu_procs_kill's own example ends renamed vLLM workers
(VLLM::Worker_TP1), which needs (?i); the Proxmox inventory example, the README and the guide agree on where the API's
address comes from, and the example file, used as the README says, lists the cluster's GPU hosts."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from gpusim import Node
from pvesim import PveSim, load_cluster
from support.ansible import ROOT, local_play, run_playbook
from support.orphans import renamed
from support.proxmox import group_hosts, inventory_list

from ansible_collections.gpuops.clean_slate.plugins.modules import gpu_procs_kill

EXAMPLE = ROOT / "docs" / "examples" / "proxmox" / "gpu.proxmox.yml"


def test_gpu_procs_kill_example_ends_renamed_vllm_and_sglang_workers() -> None:
    """The module's example for SGLang and vLLM workers, as ansible-doc shows it, against renamed processes that hold
    no GPU (only the patterns can find them)."""
    task = next(t for t in yaml.safe_load(gpu_procs_kill.EXAMPLES) if "renamed" in t["name"])
    names = ["VLLM::Worker_TP1", "sglang::scheduler_TP0", "other-job"]
    with Node(gpus=2, seed="example") as n:
        sb = n.sandbox()
        try:
            procs = renamed(sb, names)
            defaults = {"gpuops.clean_slate.gpu_procs_kill": {"device_dir": str(n.dev_dir)}}
            run = run_playbook(local_play([task], module_defaults=defaults), inventory="localhost,", env=n.env(), wrapper=sb.nsenter_prefix())
            assert run.rc == 0, run.output
            ended = {t["cmdline"].split()[0] for t in run.task(task["name"])["result"]["targets"]}
            assert ended == {"VLLM::Worker_TP1", "sglang::scheduler_TP0"}, ended
            assert not procs["VLLM::Worker_TP1"].is_running() and procs["other-job"].is_running()
        finally:
            sb.stop()


def snippet(text: str, start: str, opener: str, closer: str) -> dict:
    body = text[text.index(start) :]
    body = body[body.index(opener) + len(opener) :]
    return yaml.safe_load(body[: body.index(closer)] if closer else body)


def test_the_proxmox_example_readme_and_guide_agree_and_the_example_works(tmp_path: Path) -> None:
    example = yaml.safe_load(EXAMPLE.read_text())
    readme = (ROOT / "README.md").read_text()
    in_readme = snippet(readme, "or, for Proxmox VE, the inventory plugin", "```yaml", "```")
    guide = (ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst").read_text()
    block = guide[guide.index("# gpu.proxmox.yml") :]
    in_guide = yaml.safe_load("\n".join(line[4:] for line in block[: block.index("\n\n")].splitlines()[0:] if line.startswith("    ")) or "{}")
    # What the README and the guide show is the example's, word for word; none of them sets the API's address.
    for shown in (in_readme, in_guide):
        assert shown and all(example.get(k) == v for k, v in shown.items()), (shown, example)
        assert "url" not in shown
    assert "url" not in example
    wanted = {"PROXMOX_URL", "PROXMOX_TOKEN_ID", "PROXMOX_TOKEN_SECRET"}
    said = readme[readme.index("or, for Proxmox VE, the inventory plugin") :][:600]
    assert set(re.findall(r"PROXMOX_[A-Z_]+", said)) == wanted == set(re.findall(r"PROXMOX_[A-Z_]+", EXAMPLE.read_text()))

    # The example as the README says to use it: the cluster's CA where ca_path names it, the rest from the environment.
    with PveSim(load_cluster("gpu3"), tls=True) as sim:
        source = tmp_path / "gpu.proxmox.yml"
        source.write_text(EXAMPLE.read_text().replace(example["ca_path"], str(sim.ca_path)))
        inv = inventory_list(source, {**sim.env(), "HOME": str(tmp_path)})
    assert {"pve1", "pve2", "train-a", "infer-hook"} <= group_hosts(inv, "gpu_nodes"), inv.get("gpu_nodes")
