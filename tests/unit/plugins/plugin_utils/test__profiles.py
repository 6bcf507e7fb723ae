"""plugin_utils/_profiles, the server_profiles filter and the role's refusal of its profile variables: the role's own
profiles (roles/clean_slate/profiles/) as data, a user's profile added in YAML (the guide's torchrun example), and bad
profile input refused with a sentence naming the variable and the place in it."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest
import yaml

from ansible_collections.gpuops.clean_slate.plugins.filter.clean_slate_result import role_refusals
from ansible_collections.gpuops.clean_slate.plugins.filter.server_profiles import server_profiles
from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _node
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module as residue_module
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import walk
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles

ROLE = str(Path(__file__).resolve().parents[4] / "roles" / "clean_slate")

# The guide's worked example ("Server profiles"): a torchrun job, as a user writes it in group_vars.
TORCHRUN = yaml.safe_load(
    r"""
description: torchrun training job (torch.distributed.run)
processes:
  roots: ['(^|/)torchrun( |$)', '-m torch\.distributed\.(run|launch)( |$)']
  members: []
stop:
  grace: 30
ports:
  - {name: master, port: 29400}
residue:
  dirs: [/tmp/torchelastic_*]
  shm: [/dev/shm/nccl-*, /dev/shm/torch_*]
