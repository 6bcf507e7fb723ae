#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_job_residue
short_description: Remove what dead GPU jobs left behind, and check the ports the next server needs
version_added: 0.2.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Finds the residue a killed SGLang, vLLM, NCCL, torch or Ray job leaves on a host besides GPU memory, with absolute
    path globs per kind. O(shm) are shared memory segments and POSIX semaphores (regular files), O(sockets) are ZMQ
    C(ipc://) and other unix socket files (socket files, and the 0-byte regular file a socket path is before it is
    bound), O(locks) are lock files of JIT compile caches (regular files, searched with C(**) through the cache
    directories), O(dirs) are per-run directories removed as a whole (O(dirs_holding) names one by what it holds),
    O(files) are other regular files (a torch FileStore, a daemon's marker), O(caches) are cached answers.
  - Removes an item only when it is provably orphaned. No thread of any live process has it (or, for a directory,
    anything in it) open or mapped (C(/proc/*/fd), C(/proc/*/maps)), holds a lock on it (C(/proc/locks), flock, POSIX
    and OFD locks), has a socket bound to it (the unix socket table of every network namespace), or works inside it
    (its working directory or root; for a lock file, inside its directory, as torch's ninja works in the directory of
    its C(lock) baton). Every thread counts, not only a process's main one, as C(/proc/PID/task/TID) shows it; a thread
    may have a file table, a working directory or a network namespace of its own, and a process whose main thread has
    exited while others run is alive. Items are matched by device and inode, so the same path in another mount
    namespace is never confused with it. Anything held is kept and reported with its holders (pid, name, how, and
    whether the holder is a protected daemon).
  - Unheld is not yet orphaned. A name that carries its creator's pid (SGLang's C(sgl_shm_<kind>_<pid>_<rand>) and
    C(multi_tokenizer_args_<pid>), torch's C(torch_<pid>_<rand>_<n>), the CUDA driver's C(cuda.shm.0.<pid in
    hex>.<n>)) is kept while that process lives and started no later than the file last changed (a newer process
    with the same pid is not its creator); the pid is looked up in the scope's own PID namespace. Any item that
    changed (mtime or ctime; for a directory anything in it) less than O(min_age) seconds ago is kept, since a
    server starting right now has a segment between C(shm_open) and C(mmap) that nothing holds yet, unless its name
    carries its creator's pid and that creator is known to be gone (the process between C(shm_open) and C(mmap)
    would be that creator). A file a server opens only while it uses it (O(keep_while)) is kept while a process of
    that server runs in its scope. All are reported in RV(kept) with why; check mode applies the same rules.
  - Run by M(gpuops.clean_slate.clean_slate_node) right after its kill, an item whose holders (read right before the
    kill) were all ended by that kill is orphaned at once, whatever its age (RV(removed[].released_by)), since no
    server starting now holds it. In check mode, where nothing is ended, such an item is still held and listed in
    RV(held) as before, with C(released_by) and why (the run removes it right after its kill), and counted in
    C(summary.released).
  - Paths are walked one component at a time from directory file descriptors without following any symbolic link, so
    no pattern leaves its root; right before each unlink the item is checked again through its directory and must
    still be the file that was judged, with one name only (a file with another hard link is left alone, since a
    process may hold it under the other name); a directory must hold nothing that was not judged.
  - A name that is not valid UTF-8 (anyone can create one in C(/dev/shm)) is reported with each such byte as
    C(\xNN), and its record carries C(path_escaped=true); process names and command lines follow the same rule.
  - With O(containers), it works inside those LXC containers only, through the root of each container's init
    (C(/proc/<init>/root)); the host's own files are not looked at. Holders are looked for among all processes the
    module can see, which on a hypervisor includes every container's.
  - For each of O(ports) it says whether the next server can bind it, from C(/proc/net/tcp) and C(tcp6) of the host
    or of each container's network namespace, with the owner of each live socket. It reports zombies and the parents
    that do not reap them. It signals no process.
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
  - gpuops.clean_slate._containers
attributes:
  check_mode:
    support: full
    details: Lists what would be removed and the bytes it would free, and removes nothing. It applies the run's last check
      to each item (still the file judged, one name, a directory unchanged), so it reports exactly what a run would do.
  diff_mode:
    support: full
    details: The diff lists the orphaned items before, and those still there after.
  idempotent:
    support: full
    details: A second run finds nothing orphaned to remove and reports no change.
