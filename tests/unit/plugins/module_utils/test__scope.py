"""_scope: which processes belong to the named containers, judged from facts alone (no pct, no /proc)."""

from __future__ import annotations

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _scope

CT129 = _scope.Scope(vmid=129, init_pid=4000, pidns=4026532001)
CT130 = _scope.Scope(vmid=130, init_pid=5000, pidns=4026532002)
NO_NS = _scope.Scope(vmid=131, init_pid=6000, pidns=None)  # its init's namespace could not be read


def test_a_process_belongs_by_its_pid_namespace() -> None:
    assert _scope.member_of([CT129, CT130], pidns=4026532002, container=None) is CT130


def test_a_process_belongs_by_its_cgroup_path_when_namespaces_differ() -> None:
    # Docker inside the container: a nested PID namespace, but still under /lxc/129/ in the cgroup tree.
    assert _scope.member_of([CT129, CT130], pidns=4026532999, container=129) is CT129


def test_a_process_of_the_host_or_another_container_is_outside() -> None:
    assert _scope.member_of([CT129, CT130], pidns=4026531836, container=None) is None
    assert _scope.member_of([CT129], pidns=None, container=130) is None
    assert _scope.member_of([], pidns=4026532001, container=129) is None


def test_unknown_namespaces_never_match_each_other() -> None:
    # Two unreadable namespaces are no evidence of one container: None must not equal None.
    assert _scope.member_of([NO_NS], pidns=None, container=None) is None
    assert _scope.member_of([NO_NS], pidns=None, container=131) is NO_NS


def test_the_label_names_every_container() -> None:
    assert _scope.label([CT129, CT130]) == "129, 130"
    assert _scope.label([]) == ""
