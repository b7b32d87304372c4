"""The cgroup-line parser over every layout the kubelet and the container runtimes write, the
docs/reliability.md P9 security
cases (crafted sub-cgroups), and property tests that fail if a host path ever yields a pod."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuguard.core.cgroup import (
    REASON_CONMON,
    REASON_DELEGATED,
    REASON_EMPTY,
    REASON_MALFORMED,
    REASON_NO_CONTAINER,
    REASON_NO_KUBEPODS,
    REASON_NO_POD,
    REASON_V1_DISAGREE,
    parse_cgroup,
    parse_cgroup_path,
)
from gpuguard.core.model import ContainerCgroup, Runtime

UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
UID_ = UID.replace("-", "_")
OTHER = "0d6a4c1e-1111-4222-8333-944455556666"
OTHER_ = OTHER.replace("-", "_")
HASH = "6a1a0f3c2b9e4d8f9a7b6c5d4e3f2a1b"
C = "a" * 60 + "c0de"
S = "5" * 64
D = "d" * 64

BURST = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"

# A hybrid host (v1 controllers + a 0:: line) like this machine, with the process only in v1.
V1_REST = "\n".join(
    f"{n}:{c}:/" for n, c in [(7, "blkio"), (6, "freezer"), (3, "cpuset"), (2, "cpuacct")]
)

# (id, file text, pod uid, container id, runtime, version, ContainerCgroup path, hierarchy)
LAYOUTS = [
    ("1-v2-systemd-containerd-burstable", f"0::{BURST}/cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2, f"{BURST}/cri-containerd-{C}.scope", ""),
    ("2-v2-systemd-containerd-guaranteed",
     f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2,
     f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{C}.scope", ""),
    ("3-v2-systemd-containerd-besteffort",
     f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2,
     f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope", ""),
    ("4-v2-cgroupfs-containerd-burstable", f"0::/kubepods/burstable/pod{UID}/{C}",
     UID, C, None, 2, f"/kubepods/burstable/pod{UID}/{C}", ""),
    ("5-v2-cgroupfs-containerd-guaranteed", f"0::/kubepods/pod{UID}/{C}",
     UID, C, None, 2, f"/kubepods/pod{UID}/{C}", ""),
    ("6-v1-cgroupfs-containerd",
     "\n".join(f"{n}:{c}:/kubepods/besteffort/pod{UID}/{C}"
               for n, c in [(11, "memory"), (8, "pids"), (4, "cpu,cpuacct")]) + "\n0::/",
     UID, C, None, 1, f"/kubepods/besteffort/pod{UID}/{C}", "pids"),
    ("7-v1-systemd-cri-dockerd",
     f"1:name=systemd:{BURST}/docker-{C}.scope\n{V1_REST}\n0::/",
     UID, C, Runtime.DOCKER, 1, f"{BURST}/docker-{C}.scope", "name=systemd"),
    ("8-v1-cgroupfs-docker", f"4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{C}\n3:cpuset:/",
     UID, C, None, 1, f"/kubepods/burstable/pod{UID}/{C}", "cpu,cpuacct"),
    ("9-v2-systemd-crio-runc", f"0::{BURST}/crio-{C}.scope",
     UID, C, Runtime.CRIO, 2, f"{BURST}/crio-{C}.scope", ""),
    ("10-v2-systemd-crio-crun-subgroup", f"0::{BURST}/crio-{C}.scope/container",
     UID, C, Runtime.CRIO, 2, f"{BURST}/crio-{C}.scope", ""),
    ("12-v2-cgroupfs-crio", f"0::/kubepods/burstable/pod{UID}/crio-{C}",
     UID, C, Runtime.CRIO, 2, f"/kubepods/burstable/pod{UID}/crio-{C}", ""),
    ("13-kind-kubelet-slice",
     f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2,
     f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
     f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{C}.scope", ""),
    ("13b-kind-seen-from-outside-the-node",
     f"0::/docker/{D}/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2,
     f"/docker/{D}/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope", ""),
    ("14-static-pod-systemd",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{HASH}.slice/"
     f"cri-containerd-{C}.scope",
     HASH, C, Runtime.CONTAINERD, 2,
     f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{HASH}.slice/"
     f"cri-containerd-{C}.scope", ""),
    ("14b-static-pod-cgroupfs", f"0::/kubepods/pod{HASH}/{C}",
     HASH, C, None, 2, f"/kubepods/pod{HASH}/{C}", ""),
    ("15-private-cgroupns-relative",
     f"0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2,
     f"/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope", ""),
    ("15b-private-cgroupns-relative-guaranteed",
     f"0::/../../kubepods-pod{UID_}.slice/cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2, f"/../../kubepods-pod{UID_}.slice/cri-containerd-{C}.scope",
     ""),
    ("15c-private-cgroupns-relative-same-qos",
     f"0::/../../kubepods-burstable-pod{UID_}.slice/crio-{C}.scope/container",
     UID, C, Runtime.CRIO, 2, f"/../../kubepods-burstable-pod{UID_}.slice/crio-{C}.scope", ""),
    ("15d-private-cgroupns-relative-cgroupfs", f"0::/../../besteffort/pod{UID}/{C}",
     UID, C, None, 2, f"/../../besteffort/pod{UID}/{C}", ""),
    ("17-pod-sandbox-pause", f"0::{BURST}/cri-containerd-{S}.scope",
     UID, S, Runtime.CONTAINERD, 2, f"{BURST}/cri-containerd-{S}.scope", ""),
    ("nested-below-the-container-scope", f"0::{BURST}/cri-containerd-{C}.scope/a/b/c",
     UID, C, Runtime.CONTAINERD, 2, f"{BURST}/cri-containerd-{C}.scope", ""),
    ("hybrid-v2-line-wins-over-root-v1-lines",
     f"8:pids:/\n1:name=systemd:/\n0::{BURST}/cri-containerd-{C}.scope",
     UID, C, Runtime.CONTAINERD, 2, f"{BURST}/cri-containerd-{C}.scope", ""),
    ("hybrid-v1-pids-line-when-v2-is-root",
     f"9:name=systemd:/\n8:pids:/kubepods/pod{UID}/{C}\n{V1_REST}\n0::/",
     UID, C, None, 1, f"/kubepods/pod{UID}/{C}", "pids"),
    ("under-a-test-or-node-prefix", f"0::/gpuguard-test-1/kubepods/pod{UID}/{C}",
     UID, C, None, 2, f"/gpuguard-test-1/kubepods/pod{UID}/{C}", ""),
    ("deleted-v2-cgroup", f"0::{BURST}/cri-containerd-{C}.scope (deleted)",
     UID, C, Runtime.CONTAINERD, 2, f"{BURST}/cri-containerd-{C}.scope", ""),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "uid", "cid", "runtime", "version", "path", "hierarchy"),
    [pytest.param(*row[1:], id=row[0]) for row in LAYOUTS],
)
def test_every_reference_layout_yields_its_pod_container_and_cgroup(
    text: str,
    uid: str,
    cid: str,
    runtime: Runtime | None,
    version: int,
    path: str,
    hierarchy: str,
) -> None:
    got = parse_cgroup(text + "\n")
    assert got.is_pod
    assert got.pod_uid == uid
    assert got.container_id == cid
    assert got.runtime == runtime
    assert got.cgroup_version == version
    assert got.cgroup == ContainerCgroup(version=version, hierarchy=hierarchy, path=path)
    assert got.reason is None


NOT_PODS = [
    ("16-host-service", "0::/system.slice/containerd.service", REASON_NO_KUBEPODS),
    ("16-user-session", "0::/user.slice/user-1000.slice/session-3.scope", REASON_NO_KUBEPODS),
    ("root-cgroup", "0::/", REASON_NO_KUBEPODS),
    ("hybrid-host-process", f"8:pids:/\n{V1_REST}\n0::/", REASON_NO_KUBEPODS),
    ("11-crio-conmon-in-pod", f"0::{BURST}/crio-conmon-{C}.scope", REASON_CONMON),
    ("11-crio-conmon-in-system-slice", f"0::/system.slice/crio-conmon-{C}.scope", REASON_CONMON),
    ("11-crio-conmon-cgroupfs", f"0::/kubepods/burstable/pod{UID}/crio-conmon-{C}",
     REASON_CONMON),
    ("in-qos-slice", "0::/kubepods.slice/kubepods-burstable.slice", REASON_NO_POD),
    ("in-kubepods-root", "0::/kubepods", REASON_NO_POD),
    ("empty", "", REASON_EMPTY),
    ("garbage", "hello world\n", REASON_MALFORMED),
    ("pod-name-outside-kubepods", f"0::/system.slice/pod{UID}/{C}", REASON_NO_KUBEPODS),
    ("systemd-pod-outside-kubepods",
     f"0::/user.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{C}.scope",
     REASON_NO_KUBEPODS),
    ("kubepods-inside-a-user-session",
     f"0::/user.slice/user-1000.slice/user@1000.service/kubepods/pod{UID}/{C}",
     REASON_DELEGATED),
    ("pod-level-inconsistent-with-qos",
     f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice/"
     f"cri-containerd-{C}.scope", REASON_NO_POD),
    ("systemd-uid-with-dashes",
     f"0::/kubepods.slice/kubepods-pod{UID}.slice/cri-containerd-{C}.scope", REASON_NO_POD),
    ("cgroupfs-uid-with-underscores", f"0::/kubepods/pod{UID_}/{C}", REASON_NO_POD),
    ("kind-slice-without-its-parent",
     f"0::/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/cri-containerd-{C}.scope",
     REASON_NO_KUBEPODS),
    ("short-uid", f"0::/kubepods/pod{UID[:-1]}/{C}", REASON_NO_POD),
    ("relative-sibling-container-of-own-pod", f"0::/../cri-containerd-{C}.scope",
     REASON_NO_KUBEPODS),
    ("v1-hierarchies-disagree",
     f"8:pids:/kubepods/pod{UID}/{C}\n4:memory:/kubepods/pod{OTHER}/{C}\n0::/",
     REASON_V1_DISAGREE),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "reason"), [pytest.param(*row[1:], id=row[0]) for row in NOT_PODS]
)
def test_non_pod_processes_get_no_pod_and_a_reason(text: str, reason: str) -> None:
    got = parse_cgroup(text)
    assert not got.is_pod
    assert got.pod_uid is None
    assert got.container_id is None
    assert got.cgroup is None
    assert got.reason == reason


def test_a_process_in_the_pod_cgroup_itself_is_the_pods_but_has_no_container() -> None:
    got = parse_cgroup(f"0::{BURST}\n")
    assert got.pod_uid == UID
    assert got.container_id is None
    assert got.cgroup is None
    assert got.reason == REASON_NO_CONTAINER


def test_an_unknown_leaf_below_the_pod_is_the_pods_but_has_no_container() -> None:
    got = parse_cgroup(f"0::{BURST}/something-else.scope\n")
    assert got.pod_uid == UID
    assert got.container_id is None
    assert got.reason == REASON_NO_CONTAINER


def test_cgroup_version_of_a_non_pod_process_is_the_hosts() -> None:
    assert parse_cgroup("0::/system.slice/x.service\n").cgroup_version == 2
    assert parse_cgroup(f"8:pids:/\n{V1_REST}\n0::/\n").cgroup_version == 1


# ---------------------------------------------------------------------------------------------
# Security (docs/reliability.md P9): only the kubelet-owned levels name the pod.

CRAFTED_BELOW_CONTAINER = [
    f"/kubepods-pod{OTHER_}.slice",
    f"/kubepods.slice/kubepods-pod{OTHER_}.slice/cri-containerd-{D}.scope",
    f"/kubepods/pod{OTHER}/{D}",
    f"/kubepods/burstable/pod{OTHER}/crio-conmon-{D}",
    f"/pod{OTHER}/{D}",
    "/../../../../etc",
]


@pytest.mark.parametrize("suffix", CRAFTED_BELOW_CONTAINER)
@pytest.mark.parametrize(
    "container",
    [
        f"{BURST}/cri-containerd-{C}.scope",
        f"/kubepods/burstable/pod{UID}/{C}",
        f"/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{C}.scope",
    ],
    ids=["systemd", "cgroupfs", "relative"],
)
def test_a_cgroup_a_container_creates_inside_itself_never_changes_attribution(
    container: str, suffix: str
) -> None:
    got = parse_cgroup(f"0::{container}{suffix}\n")
    if ".." in suffix:  # '..' after a name is not something the kernel prints: reject
        assert not got.is_pod
        return
    assert got.pod_uid == UID
    assert got.container_id == C
    assert got.cgroup is not None
    assert got.cgroup.path == container


def test_a_crafted_cgroup_directly_in_the_pod_slice_is_not_another_pod() -> None:
    got = parse_cgroup(f"0::{BURST}/kubepods-burstable-pod{OTHER_}.slice/{C}\n")
    assert got.pod_uid == UID
    assert got.container_id is None


def test_v1_and_v2_answers_for_the_same_container_are_the_same() -> None:
    v2 = parse_cgroup(f"0::{BURST}/cri-containerd-{C}.scope\n")
    v1 = parse_cgroup(f"1:name=systemd:{BURST}/cri-containerd-{C}.scope\n0::/\n")
    assert (v1.pod_uid, v1.container_id, v1.runtime) == (v2.pod_uid, v2.container_id, v2.runtime)


# ---------------------------------------------------------------------------------------------
# Properties

_segment_chars = string.ascii_lowercase + string.digits + "-_.@"
_uuid = st.uuids().map(str)
_host_segment = st.one_of(
    st.sampled_from(
        [
            "system.slice",
            "user.slice",
            "user-1000.slice",
            "session-3.scope",
            "docker",
            "containerd.service",
            "init.scope",
            "machine.slice",
            "burstable",
            "besteffort",
            "container",
        ]
    ),
    _uuid.map(lambda u: f"pod{u}"),
    _uuid.map(lambda u: f"kubepods-burstable-pod{u.replace('-', '_')}.slice"),
    _uuid.map(lambda u: f"kubepods-pod{u.replace('-', '_')}.slice"),
    st.just(f"cri-containerd-{C}.scope"),
    st.just(C),
    st.text(alphabet=_segment_chars, min_size=1, max_size=20),
)


def _contains_kubepods_root(segments: list[str]) -> bool:
    return any(s == "kubepods" or s == "kubepods.slice" or s.endswith("-kubepods.slice")
               for s in segments)  # fmt: skip


@settings(max_examples=400)
@given(st.text(max_size=400))
def test_never_crashes_on_arbitrary_text(text: str) -> None:
    got = parse_cgroup(text)
    assert got.is_pod == (got.pod_uid is not None)
    if not got.is_pod:
        assert got.reason is not None


@settings(max_examples=400)
@given(st.lists(st.from_regex(r"\A[0-9]{1,2}:[a-z=,]{0,12}:/[^\n]{0,80}\Z"), max_size=6))
def test_never_crashes_on_line_shaped_text(lines: list[str]) -> None:
    got = parse_cgroup("\n".join(lines))
    assert got.is_pod == (got.pod_uid is not None)


@settings(max_examples=500)
@given(st.lists(_host_segment, min_size=0, max_size=8), st.sampled_from(["0::", "8:pids:"]))
def test_never_yields_a_pod_from_a_host_path(segments: list[str], prefix: str) -> None:
    # Host paths are absolute and never pass through a kubepods root: however many pod-like
    # names they contain, they are not a pod's.
    segments = [s for s in segments if s not in (".", "..")]
    if _contains_kubepods_root(segments):
        segments = [s for s in segments if "kubepods" not in s or "pod" in s]
    if _contains_kubepods_root(segments):
        return
    got = parse_cgroup(f"{prefix}/{'/'.join(segments)}\n")
    assert not got.is_pod, segments
    assert got.container_id is None


@settings(max_examples=300)
@given(
    st.sampled_from([row[1] for row in LAYOUTS if "\n" not in row[1] and "deleted" not in row[1]]),
    st.lists(_host_segment, min_size=1, max_size=6),
)
def test_anything_nested_below_a_container_keeps_the_attribution(
    line: str, nested: list[str]
) -> None:
    base = parse_cgroup(line)
    nested = [s for s in nested if s not in (".", "..")]
    got = parse_cgroup(line + "/" + "/".join(nested) if nested else line)
    assert (got.pod_uid, got.container_id, got.runtime, got.cgroup) == (
        base.pod_uid,
        base.container_id,
        base.runtime,
        base.cgroup,
    )


def test_parse_cgroup_path_reads_one_path() -> None:
    got = parse_cgroup_path(f"{BURST}/cri-containerd-{C}.scope")
    assert got.pod_uid == UID
    assert got.container_path == f"{BURST}/cri-containerd-{C}.scope"


# ---------------------------------------------------------------------------------------------
# Cgroup names are hostile input

SPLITLINES_SEPARATORS = ["\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
"""Every character ``str.splitlines()`` splits on other than ``\\n``: the kernel allows each one
in a cgroup name (it forbids only ``/`` and ``\\n``)."""


def test_the_separator_list_is_exactly_what_splitlines_splits_on_besides_newline() -> None:
    splitters = {chr(c) for c in range(0x110000) if len(f"a{chr(c)}b".splitlines()) == 2}
    assert splitters - {"\n"} == set(SPLITLINES_SEPARATORS)


@pytest.mark.parametrize("sep", SPLITLINES_SEPARATORS, ids=lambda c: f"U+{ord(c):04X}")
@pytest.mark.parametrize(
    "where",
    [
        # A host service with a delegated subtree (Delegate=yes) names a cgroup so that a
        # splitlines() reader sees a whole kubelet line.
        "8:pids:/system.slice/build.service/x{sep}{forged}\n" + V1_REST,
        "0::/system.slice/build.service/x{sep}{forged}",
        # A pod with a writable cgroup namespace does the same below its own container.
        f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{OTHER_}.slice/"
        f"cri-containerd-{S}.scope/x{{sep}}{{forged}}",
    ],
    ids=["v1-host-unit", "v2-host-unit", "v2-other-pod"],
)
def test_a_cgroup_name_cannot_forge_another_pods_line(sep: str, where: str) -> None:
    """A name ``x<sep>8:pids:/kubepods/burstable/pod<U>/<C>`` never charges pod U."""
    forged = f"8:pids:/kubepods/burstable/pod{UID}/{C}"
    got = parse_cgroup(where.format(sep=sep, forged=forged) + "\n")
    assert got.pod_uid != UID
    assert got.container_id != C


@pytest.mark.parametrize("sep", SPLITLINES_SEPARATORS, ids=lambda c: f"U+{ord(c):04X}")
def test_a_cgroup_name_cannot_make_v1_lines_disagree_and_escape(sep: str) -> None:
    """A pod process that names a nested cgroup ``y<sep>9:cpu:/other`` stays its pod's."""
    real = f"/kubepods/burstable/pod{UID}/{C}"
    text = f"8:pids:{real}/y{sep}9:cpu:/kubepods/burstable/pod{OTHER}/{S}\n5:memory:{real}\n"
    got = parse_cgroup(text)
    assert (got.pod_uid, got.container_id) == (UID, C)


