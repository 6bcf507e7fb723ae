"""Running gpuops.clean_slate modules through real Ansible on a simulated node."""

from __future__ import annotations

import os
import time
import typing as t

from support.ansible import AnsibleRun, run_module

SIM_BIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sim", "bin")


class ModuleRunner:
    """Runs gpuops.clean_slate modules on localhost inside a sandbox, on a node."""

    def __init__(self, node: t.Any, sandbox: t.Any) -> None:
        self.node = node
        self.sandbox = sandbox
        self.last_run: AnsibleRun | None = None

    def __call__(
        self,
        module: str,
        args: dict[str, t.Any] | None = None,
        check: bool = False,
        diff: bool = False,
        env: dict[str, str] | None = None,
        library: bool = True,
        interpreter: str | None = None,
    ) -> dict[str, t.Any]:
        args = dict(args or {})
        if module in ("gpu_mem_verify", "gpu_procs_kill"):
            # The simulated node's device files stand in for /dev.
            args.setdefault("device_dir", str(self.node.dev_dir))
        e = self.node.env(include_library=library)
        e["PATH"] = f"{SIM_BIN}:{self.node.bin_dir}:{os.environ.get('PATH', '')}"
        e.update(env or {})
        wrapper = self.sandbox.nsenter_prefix() if self.sandbox is not None else ()
        extra: dict[str, t.Any] = {"interpreter": interpreter} if interpreter else {}
        if self.sandbox is not None and getattr(self.sandbox, "root_uid", None) is not None:
            extra["owner"] = self.sandbox.root_uid  # an unprivileged container's root runs Ansible
        result, run = run_module(f"gpuops.clean_slate.{module}", args, env=e, check=check, diff=diff, wrapper=wrapper, **extra)
        self.last_run = run
        result["_run"] = run
        return result


def assert_no_traceback(result: dict[str, t.Any]) -> None:
    """A fault must come back as a diagnosis, never as a Python traceback."""
    text = " ".join(str(result.get(k, "")) for k in ("msg", "module_stderr", "module_stdout", "exception"))
    assert "Traceback" not in text, text
    assert "MODULE FAILURE" not in text, text


def wait_for(condition: t.Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``condition`` every 10 ms until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def sockets_under(tmp: t.Any) -> list[str]:
    """gpu_job_residue's default socket globs for /tmp, moved under ``tmp`` (a test's stand-in for /tmp)."""
    from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import walk

    return [g.replace("/tmp/", f"{tmp}/", 1) for g in walk.DEFAULT_SOCKETS if g.startswith("/tmp/")]
