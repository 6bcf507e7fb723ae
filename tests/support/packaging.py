"""Helpers shared by the packaging tests."""

from __future__ import annotations

import os
import subprocess
import typing as t
from pathlib import Path

from support.ansible import ROOT, VENV


def clean_env() -> dict[str, str]:
    """This process's environment without Ansible settings: make (and the repo's ansible.cfg) put the
    checkout itself on the collections path, where ansible-galaxy would find gpuops.clean_slate installed."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}


def isolated_env(collections: Path, tmp: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """An environment where only ``collections`` provides gpuops.clean_slate."""
    cfg = tmp / "ansible.cfg"
    cfg.write_text("[defaults]\nhost_key_checking = False\nretry_files_enabled = False\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env.update(
        ANSIBLE_CONFIG=str(cfg),
        ANSIBLE_COLLECTIONS_PATH=str(collections),
        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "tests" / "support" / "callback"),
        ANSIBLE_LOCAL_TEMP=str(tmp / "ansible-tmp"),
        ANSIBLE_NOCOLOR="1",
        PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    env.update(extra or {})
    return env


def ansible(args: list[str], env: dict[str, str], cwd: Path, wrapper: t.Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*wrapper, *args], env=env, cwd=cwd, capture_output=True, text=True, check=False, timeout=300)
