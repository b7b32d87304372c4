"""Hostile tenants against the real ``gpuguard enforce``: real kube-apiserver, real
cgroups and processes, the NVML stand-in. Each test was a wrong kill on the code before the fix:
the oracle is the set of signals every worker recorded, which must be empty.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rigs.controlplane import AdminRequestError, wait_until
from rigs.node import GIB, PodInfo, Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]

MIB = 1 << 20
STATIC_HASH = "5c1b0e6a9d2f4e3b8a7c6d5e4f3a2b1c"
MIRROR = {"kubernetes.io/config.hash": STATIC_HASH, "kubernetes.io/config.mirror": STATIC_HASH}


def _static_pod(rig: Rig) -> PodInfo:
    """A kube-system static pod as the kubelet shows it: a mirror pod whose cgroups carry the
    static pod's hash, not the mirror pod's UID."""
    return rig.add_pod(
        f"etcd-{rig.node}",
        namespace="kube-system",
        annotations={**MIRROR, "kubernetes.io/config.source": "file"},
        cgroup_uid=STATIC_HASH,
    )


def _settle(rig: Rig, seconds: float = 4.0) -> None:
    """Several polls past the grace period (1 s): a wrong kill would have happened by now."""
    time.sleep(seconds)


def test_a_tenant_copying_a_static_pods_hash_in_a_namespace_listed_first_takes_nothing(
    rig: Rig,
) -> None:
    """``default/evil`` (``default`` sorts before ``kube-system``, so the API lists it first)
    copies the hash of a kube-system static pod and sets a 1Gi limit: the static pod's process
    was SIGTERMed as evil's, bypassing the kube-system exemption."""
    static = _static_pod(rig)
    rig.add_pod(
        f"evil-{rig.node}",
        namespace="default",
        limit="1Gi",
        annotations={"kubernetes.io/config.hash": STATIC_HASH},
    )
    etcd = rig.spawn(static, "etcd", used_bytes=2 * GIB)

    enforcer = rig.start_enforcer()
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
    _settle(rig)

    assert etcd.received() == []
    assert etcd.alive()
    assert enforcer.events("container_signalled") == []
    for trigger in ("grace", "pressure"):
        assert enforcer.metric("gpuguard_violations_total", {"trigger": trigger}) == 0.0


def test_a_tenant_copying_both_mirror_annotations_makes_the_hash_nobodys(rig: Rig) -> None:
    """With ``config.mirror`` copied too (the API server allows it at create time), two pods
    claim the hash: it belongs to neither, the memory is unattributed and nobody is signalled."""
    static = _static_pod(rig)
    try:
        rig.add_pod(f"evil-{rig.node}", namespace="default", limit="1Gi", annotations=MIRROR)
    except AdminRequestError as exc:  # an API server that forbids it closes the hole itself
        pytest.fail(f"expected the API server to accept a copied mirror annotation: {exc}")
    etcd = rig.spawn(static, "etcd", used_bytes=2 * GIB)

    enforcer = rig.start_enforcer()
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
    warned = enforcer.wait_for("static_pod_hash_ambiguous", timeout=20)
    _settle(rig)

    assert sorted(warned["pods"]) == sorted([f"default/evil-{rig.node}", static_name(static)])
    assert etcd.received() == []
    assert enforcer.events("container_signalled") == []
    unattributed = enforcer.metric("gpuguard_gpu_memory_unattributed_bytes", {"gpu": "0"})
    assert unattributed == 2 * GIB


def static_name(pod: PodInfo) -> str:
    return f"{pod.namespace}/{pod.name}"


