"""gpusim.procfs.holders: the node's cleanup finds the processes that hold *its* files, and only those."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpusim.procfs import holders

pytestmark = pytest.mark.pidns

HOLD = textwrap.dedent(
    """
    import mmap, os, sys, time
    fd = os.open(sys.argv[2], os.O_RDWR)
    if sys.argv[1] == "map":
        m = mmap.mmap(fd, 4096)
        os.close(fd)  # only /proc/PID/maps shows it now
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def start() -> Iterator:
    procs: list[subprocess.Popen[str]] = []

    def run(mode: str, path: Path) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", HOLD, mode, str(path)], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield run
    for p in procs:
        p.kill()
        p.wait()


def device_file(directory: Path) -> Path:
    directory.mkdir(parents=True)
    f = directory / "nvidia0"
    f.write_bytes(b"\0" * 4096)
    return f


@pytest.mark.parametrize("mode", ["fd", "map"])
def test_a_file_of_the_same_name_elsewhere_is_not_the_nodes(start, mode: str) -> None:
    """Another node's nvidia0, at a path that even contains this node's directory (as another test run's
    /tmp/.../dev/nvidia0 contains "/dev/nvidia", seen from the host gate), is never taken for this node's."""
    top = Path(tempfile.mkdtemp(prefix="procfs-"))
    mine = device_file(top / "a")
    theirs = device_file(Path(f"{top}/b{top}/a"))  # .../b/<top>/a/nvidia0: contains ".../a/nvidia"
    other = start(mode, theirs)
    own = start(mode, mine)
    assert holders([mine]) == {own.pid}
    assert holders([theirs]) == {other.pid}
    assert holders([]) == set()