def test_a_non_ascii_hierarchy_id_is_not_a_line() -> None:
    got = parse_cgroup(f"\u0668:pids:/kubepods/burstable/pod{UID}/{C}\n")
    assert not got.is_pod


_any_name_char = st.characters(blacklist_characters="/\n", blacklist_categories=())


@settings(max_examples=500)
@given(
    st.lists(st.text(_any_name_char, min_size=1, max_size=30), min_size=1, max_size=6),
    st.sampled_from(["0::", "8:pids:", "1:name=systemd:"]),
)
def test_no_unicode_cgroup_name_turns_a_host_path_into_a_pod(names: list[str], prefix: str) -> None:
    """Any Unicode the kernel allows in a name (everything but '/' and NUL..'\\n'): a path
    that does not pass through a kubepods root is never a pod's, whatever the names say."""
    names = [n for n in names if n not in (".", "..")]
    if _contains_kubepods_root(names) or not names:
        return
    got = parse_cgroup(f"{prefix}/host/{'/'.join(names)}\n")
    assert not got.is_pod, names


@settings(max_examples=500)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_decoded_as_procfs_does_never_crash_or_forge(raw: bytes) -> None:
    text = raw.decode("utf-8", errors="replace")
    got = parse_cgroup(text)
    assert got.is_pod == (got.pod_uid is not None)
    # A pod answer must come from one real line of the text, split on '\n' only.
    if got.is_pod:
        assert any(str(got.pod_uid).replace("-", "_") in ln or str(got.pod_uid) in ln
                   for ln in text.split("\n"))  # fmt: skip


@settings(max_examples=300)
@given(
    st.sampled_from([row[1] for row in LAYOUTS if "\n" not in row[1] and "deleted" not in row[1]]),
    st.lists(st.text(_any_name_char, min_size=1, max_size=20), min_size=1, max_size=4),
)
def test_any_unicode_nested_below_a_container_keeps_the_attribution(
    line: str, nested: list[str]
) -> None:
    base = parse_cgroup(line)
    nested = [s for s in nested if s not in (".", "..")]
    got = parse_cgroup(line + "/" + "/".join(nested) if nested else line)
    assert (got.pod_uid, got.container_id, got.cgroup) == (base.pod_uid, base.container_id,
                                                           base.cgroup)  # fmt: skip