SEPARATORS = ["\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]
"""Every character besides ``\\n`` that ``str.splitlines()`` splits on; the kernel accepts
each in a cgroup name."""


def test_a_cgroup_name_with_any_line_separator_never_charges_another_pod(rig: Rig) -> None:
    """A host service with a delegated subtree names a cgroup ``x<sep>8:pids:<victim's
    container>``: a splitlines() reader saw a kubelet line naming the victim's container and
    charged the host process's 4 GiB to the victim (limit 1Gi, using 100 MiB), then SIGTERMed
    the victim. One victim and one forger per separator, all under one enforcer."""
    victims = []
    forgers = []
    for i, sep in enumerate(SEPARATORS):
        pod = rig.add_pod(f"victim-{i}", limit="1Gi")
        v2 = rig.tree.container(
            version=2, driver="systemd", qos="burstable", pod_uid=pod.uid,
            runtime="containerd", container_id=pod.container_id,
        )  # fmt: skip
        v1 = rig.tree.container(
            version=1, driver="systemd", qos="burstable", pod_uid=pod.uid,
            runtime="containerd", container_id=pod.container_id, hierarchy="pids",
        )  # fmt: skip
        victims.append(rig.spawn(pod, f"victim-{i}", used_bytes=100 * MIB, cgroups=[v2, v1]))
        unit = f"system.slice/forger-{i}.service"
        forged_v1 = rig.tree.make(1, f"{unit}/x{sep}8:pids:{v1.path}", "pids")
        host_v2 = rig.tree.make(2, unit)
        forgers.append(
            rig.spawn(None, f"forger-{i}", used_bytes=4 * GIB, cgroups=[host_v2, forged_v1])
        )
    for forger, sep in zip(forgers, SEPARATORS, strict=True):
        # Bytes: text mode's universal newlines would turn "\r" into "\n" here.
        text = Path(f"/proc/{forger.pid}/cgroup").read_bytes().decode("utf-8")
        assert f"x{sep}8:pids:" in text, "the kernel kept the separator in the name"

    enforcer = rig.start_enforcer()
    wait_until(lambda: enforcer.ready()[0], timeout=30, what="the enforcer to be ready")
    _settle(rig)

    assert {v.name: v.received() for v in victims} == {v.name: [] for v in victims}
    assert all(v.alive() for v in victims)
    assert {f.name: f.received() for f in forgers} == {f.name: [] for f in forgers}
    assert enforcer.events("container_signalled") == []
    for trigger in ("grace", "pressure"):
        assert enforcer.metric("gpuguard_violations_total", {"trigger": trigger}) == 0.0
    # The forgers' memory is seen, and charged to nobody.
    unattributed = enforcer.metric("gpuguard_gpu_memory_unattributed_bytes", {"gpu": "0"})
    assert unattributed == len(SEPARATORS) * 4 * GIB


def test_a_quarter_megabyte_annotation_does_not_stall_enforcement(rig: Rig) -> None:
    """The quantity pattern backtracked quadratically: a 256 KiB annotation held the GIL for
    minutes on every watch event and relist, stalling polls and ``/healthz`` (the liveness
    probe then restarted the enforcer into the same stall). Now it is refused by length."""
    bomb = rig.add_pod("bomb", limit="1" * (250 << 10) + "x")  # the API server allows 256 KiB
    rig.spawn(bomb, "bomb", used_bytes=100 * MIB)
    greedy = rig.spawn(rig.add_pod("greedy", limit="1Gi"), "greedy", used_bytes=2 * GIB)

    enforcer = rig.start_enforcer()
    wait_until(lambda: not greedy.alive(), timeout=30, what="the greedy pod to be stopped")
    wait_until(
        lambda: "InvalidGPUMemoryLimit" in rig.event_reasons(bomb),
        timeout=15,
        what="the InvalidGPUMemoryLimit Event on the bomb pod",
    )

    assert greedy.received() == ["SIGTERM"]
    [event] = rig.pod_events(bomb)
    assert "longer than 64 characters" in event["message"]
    assert len(event["message"]) < 1000  # the value is shown shortened
    started = time.monotonic()
    assert enforcer.http("/healthz")[0] == 200
    assert time.monotonic() - started < 1.0  # the kubelet's default probe timeout