"""
)


def test_the_roles_own_profiles_are_valid_and_name_what_the_facts_name() -> None:
    profiles = _profiles.builtin(ROLE)
    assert set(profiles) == {"sglang", "vllm"}
    for name, p in profiles.items():
        assert _profiles.problems(name, p, walk.DEFAULT_ROOTS, "profile") == [], name
    r = _profiles.resolve(["sglang", "vllm"], ROLE)
    assert [(s["name"], s["grace"]) for s in r["servers"]] == [("sglang", 25.0), ("vllm", 15.0)]
    # Ports (round4-facts §4): SGLang's HTTP port and its data-parallel ZMQ plan, vLLM's four; nccl_port only when given.
    assert [(p["server"], p["port"]) for p in r["ports"]] == [("sglang", 30000 + d) for d in (0, *range(233, 240))] + [
        ("vllm", p) for p in (8000, 29500, 29501, 29550)
    ]
    # Every §3 row has its glob.
    for glob in (
        "/tmp/vllm_dist_????????????????????????????????",
        "/dev/shm/sem.loky-*",
        "/tmp/tmp????????",
        "/tmp/tmp????????.*",
        "/tmp/sgl_ar_fd_*/rank_*.sock",
        "/tmp/sglang_load_collector_*.sock",
        "/tmp/sglang_weight_cache_*.sock",
        "/tmp/sglang_weight_cache_*.ready",
        "/tmp/symm_allocator/lock",
        "/tmp/sgl_bump_arena/*/lock",
        "/tmp/lock",
        "/root/.cache/sglang/**/*.lock",
        "/root/.cache/vllm/gpu_p2p_access_cache_for_*.json",
    ):
        assert any(glob in r[kind] for kind in walk.KINDS), glob
    assert r["dirs_holding"] == [{"dir": "/tmp/tmp????????", "files": "*_[0-9]*.db"}]
    # What the role passes is what the modules accept.
    residue_module.build_request(
        {**residue_params(), **{k: r[k] for k in walk.KINDS}, "dirs_holding": r["dirs_holding"], "keep_while": r["keep_while"], "server_ports": r["ports"]},
        list,
    )


def residue_params() -> dict[str, t.Any]:
    p: dict[str, t.Any] = {kind: [] for kind in walk.KINDS}
    p.update(remove=["shm"], users=[], containers=[], pct_path=None, ports=[], time_wait_timeout=0.0, patterns=[], protect=[])
    p.update(fail_on=["listening"], list_limit=200, min_age=60.0, roots=list(walk.DEFAULT_ROOTS))
    return p


def test_a_user_adds_a_profile_in_yaml_and_sets_a_servers_port() -> None:
    r = server_profiles(["sglang", "torchrun"], ROLE, {"torchrun": TORCHRUN}, {"sglang": 31000})
    assert [s["name"] for s in r["servers"]] == ["sglang", "torchrun"] and r["servers"][1]["grace"] == 30.0
    assert ("torchrun", 29400) in [(p["server"], p["port"]) for p in r["ports"]]
    # The HTTP port moved, and the ports derived from it with it.
    assert [p["port"] for p in r["ports"] if p["server"] == "sglang"] == [31000, *range(31233, 31240)]
    assert "/tmp/torchelastic_*" in r["dirs"] and "(^|/)torchrun( |$)" in r["patterns"]
    assert role_refusals({"clean_slate_profiles": ["sglang", "torchrun"], "clean_slate_profile_definitions": {"torchrun": TORCHRUN}}, ROLE) == []
    # A survey answer is text: its names are checked as a list's.
    assert any("'torchrn'" in r for r in role_refusals({"clean_slate_profiles": "sglang,torchrn"}, ROLE))
    assert server_profiles("[sglang]", ROLE)["servers"][0]["name"] == "sglang"
    # A user's profile of a role's name replaces it; none applies none.
    assert server_profiles(["vllm"], ROLE, {"vllm": {"processes": {"roots": ["myvllm"]}}})["servers"] == [{"name": "vllm", "roots": ["myvllm"]}]
    assert server_profiles([], ROLE)["servers"] == [] and server_profiles([], ROLE)["ports"] == []


def test_narrower_roots_leave_the_roles_globs_out_instead_of_refusing_the_host() -> None:
    r = server_profiles(["sglang"], ROLE, {}, {}, ["/dev/shm", "/tmp"])
    assert not [g for kind in walk.KINDS for g in r[kind] if g.startswith(("/root", "/home"))] and "/tmp/lock" in r["locks"]
    assert role_refusals({"clean_slate_residue_roots": ["/dev/shm", "/tmp"]}, ROLE) == []


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"clean_slate_profiles": ["sglng"]}, "clean_slate_profiles names 'sglng', which no profile is (known: sglang, vllm)"),
        ({"clean_slate_profile_definitions": {"t": {"prots": []}}}, "clean_slate_profile_definitions.t has unknown key(s) prots"),
        (
            {"clean_slate_profile_definitions": {"t": {"stop": {"grace": 5, "signal": "INT"}}}},
            "clean_slate_profile_definitions.t.stop has unknown key(s) signal",
        ),
        ({"clean_slate_profile_definitions": {"t": {"ports": [{"name": "a", "port": 70000}]}}}, "t.ports[0].port: 70000 is not a TCP port (1-65535)"),
        ({"clean_slate_profile_definitions": {"t": {"ports": [{"name": "a", "from": "b", "offset": 1}]}}}, "t.ports[0].from: 'b' is not another port"),
        ({"clean_slate_profile_definitions": {"t": {"processes": {"roots": ["("]}}}}, "t.processes.roots: '(' is not a valid regular expression"),
        ({"clean_slate_profile_definitions": {"t": {"stop": {"grace": -1}}}}, "t.stop.grace must be from 0 to 86400 seconds, got -1"),
        ({"clean_slate_profile_definitions": {"t": {"residue": {"shm": ["/etc/x*"]}}}}, "t.residue.shm: '/etc/x*' is outside the roots"),
        ({"clean_slate_profile_definitions": {"t": {"residue": {"sockets": ["relative/*"]}}}}, "t.residue.sockets: 'relative/*' is not an absolute path glob"),
        ({"clean_slate_profile_definitions": {"t": {"residue": {"dirs_holding": [{"dir": "/opt/tmp*", "files": "*.db"}]}}}}, "is outside the roots"),
        ({"clean_slate_server_ports": {"sglang": 70000}}, "clean_slate_server_ports.sglang.http: 70000 is not a TCP port"),
        ({"clean_slate_server_ports": {"sglang": {"htp": 1}}}, "clean_slate_server_ports.sglang: the profile has no port named 'htp'"),
        ({"clean_slate_server_ports": {"torchrun": 1}}, "clean_slate_server_ports.torchrun: 'torchrun' is not a profile this host applies"),
    ],
)
def test_bad_profile_input_refuses_the_host_naming_the_variable(given: dict[str, t.Any], words: str) -> None:
    refusals = role_refusals(given, ROLE)
    assert any(words in r for r in refusals), refusals
    # A refused profile adds nothing to what the modules get (the host is stopped before anything runs).
    names = given.get("clean_slate_profiles", ["sglang", "vllm", "t"])
    r = server_profiles(names, ROLE, given.get("clean_slate_profile_definitions"), given.get("clean_slate_server_ports"))
    assert "t" not in [s["name"] for s in r["servers"]]


def test_the_umbrella_adds_the_profiles_after_the_given_options_and_refuses_an_unknown_key() -> None:
    r = _profiles.resolve(["sglang"], ROLE)
    p = {"kill": {"patterns": ["^mine$"]}, "residue": {"shm": ["/dev/shm/mine-*"]}, "profiles": r}
    merged = _node.merge_profiles(p)
    assert merged["kill"]["patterns"][0] == "^mine$" and set(r["patterns"]) <= set(merged["kill"]["patterns"])
    assert merged["kill"]["servers"] == r["servers"] and merged["residue"]["server_ports"] == r["ports"]
    assert merged["residue"]["shm"][0] == "/dev/shm/mine-*" and "/dev/shm/sgl_shm_*" in merged["residue"]["shm"]
    # An option not written out starts from its module's default, which the profile extends.
    assert merged["residue"]["sockets"][: len(walk.DEFAULT_SOCKETS)] == list(walk.DEFAULT_SOCKETS)
    assert merged["residue"]["patterns"] == r["patterns"] and _kill.argument_spec()["servers"]["default"] == []
    with pytest.raises(_node.CleanSlateError) as err:
        _node.merge_profiles({"kill": {}, "residue": {}, "profiles": {"ports": [], "sevrers": []}})
    assert err.value.reason == "bad_arguments" and err.value.details["option"] == "profiles" and "sevrers" in err.value.msg