options:
  shm:
    description:
      - Absolute path globs of shared memory residue. Only regular files are considered.
      - The defaults match NCCL segments (C(nccl-XXXXXX)), vLLM's (C(vllm_offload_*.mmap), C(vllm-*), the multimodal
        object store C(VLLM_OBJECT_STORAGE_SHM_BUFFER*)), torch's (C(torch_<pid>_<rand>_<n>)), Python's
        C(multiprocessing.shared_memory) (C(psm_*), vLLM's queues) and multiprocessing semaphores (C(sem.mp-*)),
        SGLang's (C(sgl_shm_<kind>_<pid>_<rand>), C(sglang_loads_*.shm), C(multi_tokenizer_args_<pid>)) and the CUDA
        driver's IPC segments (C(cuda.shm.*)). The user guide names the source that makes each.
    type: list
    elements: str
    default:
      - /dev/shm/nccl-*
      - /dev/shm/vllm*
      - /dev/shm/VLLM_OBJECT_STORAGE_SHM_BUFFER*
      - /dev/shm/torch_*
      - /dev/shm/psm_*
      - /dev/shm/sem.mp-*
      - /dev/shm/sgl_shm_*
      - /dev/shm/sglang_loads_*.shm
      - /dev/shm/multi_tokenizer_args_*
      - /dev/shm/cuda.shm.*
      - /dev/shm/sem.loky-*
  sockets:
    description:
      - Absolute path globs of unix socket files. Only socket files are considered, so a glob may be broad, and the
        0-byte regular file a socket path is before it is bound (SGLang's C(NamedTemporaryFile(delete=False).name),
        which ZMQ's bind replaces with the socket; a crash between the two leaves it).
      - The defaults match SGLang's C(ipc://) names (C(/tmp/tmpXXXXXXXX)), vLLM's (a UUID, optionally after a
        description), and Ray's session sockets.
    type: list
    elements: str
    default:
      - /tmp/tmp????????
      - /tmp/????????-????-????-????-????????????
      - /tmp/*-????????-????-????-????-????????????
      - /tmp/ray/session_*/sockets/*
      - /tmp/torch-shm-dir-*/manager.sock
  locks:
    description:
      - Absolute path globs of lock files of JIT compile caches; C(**) matches any number of directories (at most 16).
        Only regular files are considered.
      - A lock file that no process holds blocks the next start when the lock is the file's existence (torch
        cpp_extension's C(lock) baton); a C(filelock) file nobody holds is harmless. Both are reported as orphaned;
        they are removed only when O(remove) contains V(locks).
    type: list
    elements: str
    default:
      - /root/.cache/flashinfer/**/*.lock
      - /home/*/.cache/flashinfer/**/*.lock
      - /root/.cache/torch_extensions/**/lock
      - /home/*/.cache/torch_extensions/**/lock
      - /root/.triton/cache/**/*.lock
      - /home/*/.triton/cache/**/*.lock
      - /root/.cache/vllm/**/*.lock
      - /home/*/.cache/vllm/**/*.lock
      - /tmp/torchinductor_*/locks/*.lock
      - /tmp/????????????????????????????????????????????????????????????????*.lock
  dirs:
    description:
      - Absolute path globs of per-run directories, removed with everything in them when nothing in them is held
        and O(remove) contains V(dirs). The last component must contain literal characters, and C(**) is not
        allowed.
      - The defaults match torchelastic's C(/tmp/torchelastic_*) (which also holds that run's logs) and
        torch_shm_manager's C(/tmp/torch-shm-dir-*) (whose C(manager.sock) O(sockets) matches).
    type: list
    elements: str
    default: [/tmp/torchelastic_*, /tmp/torch-shm-dir-*]
  dirs_holding:
    description:
      - Directories recognised by what they hold, as O(dirs) - a directory matching O(dirs_holding[].dir) that holds at
        least one entry and only regular files matching O(dirs_holding[].files). A broad C(dir) (C(/tmp/tmp????????),
        every C(mkdtemp)) is then safe - the Prometheus multiprocess directory holds only C(<type>_<pid>.db).
    type: list
    elements: dict
    default: []
    suboptions:
      dir:
        description: Absolute path glob of the directory, as in O(dirs).
        type: str
        required: true
      files:
        description: A file name glob (no C(/)) every entry of the directory matches.
        type: str
        required: true
  files:
    description:
      - Absolute path globs of other regular files a job leaves (a torch FileStore, a daemon's marker). Only regular
        files are considered. The role's server profiles name them; the module has none by default.
    type: list
    elements: str
    default: []
  caches:
    description:
      - Absolute path globs of cached answers (vLLM's P2P test, C(gpu_p2p_access_cache_for_*.json)), reported, and removed
        only when O(remove) contains V(caches). Only regular files are considered.
    type: list
    elements: str
    default: []
  keep_while:
    description:
      - Files a server opens only while it uses them (a torch FileStore is opened per operation, a daemon's marker is
        written and closed), so that no holder does not prove them unused - an item matching one of
        O(keep_while[].paths) is kept while a process matching one of O(keep_while[].patterns) runs in its scope (on the
        host, anywhere).
    type: list
    elements: dict
    default: []
    suboptions:
      server:
        description: The server's name, for the reasons.
        type: str
        required: true
      paths:
        description: Absolute path globs (under O(roots)) of the files.
        type: list
        elements: str
        required: true
      patterns:
        description: Regular expressions searched in command lines, names and executables, as in O(patterns).
        type: list
        elements: str
        required: true
  remove:
    description:
      - The kinds of orphaned items to remove. Orphaned items of other kinds are reported as RV(stale).
      - Lock files, caches and directories are not removed by default. A live compile's lock baton, a cached answer and
        a live torchelastic agent's run directory are not held open all the time, so no holder does not prove that
        their job is dead; add them when no job runs on the host. A lock then goes only when nothing holds it (open,
        flock, POSIX or OFD lock, a process working in its directory), its named creator (if its name has one) is dead,
        and it is older than O(min_age).
    type: list
    elements: str
    choices: [shm, sockets, locks, dirs, files, caches]
    default: [shm, sockets, files]
  min_age:
    description:
      - Seconds an unheld item must have gone unchanged (its mtime and ctime; for a directory, anything in it)
        before it may be removed; a younger one is kept and listed in RV(kept), unless its name carries its creator's
        pid and that creator is known to be gone. From 0 to 86400 (one day); a negative or non-finite value is refused
        with RV(reason=bad_arguments).
      - The default, a minute, is four orders of magnitude above the gap between a segment's creation and its first
        holder in a starting server (within a millisecond for every name a torch server tree made on an H200), and
        below the age of what a crashed server made when it started, so a run right after a crash removes it.
    type: float
    default: 60
  roots:
    description:
      - The directories residue is looked for in. Every pattern of O(shm), O(sockets), O(locks) and O(dirs) must lie
        under one of them, or the module refuses with RV(reason=bad_arguments) before anything is looked at.
      - Add a site's cache root deliberately (for example C(/sgl-workspace) for AITER's batons). A root must be an
        absolute directory without globs, and never C(/) or a system directory (C(/bin), C(/boot), C(/dev) but
        C(/dev/shm), C(/etc), C(/lib*), C(/proc), C(/run), C(/sbin), C(/sys), C(/usr), C(/var) but C(/var/tmp)).
    type: list
    elements: str
    default: [/dev/shm, /tmp, /var/tmp, /root, /home]
  users:
    description:
      - Only consider items owned by these users (names or uids). Empty means any owner.
      - A user name or uid that does not exist on the host is refused (a uid exists when the host's passwd or
        C(/etc/subuid) has it, or a process runs as it).
      - With O(containers), names are looked up in the container's C(/etc/passwd) and uids are the container's,
        mapped to the host's through the container's user namespace; one the container does not know is refused.
        The same rule as M(gpuops.clean_slate.gpu_procs_kill)'s O(gpuops.clean_slate.gpu_procs_kill#module:users).
    type: list
    elements: str
    default: []
  containers:
    description:
      - On a Proxmox VE hypervisor, work inside these LXC containers (by vmid, 100 to 999999999) instead of on the
        host, through the root and the network namespace of each container's init (from C(pct status <vmid> --verbose)).
    type: list
    elements: int
    default: []
  ports:
    description:
      - TCP ports the next server needs. Each is reported as V(free), V(listening) (a live listener, so the next
        bind fails), V(connected) (live connections of some process still use it) or V(time_wait) (only sockets the
        kernel keeps after their owner closed them).
    type: list
    elements: int
    default: []
  server_ports:
    description:
      - Ports a server's next start binds (the role's server profiles - SGLang's 30000 and its data-parallel plan, vLLM's
        8000, 29500, 29501, 29550), reported as O(ports) are, with the server and the port's name. Both servers bind
        with C(SO_REUSEADDR), so only a listener stops them, and one fails the module (as O(fail_on) says for
        V(listening)) only when it is a process of the server (it matches O(patterns)) - one that survived, or that
        shares the port with C(SO_REUSEPORT) (vLLM with several API servers) and would answer the new server's
        requests. Another service listening there is reported, not failed. A port also in O(ports) is checked as
        O(ports) says.
    type: list
    elements: dict
    default: []
    suboptions:
      port:
        description: The TCP port, 1-65535.
        type: int
        required: true
      server:
        description: The server whose port it is.
        type: str
        required: true
      name:
        description: What binds it (V(http), V(nccl), ...).
        type: str
  time_wait_timeout:
    description:
      - Seconds to wait for ports that are only in V(time_wait) to become free. V(0) reports them at once, with the
        time left.
      - From 0 to 86400 (one day); a number that is not finite is refused with RV(reason=bad_arguments).
    type: float
    default: 0
  patterns:
    description:
      - Regular expressions (as for M(gpuops.clean_slate.gpu_procs_kill)) that name the processes a kill phase ends. A
        port owner that matches one, is in scope and is not protected is flagged C(kill_target) in RV(ports[].owners).
    type: list
    elements: str
    default: []
  protect:
    description:
      - More names of protected daemons (shell-style globs), added to the default list of
        M(gpuops.clean_slate.gpu_procs_kill). Holders and port owners that match are flagged as protected; this module
        signals no process either way.
    type: list
    elements: str
    default: []
  fail_on:
    description:
      - Port states that make the module fail, because the next server start would.
    type: list
    elements: str
    choices: [listening, connected, time_wait]
    default: [listening]
  list_limit:
    description:
      - The most entries each list of the result holds, from 0 to 1000000; the counts in RV(summary) always cover
        everything.
    type: int
    default: 200
requirements:
  - Root on the target, so that every process's files can be inspected; otherwise nothing is removed.
notes:
  - A process that opens an orphaned file after the scan and before the unlink, without writing to it, is not seen;
    the window is the few milliseconds between the two.
  - Inside a container, processes outside it (on its host) cannot be seen; run the module on the hypervisor with
    O(containers) to see them all.
seealso:
  - module: gpuops.clean_slate.gpu_procs_kill
  - module: gpuops.clean_slate.gpu_mem_verify
"""

EXAMPLES = r"""
---
- name: Remove the residue of dead inference jobs, and check port 30000
  gpuops.clean_slate.gpu_job_residue:
    ports: [30000]

- name: Show what would go, and the bytes it would free
  gpuops.clean_slate.gpu_job_residue:
  check_mode: true
  register: residue

- name: Also remove stale JIT compile locks and torchelastic directories, and wait up to 60 s for TIME_WAIT on 8000
  gpuops.clean_slate.gpu_job_residue:
    remove: [shm, sockets, locks, dirs]
    ports: [8000]
    time_wait_timeout: 60
    fail_on: [listening, time_wait]

- name: Only the inference user's segments, with a site-specific AITER lock directory
  gpuops.clean_slate.gpu_job_residue:
    users: [inference]
    locks:
      - /sgl-workspace/aiter/aiter/jit/build/lock_*
    roots: [/dev/shm, /tmp, /var/tmp, /root, /home, /sgl-workspace]
    remove: [shm, sockets, locks]

- name: From a Proxmox hypervisor, inside LXC container 129 only
  gpuops.clean_slate.gpu_job_residue:
    containers: [129]
    ports: [30000]
    patterns: ['^sglang::', 'sglang\.launch_server']
    pct_path: /usr/sbin/pct

- name: Check vLLM's ports, and keep its FileStore while a vLLM process runs
  gpuops.clean_slate.gpu_job_residue:
    files: ['/tmp/vllm_dist_????????????????????????????????']
    keep_while:
      - server: vllm
        paths: ['/tmp/vllm_dist_????????????????????????????????']
        patterns: ['^VLLM::', '(^|/)vllm serve( |$)']
    server_ports:
      - {port: 8000, server: vllm, name: http}
      - {port: 29500, server: vllm, name: dp_master}
    patterns: ['^VLLM::', '(^|/)vllm serve( |$)']

- name: Extra residue locations and a protected exporter; nothing younger than ten minutes goes
  gpuops.clean_slate.gpu_job_residue:
    shm: [/dev/shm/nccl-*, /dev/shm/myjob-*]
    sockets: [/tmp/myjob/*.sock]
    dirs: [/scratch/tmp/torchelastic_*]
    roots: [/dev/shm, /tmp, /scratch/tmp]
    min_age: 600
    protect: [my-gpu-exporter]
    list_limit: 50
"""

RETURN = r"""
msg:
  description: One line for people.
  returned: always
  type: str
  sample: 12 stale segments (3.1 GiB) removed, port 30000 free
summary:
  description: Counts over everything found (not limited by O(list_limit)), the state of every port (those of
    O(server_ports) under C(server_ports)), the zombies, a
    few paths of each list, and RV(msg).
  returned: always
  type: dict
  sample:
    removed: 12
    removed_bytes: 3328599654
    held: 1
    kept: 1
    stale: 0
    ignored: 0
    errors: 0
    kinds: {"shm": {"removed": 12, "bytes": 3328599654, "held": 1, "kept": 1, "stale": 0}}
    ports: {"30000": free}
    server_ports: {"8000": free, "29500": free}
    zombies: 0
    non_reaping: []
    paths: {"removed": ["/dev/shm/nccl-a1B2c3"], "held": ["/dev/shm/nccl-Zz9y8x (812 nv-hostengine)"],
            "kept": ["/dev/shm/torch_733_2399602362_1 (its creator, PID 733 (sglang::schedul), is alive; kept while it lives)"], "stale": []}
    msg: 12 stale segments (3.1 GiB) removed, port 30000 free
removed:
  description: The orphaned items removed (in check mode, those that would be).
  returned: always
  type: list
  elements: dict
  contains:
    path:
      description: The path as the host or the container sees it.
      type: str
      sample: /dev/shm/nccl-a1B2c3
    kind:
      description: V(shm), V(sockets), V(locks), V(dirs), V(files) or V(caches).
      type: str
      sample: shm
    released_by:
      description: The pids that held it right before the umbrella's kill, all ended by it (orphaned at once, whatever
        its age; M(gpuops.clean_slate.clean_slate_node) only).
      type: list
      elements: int
      returned: when this run's kill released it
      sample: [4242, 4243]
    bytes:
      description: Bytes it occupies (for a directory, everything in it).
      type: int
      sample: 277383305
    uid:
      description: Owner, as the host sees it.
      type: int
      sample: 0
    container:
      description: The container it is in, with O(containers); null otherwise.
      type: int
      sample: 129
    path_escaped:
      description: Present (V(true)) when the name is not valid UTF-8 and C(path) shows each such byte as C(\xNN).
      type: bool
      returned: when the name is not valid UTF-8
      sample: true
held:
  description: Items kept because a live process holds them, with up to 10 holders each (C(pid), C(name), C(cmdline),
    C(how) - V(fd), V(mmap), V(lock), V(bound), V(cwd) or V(root), for a lock file also V(cwd in its directory) -
    C(protected), C(container)). In check mode run by M(gpuops.clean_slate.clean_slate_node), one held only by processes
    its kill would end also has C(released_by) (their pids) and C(why).
  returned: always
  type: list
  elements: dict
  sample:
    - path: /dev/shm/nccl-Zz9y8x
      kind: shm
      bytes: 4198400
      uid: 0
      container: null
      holders: [{"pid": 812, "name": nv-hostengine, "how": [mmap], "protected": true, "container": null}]
kept:
  description: Items nothing holds that are kept, with why - their named creator lives (C(creator) gives its C(pid)
    and C(name)), a process of their server runs (O(keep_while)), or they changed less than O(min_age) seconds ago.
  returned: always
  type: list
  elements: dict
  sample:
    - path: /dev/shm/torch_733_2399602362_1
      kind: shm
      bytes: 4096
      uid: 0
      container: null
      creator: {"pid": 733, "name": "sglang::schedul"}
      why: its creator, PID 733 (sglang::schedul), is alive; kept while it lives
stale:
  description: Orphaned items of a kind O(remove) does not include (stale JIT locks by default), kept.
  returned: always
  type: list
  elements: dict
  sample: [{"path": /root/.cache/torch_extensions/py311_cu124/fused_adam/lock, "kind": locks, "bytes": 0, "uid": 0}]
ignored:
  description: Items not judged or not removed, with why (another owner than O(users), changed since judged, more than
    one hard link, gone).
  returned: always
  type: list
  elements: dict
  sample: []
errors:
  description: Orphaned items whose removal failed, with why.
  returned: always
  type: list
  elements: dict
  sample: []
truncated:
  description: Whether a list was cut at O(list_limit).
  returned: always
  type: bool
  sample: false
ports:
  description: One entry per port (and per container).
  returned: always
  type: list
  elements: dict
  contains:
    port:
      description: The port.
      type: int
      sample: 30000
    state:
      description: V(free), V(listening), V(connected) or V(time_wait).
      type: str
      sample: listening
    container:
      description: The container whose network namespace was read, or null.
      type: int
      sample: 129
    owners:
      description: Processes with a live socket on the port (C(pid), C(name), C(cmdline), C(address), C(listening),
        C(protected), C(kill_target) - it matches O(patterns), is in scope and is not protected).
      type: list
      elements: dict
      sample: [{"pid": 4242, "name": "sglang::schedul", "address": "127.0.0.1:30000", "listening": true, "kill_target": true}]
    connections:
      description: Live sockets other than listeners on the port.
      type: int
      sample: 0
    time_wait:
      description: Sockets the kernel keeps after their owner closed them (TIME_WAIT and the like).
      type: int
      sample: 3
    remaining_s:
      description: For V(time_wait), the longest time left on their timers, in seconds.
      type: float
      sample: 42.5
    waited_s:
      description: Seconds spent waiting for TIME_WAIT to pass (O(time_wait_timeout)).
      type: float
      sample: 0.0
    server:
      description: For a port of O(server_ports), its server.
      type: str
      returned: for a port of O(server_ports)
      sample: vllm
    name:
      description: For a port of O(server_ports), what binds it.
      type: str
      returned: for a port of O(server_ports)
      sample: http
zombies:
  description: Zombie processes in scope (C(pid), C(name), C(ppid), C(container)).
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 4301, "name": python3, "ppid": 1, "container": 129}]
non_reaping:
  description: Parents of zombies (C(pid), C(name), C(init) - PID 1 of its namespace, C(container), C(zombies), C(why)).
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 8123, "name": "init", "init": true, "container": 129, "zombies": 3,
            "why": "PID 1 of container 129 (init) does not reap its children: 3 zombie(s)"}]
processes:
  description: Processes inspected.
  returned: always
  type: int
  sample: 412
notes:
  description: Caveats (paths that are symbolic links, directories too big to judge, processes that could not be inspected).
  returned: always
  type: list
  elements: str
  sample: []
reason:
  description:
    - Why the module failed - V(port_in_use), V(port_connected), V(port_time_wait), V(remove_failed),
      V(scan_incomplete), V(bad_arguments), V(not_running), V(no_such_container) or V(pct_failed) (resolving
      O(containers)), or V(internal_error).
    - The failure shape all the collection's modules share (RV(reason), RV(msg), details); the user guide lists every reason.
  returned: failure
  type: str
  sample: port_in_use
elapsed_s:
  description: Seconds the module took.
  returned: always
  type: float
  sample: 0.12
"""

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module, _pct
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module as residue


def main() -> None:
    module = _module.Module(
        argument_spec={**residue.argument_spec(), **_pct.SCOPE_OPTIONS},
        supports_check_mode=True,
    ).ready()
    run = residue.ModuleRun(_pct.scopes_of(module))
    _module.finish(module, run, "gpu_job_residue", details=run.details)


if __name__ == "__main__":
    main()
