"""PID 1 of a lab host or container: reaps every orphan, as an init must.

Started by the lab as ``unshare --pid --fork --mount-proc --kill-child python3 -I -S pid1.py FD``.
It writes ``ready`` to FD, a unix socket whose reader has SO_PASSCRED set, so the kernel tells
the lab this process's pid in the lab's own PID namespace. Then it waits for SIGCHLD forever
and reaps. As pid 1 of its namespace it ignores every signal it has no handler for, so only
SIGKILL from an outer namespace ends it, and with it everything in the namespace (a container
stopping). Standard library only, any Python 3.
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
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


if __name__ == "__main__":
    main()
