"""gpu_job_residue with the role's server profiles (roles/clean_slate/profiles/), on what SGLang and vLLM leave besides
their queues (round4-facts §3), each made the way the server's code makes it (gpusim's ``server-files`` job), and on
the ports their next starts bind (§4): one job SIGKILLed beside one alive, in one module run.

Every row is handled under the provably-orphaned rules: what nothing holds goes (a FileStore only once no vLLM process
runs, a loky semaphore or a Prometheus file once its named creator is dead), what is held stays, batons, caches
and directories are reported unless asked; a directory is the Prometheus one only when it holds nothing but
``<type>_<pid>.db``. A port listened on by a surviving vLLM API server sharing it with SO_REUSEPORT fails the run;
another service on a server's port is reported, not failed."""

from __future__ import annotations

import os
import tempfile
import typing as t
from pathlib import Path

from gpusim.residue import spawn
from support.ansible import ROOT

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import walk
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles

PROFILES = _profiles.resolve(["sglang", "vllm"], str(ROOT / "roles" / "clean_slate"))


def moved(glob: str, work: str) -> str | None:
    """A profile glob moved under the test's stand-ins: /tmp/ is each job's directory, ~/.cache its cache."""
    for real, stand_in in (("/tmp/", f"{work}/*/"), ("/root/.cache/", f"{work}/*/cache/")):
        if glob.startswith(real):
            return glob.replace(real, stand_in, 1)
    return None if glob.startswith("/home/") else glob


def residue_args(work: str, uds: list[str], ports: list[dict[str, t.Any]]) -> dict[str, t.Any]:
    args: dict[str, t.Any] = {kind: [g for g in (moved(x, work) for x in PROFILES[kind]) if g] for kind in walk.KINDS}
    args["sockets"] += uds  # vLLM's --uds PATH is the user's: given with the role's clean_slate_residue_sockets
    args["dirs_holding"] = [{"dir": moved(e["dir"], work), "files": e["files"]} for e in PROFILES["dirs_holding"]]
    args["keep_while"] = [{**e, "paths": [moved(p, work) for p in e["paths"]]} for e in PROFILES["keep_while"]]
    args.update(server_ports=ports, patterns=PROFILES["patterns"], min_age=0, list_limit=1000)
    return args


def test_every_server_residue_row_and_port_is_judged_by_the_orphan_rules(mod, shm_sandbox, stand_in_tmp: Path) -> None:
    sandbox, work = shm_sandbox, str(stand_in_tmp)
    dirs = {name: stand_in_tmp / name for name in ("dead", "live")}
    for d in dirs.values():
        (d / "cache").mkdir(parents=True)
    # A job killed mid-run, and a live SGLang process beside it (its weight-cache daemon, say) holding its own.
    dead = spawn(sandbox, "server-files", "--tmp", dirs["dead"], "--cache", dirs["dead"] / "cache", "--uds", dirs["dead"] / "api.sock")
    live = spawn(sandbox, "server-files", "--tmp", dirs["live"], "--cache", dirs["live"] / "cache", "--comm", "sglang::weights")
    dead.kill()
    d, a = dead.info, live.info
    other = tempfile.mkdtemp(dir=dirs["dead"])  # a plain mkdtemp directory: no Prometheus one
    Path(other, "notes.txt").write_text("x")
    # A vLLM API server that survived, sharing its port with SO_REUSEPORT (api_server_count > 1), and a web service on
    # another server's port.
    vllm_api = spawn(sandbox, "listen", "--title", "VLLM::APIServer_1", "--count", "2", "--reuseport")
    web = spawn(sandbox, "listen", "--comm", "nginx")
    ports = [
        {"port": vllm_api.info["port"], "server": "vllm", "name": "http"},
        {"port": web.info["port"], "server": "sglang", "name": "http"},
    ]
    r = mod("gpu_job_residue", residue_args(work, [d["uds"]], ports))
    removed = {x["path"] for x in r["removed"]}
    held = {x["path"] for x in r["held"]}
    stale = {x["path"]: x["kind"] for x in r["stale"]}
    kept = {x["path"]: x["why"] for x in r["kept"]}
    # The dead job's: its loky semaphore (its creator is dead), the socket paths never bound or bound by a dead
    # process, and the --uds socket go.
    for row in ("loky", "unbound", "metrics_ipc", "ar_fd", "load_collector", "weight_cache", "uds"):
        assert d[row] in removed, (row, d[row], r["kept"], r["stale"], r["ignored"])
    # Batons, the JIT lock, the cached P2P answer and the directories are reported, not removed (clean_slate_residue_remove).
    assert {stale.get(d[row]) for row in ("symm", "bump", "lock", "jit_lock")} == {"locks"}
    assert (stale.get(d["p2p"]), stale.get(d["prometheus"]), stale.get(d["ar_fd_dir"])) == ("caches", "dirs", "dirs")
    assert other not in stale and other not in removed and other not in held and os.path.isdir(other)
    # A FileStore and the weight-cache marker are opened only while used: unheld, but kept while a process of their
    # server runs (the surviving vLLM API server; the live SGLang process).
    assert kept[d["filestore"]].startswith(f"a process of vllm runs, PID {vllm_api.ns_pid} (python"), kept
    assert kept[d["weight_ready"]].startswith(f"a process of sglang runs, PID {live.ns_pid} (sglang::weights)"), kept
    # The live one's: held where its source holds (mapped, bound, flocked), its marker kept.
    assert {a[row] for row in ("loky", "prometheus", "metrics_ipc", "ar_fd", "load_collector", "weight_cache", "jit_lock")} <= held, r["held"]
    assert a["weight_ready"] in kept and os.path.exists(a["weight_ready"])
    for path in removed:
        assert not os.path.lexists(path)
    # The ports: the surviving vLLM fails the run, naming both its sockets' owner; the web service is only reported.
    assert r["_status"] == "failed" and r["reason"] == "port_in_use", r["msg"]
    assert f"port {vllm_api.info['port']} (vllm http) is still listened on by PID {vllm_api.ns_pid}" in r["msg"]
    recs = {p["port"]: p for p in r["ports"]}
    api = recs[vllm_api.info["port"]]
    assert (api["state"], api["server"], api["name"]) == ("listening", "vllm", "http")
    assert [o["pid"] for o in api["owners"]] == [vllm_api.ns_pid] and api["owners"][0]["matches"] == "^VLLM::"
    assert (recs[web.info["port"]]["state"], recs[web.info["port"]]["owners"][0]["name"]) == ("listening", "nginx")
    assert f"port {web.info['port']}" not in r["msg"]


