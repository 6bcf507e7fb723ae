"""Init (pid 1) of a gpusim sandbox: reaps every orphan, as a container's init must.

Run as ``python -I -S _sbinit.py READY_FD`` by ``unshare --pid --fork --mount-proc``.
Orphans in a PID namespace are re-parented to its init; without reaping they
would stay zombies. As pid 1 of a namespace it ignores signals it has no
handler for, so only SIGKILL from outside (Sandbox.stop) ends it, and with it
every process in the namespace.
"""

import os
import signal
import sys


def main() -> None:
    ready = int(sys.argv[1])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    os.write(ready, b"ready\n")
    os.close(ready)
    while True:
        signal.sigwait({signal.SIGCHLD})
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


if __name__ == "__main__":
    main()
