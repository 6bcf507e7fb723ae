"""Init (pid 1) of a gpusim sandbox: reaps every orphan, as a container's init must.

Run as ``python -I -S _sbinit.py READY_FD [EXIT_LOG]`` by ``unshare --pid --fork --mount-proc``
(the multi-host lab uses it as the init of its hosts and containers too).
Orphans in a PID namespace are re-parented to its init; without reaping they
would stay zombies. As pid 1 of a namespace it ignores signals it has no
handler for, so only SIGKILL from outside (Sandbox.stop) ends it, and with it
every process in the namespace. Each reaped child's "<pid> <exit code>" is
appended to EXIT_LOG, which is how Worker.wait() learns the status of workers
that were re-parented to this init.
"""

import os
import signal
import sys


def main() -> None:
    ready = int(sys.argv[1])
    log = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644) if len(sys.argv) > 2 else None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    os.write(ready, b"ready\n")
    os.close(ready)
    while True:
        signal.sigwait({signal.SIGCHLD})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if log is not None:
                os.write(log, f"{pid} {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    main()