def test_what_the_kill_of_the_same_run_released_goes_at_once_and_check_mode_says_so(mod, node, shm_sandbox, stand_in_tmp: Path) -> None:
    sandbox, work = shm_sandbox, stand_in_tmp
    # A server crashed seconds ago: its detokenizer, still alive, holds a queue and binds a socket made a moment ago.
    queue = Path(f"/proc/{sandbox.init_pid}/root/dev/shm/psm_0a1b2c3d")
    queue.write_bytes(b"\0" * 4096)
    socket_path = work / "tmp0a1b2c3d"
    holder = spawn(sandbox, "hold", "--comm", "sglang::detokeni", "--map", "/dev/shm/psm_0a1b2c3d", "--bind", socket_path)
    # Beside it, a segment nobody was seen holding, as young: a server starting now may be about to map it.
    beside = Path(f"/proc/{sandbox.init_pid}/root/dev/shm/psm_99887766")
    beside.write_bytes(b"\0" * 4096)
    args = {
        "phases": ["preflight", "kill", "residue"],
        "verify": {"device_dir": str(node.dev_dir), "cuda_probe": False, "health": False},
        "kill": {"device_dir": str(node.dev_dir), "patterns": ["^sglang::"], "grace_period": 2},
        "residue": {"shm": ["/dev/shm/psm_*"], "sockets": [f"{work}/tmp????????"], "min_age": 600},
    }
    check = mod("clean_slate_node", args, check=True)
    assert check["_status"] == "ok", check
    assert [x["pid"] for x in check["kill"]["targets"]] == [holder.ns_pid]
    # Check mode ends nothing, so the detokenizer still holds its files (listed as held, as ever), and says what the run
    # does with them: held only by what its kill ends, they go right after it, whatever their age.
    planned = {x["path"]: x for x in check["residue"]["held"]}
    assert set(planned) == {"/dev/shm/psm_0a1b2c3d", str(socket_path)} and all(x["released_by"] == [holder.ns_pid] for x in planned.values())
    assert all(x["why"].startswith("held only by processes this run's kill ends") for x in planned.values())
    assert check["residue"]["removed"] == [] and check["residue"]["summary"]["released"] == 2
    assert [x["path"] for x in check["residue"]["kept"]] == ["/dev/shm/psm_99887766"] and holder.alive()
    run = mod("clean_slate_node", args)
    assert run["_status"] == "ok", run
    removed = {x["path"]: x for x in run["residue"]["removed"]}
    # Exactly what check mode said: the detokenizer's files go, younger than min_age, since this run's kill ended
    # their only holder; the segment nobody was seen holding stays for min_age.
    assert set(removed) == set(planned) and all(x["released_by"] == [holder.ns_pid] for x in removed.values())
    assert run["residue"]["summary"]["released"] == 2
    assert [x["path"] for x in run["residue"]["kept"]] == ["/dev/shm/psm_99887766"]
    assert not queue.exists() and not os.path.lexists(socket_path) and beside.exists()
