"""Show that the tests issue 19 found unable to fail now fail when their subject is broken.

    python3 tools/mutations.py [NAME ...]      (from the checkout, after `make setup`)

For each entry: break the code under test in one small way (the mutation), run the one test that
guards it and expect it to fail, put the code back, and run the test again to see it pass. Prints one
line per mutation. The files are restored from the copy read before the change, never from git, and a
file with uncommitted changes is refused, so the tool cannot lose work. Not a gate: `make test` runs the
tests themselves; this answers "could that test fail?" for the ones that once could not.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = "tools/pidns-run .venv/bin/pytest -q -p no:cacheprovider -x "


@dataclass
class Mutation:
    name: str
    what: str
    edits: list[tuple[str, str, str]]  # (file, old text, new text); old must occur once
    test: str


MUTATIONS = [
    Mutation(
        "pct-exec-on-host",
        "pct_exec runs the command on the host instead of in the container",
        [("plugins/module_utils/_pct.py", 'self.pct, "exec", str(vmid), "--keep-env", "1" if keep_env else "0", "--", *inner, *argv]', "*inner, *argv]")],
        "tests/functional/test_pct_exec.py -k test_local_play_helper_reaches_the_module",
    ),
    Mutation(
        "unsafe-unmarked",
        "the inventory's make_unsafe returns API data unmarked",
        [("plugins/plugin_utils/_proxmox.py", "return _wrap_var(value) if _wrap_var is not None else value", "return value")],
        "tests/unit/plugins/plugin_utils/test__proxmox.py -k never_templated",
    ),
    Mutation(
        "fallback-cert-broken",
        "the simulator's committed fallback certificate is not a certificate",
        [("tests/sim/pvesim/tls.py", 'FALLBACK_CERT = HERE / "certs" / "pvesim-test-only.crt"', 'FALLBACK_CERT = HERE / "certs" / "pvesim-test-only.key"')],
        "tests/unit/plugins/plugin_utils/test__proxmox.py -k fallback_certificate",
    ),
    Mutation(
        "ancestors-short",
        "ancestors() stops before the namespace's init",
        [("plugins/module_utils/_proctable.py", 'if not st or st["ppid"] <= 0 or st["ppid"] in seen:', 'if not st or st["ppid"] <= 1 or st["ppid"] in seen:')],
        "tests/unit/plugins/module_utils/test__proctable.py -k test_stat_ancestry_and_kernel_threads",
    ),
    Mutation(
        "nspids-innermost",
        "nspids() keeps only the innermost namespace level",
        [("plugins/module_utils/_proctable.py", "return [int(x) for x in line.split()[1:]]", "return [int(x) for x in line.split()[-1:]]")],
        "tests/unit/plugins/module_utils/test__proctable.py -k test_namespaces_and_nspid",
    ),
    Mutation(
        "kthread-by-name",
        "is_kernel_thread() judges by name (pid 2 or a name starting with k) instead of PF_KTHREAD",
        [
            (
                "plugins/module_utils/_proctable.py",
                'return bool(st and st["flags"] & PF_KTHREAD)',
                'return bool(st and (pid == 2 or st["comm"].startswith("k")))',
            )
        ],
        "tests/unit/plugins/module_utils/test__proctable.py -k test_kernel_threads_are_recognised_by_their_flag",
    ),
    Mutation(
        "ee-requirements-unshipped",
        "meta/ee-requirements.txt declares a package but the artifact leaves the file out",
        [
            (
                "meta/ee-requirements.txt",
                "# the GPU hosts, where the modules run, not in the execution environment.\n",
                "# the GPU hosts, where the modules run, not in the execution environment.\npsutil\n",
            ),
            ("galaxy.yml", "  - changelogs/.plugin-cache.yaml\n", "  - changelogs/.plugin-cache.yaml\n  - meta/ee-requirements.txt\n"),
        ],
        "tests/packaging/test_ee.py -k test_introspect_agrees_with_meta",
    ),
    Mutation(
        "node-name-fqdn",
        "local_node_name() falls back to the fully qualified host name",
        [("plugins/module_utils/_pct.py", 'return socket.gethostname().split(".")[0]', 'return socket.getfqdn() + ".local"')],
        "tests/unit/plugins/module_utils/test__pct.py -k test_local_node_name_reads_etc_pve_local",
    ),
    # Round 2's own safety tests, the same way.
    Mutation(
        "residue-dir-socket-ignored",
        "gpu_job_residue ignores the sockets inside a candidate directory when it looks for bound sockets",
        [("plugins/module_utils/_residue/owners.py", "        elif item.tree_sockets:\n", "        elif False:\n")],
        "tests/unit/plugins/module_utils/_residue/test_owners.py -k test_a_directory_with_a_socket_a_live_process_is_bound_to_is_held",
    ),
    # Issue 26's safety tests, the same way.
    Mutation(
        "residue-main-thread-only",
        "the /proc pass reads only each process's main thread (as before issue 26: a file only another thread held was removed)",
        [("plugins/module_utils/_holders.py", "        tids = _other_tids(base, name) if threads > 1 else []\n", "        tids = []\n")],
        "tests/unit/plugins/module_utils/_residue/test_owners.py -k test_what_any_thread_holds_is_kept",
    ),
    Mutation(
        "residue-check-mode-guesses",
        "check mode skips the run's last check (as before issue 26: a file with a second name read 'would be removed')",
        [
            (
                "plugins/module_utils/_residue/remove.py",
                "        kept = decide(item)\n        if kept is not None:\n            item.verdict, item.why = kept\n",
                "        pass\n",
            )
        ],
        "tests/unit/plugins/module_utils/_residue/test_remove.py -k test_check_mode_reports_exactly_what_the_run_does",
    ),
    Mutation(
        "sim-holders-by-path",
        "the simulator's node cleanup matches mappings by path (as it did when it killed another run's workers)",
        [
            (
                "tests/sim/gpusim/procfs.py",
                "                    if (os.makedev(major, minor), int(parts[4])) in keys:\n",
                '                    if any(os.path.dirname(str(f)) + "/nvidia" in line for f in files):\n',
            )
        ],
        "tests/sim/tests/test_procfs.py",
    ),
]


def run_test(test: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(PYTEST + test, shell=True, cwd=ROOT, capture_output=True, text=True, check=False)


def last_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", *{f for m in chosen for f, _o, _n in m.edits}], cwd=ROOT, capture_output=True, text=True, check=True
    )
    if dirty.stdout.strip():
        print(f"refused: uncommitted changes in\n{dirty.stdout}", file=sys.stderr)
        return 2
    bad = 0
    for m in chosen:
        originals = {f: (ROOT / f).read_text() for f, _o, _n in m.edits}
        try:
            texts = dict(originals)
            for f, old, new in m.edits:
                if texts[f].count(old) != 1:
                    raise SystemExit(f"{m.name}: the text to change is not found once in {f}")
                texts[f] = texts[f].replace(old, new)
            for f, text in texts.items():
                (ROOT / f).write_text(text)
            mutated = run_test(m.test)
        finally:
            for f, text in originals.items():
                (ROOT / f).write_text(text)
        clean = run_test(m.test)
        caught = mutated.returncode != 0
        ok = caught and clean.returncode == 0
        bad += not ok
        after = "passes" if clean.returncode == 0 else "FAILS"
        print(f"{'ok ' if ok else 'BAD'} {m.name}: {m.what}: mutated -> {'fails' if caught else 'PASSES'} ({last_line(mutated)}); restored -> {after}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
