"""The modules' virtual environment on the host where they run (tasks/dependencies.yml runs it with that host's python3 -I).

    venv.py VENV probe PACKAGE...   what there is: {"python", "version", "ensurepip", "venv": ok|broken|absent, "missing"}
    venv.py VENV check              the same, "changed" when the environment would be made (check mode)
    venv.py VENV create             makes the environment when it is not ok (again, with --clear, when it is broken)
    venv.py VENV pip ARGS...        the environment's pip install ARGS...

"missing": the PACKAGEs (pip names) the environment's Python cannot import. create and pip hold a lock beside the
environment: the node and the containers cleaned through it share one environment and may all install at once.
"broken": its Python does not run, as after a release upgrade removed the Python it was made from (Debian 12 to 13 is
Python 3.11 to 3.13). It runs on the targets' Pythons (3.6 and later: nothing newer is used).
"""

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

#: The import name of each dependency the modules need, by its pip name.
IMPORTS = {"nvidia-ml-py": "pynvml", "psutil": "psutil", "jmespath": "jmespath"}


def state(python):
    """ok, broken (its Python does not run) or absent."""
    if not os.path.lexists(python):
        return "absent"
    try:
        with open(os.devnull, "r+b") as null:
            return "ok" if subprocess.call([python, "-c", ""], stdin=null, stdout=null, stderr=null) == 0 else "broken"
    except OSError:
        return "broken"


def missing(python, packages):
    """The packages the environment's Python cannot import (all of them when it does not run)."""
    out = []
    with open(os.devnull, "r+b") as null:
        for package in packages:
            name = IMPORTS.get(package, package.replace("-", "_"))
            try:
                found = subprocess.call([python, "-c", "import " + name], stdin=null, stdout=null, stderr=null) == 0
            except OSError:
                found = False
            if not found:
                out.append(package)
    return out


def lock(venv):
    """An exclusive lock beside the environment, held until the process ends."""
    import fcntl

    parent = os.path.dirname(venv)
    if not os.path.isdir(parent):
        os.makedirs(parent, 0o755)
    held = open(venv + ".lock", "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    return held


def create(venv, python, found):
    """Make the environment (--system-site-packages, so that Debian's python3-psutil and python3-jmespath count)."""
    new = not os.path.lexists(venv)
    cmd = [sys.executable, "-m", "venv", "--system-site-packages"] + (["--clear"] if found == "broken" else []) + [venv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    said = " ".join(proc.communicate()[0].decode("utf-8", "replace").split())
    if proc.returncode != 0:
        if new:  # what it made, without pip (no ensurepip), would pass for a working environment next time
            shutil.rmtree(venv, ignore_errors=True)
        sys.stderr.write("%s failed (exit status %d): %s" % (" ".join(cmd), proc.returncode, said))
        sys.exit(1)
    return state(python)


def main():
    venv, action, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    python = os.path.join(venv, "bin", "python")
    if action == "pip":
        held = lock(venv)
        sys.stdout.flush()
        code = subprocess.call([python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"] + args)
        held.close()
        sys.exit(code)
    found = state(python)
    out = {
        "python": sys.executable,
        "version": platform.python_version(),
        "venv": found,
        "changed": action != "probe" and found != "ok",
        "ensurepip": importlib.util.find_spec("ensurepip") is not None,
        "missing": missing(python, args) if action == "probe" and found == "ok" else list(args),
    }
    if action == "create" and found != "ok":
        held = lock(venv)
        found = state(python)
        if found == "ok":
            out["changed"] = False
        else:
            found = create(venv, python, found)
        out["venv"] = found
        held.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
