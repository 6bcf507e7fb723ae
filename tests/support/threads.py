"""A process one of whose threads, not the main one, holds a file, made the way a real program makes one: for the
residue tests (unit and functional), which must see what every thread holds.

Run ``python3 -c THREAD_HOLDER MODE PATH``; it prints ``ready`` once the hold is in place:

* ``files``: a thread with a file table of its own (``unshare(CLONE_FILES)`` through libc) opens PATH;
* ``files-bind``: such a thread binds a unix socket at PATH;
* ``fs``: a thread with a working directory of its own (``unshare(CLONE_FS)``) changes into PATH;
* ``exit-fd``, ``exit-map``: a thread opens (maps) PATH, then the main thread exits through the raw exit system
  call, which ends one thread: the process lives on in the other, its main thread a zombie (``State: Z``,
  ``Threads: 2``).
"""

from __future__ import annotations

import textwrap

THREAD_HOLDER = textwrap.dedent(
    """
    import ctypes, mmap, os, platform, socket, sys, threading, time
    mode, path = sys.argv[1], sys.argv[2]
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_FILES, CLONE_FS = 0x400, 0x200
    SYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]
    keep, set_up = [], threading.Event()

    def holder():
        if mode.startswith("files"):
            assert libc.unshare(CLONE_FILES) == 0, ctypes.get_errno()
        if mode == "fs":
            assert libc.unshare(CLONE_FS) == 0, ctypes.get_errno()
            os.chdir(path)
        elif mode == "files-bind":
            s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); keep.append(s)
        else:
            fd = os.open(path, os.O_RDWR)
            if mode == "exit-map":
                keep.append(mmap.mmap(fd, 4096)); os.close(fd)
            else:
                keep.append(fd)
        set_up.set()
        if mode.startswith("exit"):
            # Ready once the main thread is gone: the process's state is then Z, with this thread running.
            while open("/proc/self/stat").read().rpartition(")")[2].split()[0] != "Z":
                time.sleep(0.01)
        print("ready", flush=True)
        time.sleep(60)

    threading.Thread(target=holder).start()
    set_up.wait()
    if mode.startswith("exit"):
        libc.syscall(SYS_EXIT, 0)
    time.sleep(60)
    """
)
