"""One real node: the chart installed with helm on a real kubelet + containerd + runc, and a real
tenant pod's container stopped by the enforcer pod and restarted by the kubelet.

What is real: etcd, kube-apiserver, kube-controller-manager (DaemonSet, node lifecycle,
EndpointSlice, garbage collector, ServiceAccount tokens), kube-scheduler, kubelet v1.37.2,
containerd v2.4.2 with runc v1.3.7 and the CNI bridge (rigs/kubelet/node.py), the gpuguard image
built from the repo's Dockerfile by BuildKit (``make image``) and imported into containerd, the
chart as ``helm install`` renders it (enforce mode, its security context: hostPID, CAP_KILL only,
a read-only cgroup mount, a non-root agent, the kubelet's pod-resources directory mounted
read-only), a device plugin speaking the kubelet's v1beta1 gRPC API that advertises
``nvidia.com/gpu`` (time-sliced replicas), the kubelet's pod-resources socket that reports what
it allocated, ``helm upgrade`` rolling the enforcer with a changed config, and the tenants'
processes. What
stands in: the GPU. NVML is the C stand-in (tests/nvml_stub), reaching the enforcer's container
the way the real library does, through the ``nvidia`` runtime handler (a runc wrapper, like
NVIDIA's container runtime, rigs/kubelet/nvidia-container-runtime); the test writes its scenario
with the real host PIDs of the tenant containers. docs/real-node.md says what this proves and
what it does not. The world is tests/node/world.py, what the steps read tests/node/reads.py.

Needs root, the node binaries (scripts/ensure-node.sh), the control plane (make gobins), helm and
BuildKit (``make image``). Missing, the module skips locally and fails in CI (rigs/prereq.py).
``GPUGUARD_NODE_ROUNDS=2`` runs the whole scenario twice in one session (to show a run leaves
nothing behind for the next); ``GPUGUARD_NODE_STEPS="step_… step_…"`` runs only those steps (and
the uninstall; the pod-resources and unallocated steps create the tenants they need).
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from rigs.controlplane import wait_until
from rigs.kubelet import gpu
from rigs.kubelet.cluster import GPU_UUID, NODE, REPLICAS, Binaries
from tests.chart_release import (
    AGENT_SELECTOR,
    ENFORCER_SELECTOR,
    NAMESPACE,
    RELEASE,
    release_objects,
)
from tests.node.reads import (
    exec_in,
    inspect_rows,
    kubelet_answer,
    last_termination,
    lifetime,
    main_process,
    metrics_url,
    only_pod,
    reasons_and_messages,
    sample,
    scrape,
    wait_running,
    watch_restarts,
)
from tests.node.world import (
    GRACE,
    TENANTS,
    TERMINATION_TIMEOUT,
    GiB,
    Tenant,
    World,
    build_binaries,
    container_status,
    ensure_tenant,
    pod_pids,
    pod_resources_socket,
    real_world,
    tenant_pod,
    upgrade_release,
)

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.node]

OTHER_NODE = "gpu-node-2"
FENCE = "ValidatingAdmissionPolicy 'gpuguard-agent-node-fence'"
ROUNDS = int(os.environ.get("GPUGUARD_NODE_ROUNDS", "1"))
ONLY = frozenset(os.environ.get("GPUGUARD_NODE_STEPS", "").split())
"""While developing: run only these steps (and the uninstall); empty: every step."""

HOLD_GPU = "import os, time\nfd = os.open('/dev/nvidia0', os.O_RDWR)\ntime.sleep(10**6)\n"
"""A training process as it is usually written: holds the GPU, installs no SIGTERM handler."""
CATCH_SIGTERM = (
    "import os, signal, sys, time\n"
    "def bye(*_):\n"
    "    print('caught SIGTERM', flush=True)\n"
    "    sys.exit(143)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "fd = os.open('/dev/nvidia0', os.O_RDWR)\n"
    "time.sleep(10**6)\n"
)
"""One that saves its state on SIGTERM (a checkpointing trainer)."""

GREEDY = Tenant("greedy", "1Gi", 3 * GiB, ("python3", "-c", HOLD_GPU))
NEIGHBOUR = Tenant("neighbour", "4Gi", 2 * GiB, ("python3", "-c", HOLD_GPU))
CATCHER = Tenant("catcher", "1Gi", 3 * GiB, ("python3", "-c", CATCH_SIGTERM))
SHELL = Tenant(
    "shell",
    "1Gi",
    3 * GiB,
    # dash forks the worker (a command follows it) and forwards no signal: PID 1 is the shell.
    ("sh", "-c", f'python3 -c "{HOLD_GPU}"; echo worker ended'),
)
GPU_TENANTS = (GREEDY, NEIGHBOUR, CATCHER, SHELL)
"""Each requests one nvidia.com/gpu: together every replica the device plugin advertises."""
STOWAWAY = Tenant("stowaway", "4Gi", 1 * GiB, ("python3", "-c", HOLD_GPU), gpus=0)
"""Requests no GPU, sees it anyway (``NVIDIA_VISIBLE_DEVICES=all``) and opens it; under its
limit, so only the missing allocation is held against it."""


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    return build_binaries()


# ---------------------------------------------------------------------------------------------
# The scenario, step by step (each asserts what a user would check)

CAP_KILL = 1 << 5


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def step_the_chart_runs_with_its_security_context(world: World) -> None:
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    agent = only_pod(world, AGENT_SELECTOR)
    for pod in (enforcer, agent):
        assert pod["spec"]["nodeName"] == NODE
        assert container_status(pod).get("ready") is True, pod["status"]
    # What the kernel says of the running processes, not what the manifest asks for.
    enforcer_pid = main_process(enforcer, "gpuguard")
    status = status_fields(enforcer_pid)
    assert int(status["CapEff"], 16) == CAP_KILL, status["CapEff"]
    assert int(status["CapBnd"], 16) == CAP_KILL, status["CapBnd"]
    assert status["NSpid"].split() == [str(enforcer_pid)], "hostPID: one PID namespace, the host's"
    assert status["Uid"].split()[0] == "0"
    cgroup_mounts = [
        line.split()
        for line in Path(f"/proc/{enforcer_pid}/mountinfo").read_text().splitlines()
        if line.split()[4].startswith("/host/sys/fs/cgroup")
    ]
    assert cgroup_mounts, "the cgroup hostPath is mounted"
    assert all("ro" in m[5].split(",") for m in cgroup_mounts), cgroup_mounts
    agent_status = status_fields(main_process(agent, "gpuguard"))
    assert agent_status["Uid"].split()[0] == "65534"
    assert int(agent_status["CapEff"], 16) == 0


def step_the_offender_is_stopped_and_restarted_while_its_neighbours_live(world: World) -> None:
    assert world.feeder is not None
    assert world.host_process is not None
    for tenant in (GREEDY, NEIGHBOUR):
        world.api(
            "POST", f"/api/v1/namespaces/{TENANTS}/pods", tenant_pod(tenant, world.base_image)
        )
        world.feeder.add(tenant)
    neighbour = wait_running(world, NEIGHBOUR)
    greedy = wait_running(world, GREEDY)
    neighbour_pids = pod_pids(neighbour)
    pauses = {
        pid for pod in (greedy, neighbour) for pid, c in pod_pids(pod).items() if c == "pause"
    }
    assert len(pauses) == 2, "one pause process per pod sandbox"

    greedy, reasons = watch_restarts(world, GREEDY, restarts=2, timeout=120)
    terminated = last_termination(greedy)
    assert terminated.get("exitCode") == 137, terminated
    events = reasons_and_messages(world, GREEDY.name)
    assert "GPUMemoryLimitExceeded" in events, events
    assert "GPUProcessKilled" in events, events
    assert any("SIGKILL" in m for m in events["GPUProcessKilled"]), events["GPUProcessKilled"]
    wait_until(
        lambda: "CrashLoopBackOff" in watch_restarts(world, GREEDY, restarts=2, timeout=1)[1],
        timeout=60,
        interval=0.5,
        what="greedy in CrashLoopBackOff",
    )
    del reasons

    neighbour_now = world.pod(TENANTS, NEIGHBOUR.name)
    assert container_status(neighbour_now)["restartCount"] == 0
    assert pod_pids(neighbour_now) == neighbour_pids, "the neighbour's processes are the same"
    assert not reasons_and_messages(world, NEIGHBOUR.name).keys() & {
        "GPUMemoryLimitExceeded",
        "GPUProcessKilled",
    }
    for pid in pauses:
        assert Path(f"/proc/{pid}").exists(), f"pause {pid} was stopped"
    assert world.host_process.poll() is None, "the host process outside any pod was signalled"
    assert not world.feeder.errors, world.feeder.errors


def step_signals_land(world: World) -> None:
    """A PID 1 that catches SIGTERM gets it (and the timeout); one that does not, and a shell
    entrypoint that forwards nothing to a plain worker, get SIGKILL at once (no pointless wait
    for a SIGTERM the kernel drops), said in the Event."""
    assert world.feeder is not None
    for tenant in (CATCHER, SHELL):
        world.api(
            "POST", f"/api/v1/namespaces/{TENANTS}/pods", tenant_pod(tenant, world.base_image)
        )
        world.feeder.add(tenant)
    catcher, _ = watch_restarts(world, CATCHER, restarts=1, timeout=90)
    shell, _ = watch_restarts(world, SHELL, restarts=1, timeout=90)

    caught = last_termination(catcher)
    assert caught.get("exitCode") == 143, caught  # its handler ran: sys.exit(143)
    killed = last_termination(shell)
    assert killed.get("exitCode") == 137, killed
    # Listed, over the limit, two samples, the grace: then the stop. Waiting for the
    # termination timeout would put it past GRACE + TERMINATION_TIMEOUT.
    for name, terminated in (("catcher", caught), ("shell", killed)):
        assert lifetime(terminated) < GRACE + TERMINATION_TIMEOUT, (name, terminated)
    catcher_events = reasons_and_messages(world, CATCHER.name)["GPUProcessKilled"]
    assert any(m.count("SIGTERM to PID") == 1 for m in catcher_events), catcher_events
    shell_events = reasons_and_messages(world, SHELL.name)["GPUProcessKilled"]
    assert any("SIGKILL to PID" in m and "SIGTERM to PID" in m for m in shell_events), shell_events


def step_metrics_are_scraped_from_the_pod_ip_through_the_service(world: World) -> None:
    """As Prometheus finds them: the chart's headless Service's EndpointSlices name the
    enforcer pod's IP (on the CNI bridge) and the metrics port."""
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    url = metrics_url(world, enforcer)
    assert url.split("//")[1].startswith(enforcer["status"]["podIP"] + ":"), url
    text = scrape(world, url)
    kills = sample(text, "gpuguard_kills_total")
    assert kills is not None, text
    assert kills >= 2, kills
    used = sample(text, "gpuguard_pod_gpu_memory_used_bytes", namespace=TENANTS, pod="neighbour")
    assert used == NEIGHBOUR.used_bytes, used
    limit = sample(text, "gpuguard_pod_gpu_memory_limit_bytes", namespace=TENANTS, pod="neighbour")
    assert limit == 4 * GiB, limit
    assert sample(text, "gpuguard_enforcement_active") == 1
    unattributed = sample(text, "gpuguard_gpu_memory_unattributed_bytes", UUID=GPU_UUID)
    assert unattributed is not None, text
    assert unattributed >= 10 * GiB, unattributed


def pod_token(world: World, pod: Mapping[str, Any]) -> str:
    """The agent's real token: the one the kubelet projected into its pod, bound to the pod
    (and so to the node)."""
    volumes = world.node.kubelet_root / "pods" / pod["metadata"]["uid"] / "volumes"
    tokens = sorted(volumes.glob("kubernetes.io~projected/kube-api-access-*/token"))
    assert len(tokens) == 1, tokens
    return str(tokens[0].read_text())


def as_token(world: World, token: str, method: str, path: str, body: object) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{world.cluster.server}{path}",
        method=method,
        data=json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/strategic-merge-patch+json"
            if method == "PATCH"
            else "application/json",
        },
    )
    # The CA only: with the admin's client certificate the API server would not read the token.
    ca_only = ssl.create_default_context(cafile=str(world.cluster.pki["ca.crt"]))
    try:
        with urllib.request.urlopen(request, context=ca_only, timeout=10) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()


def step_the_agent_labels_its_node_through_the_fence(world: World) -> None:
    """The agent, with the token the kubelet gave its pod, writes the sharing label on the real
    Node (through the shipped admission fence); the same token may not touch another Node."""
    label = "nvidia.com/device-plugin.config"
    wait_until(
        lambda: (
            world.api("GET", f"/api/v1/nodes/{NODE}")["metadata"]["labels"].get(label) == "slice-4"
        ),
        timeout=60,
        interval=0.5,
        what=f"the agent's {label}=slice-4 on {NODE}",
    )
    token = pod_token(world, only_pod(world, AGENT_SELECTOR))
    code, body = as_token(
        world,
        token,
        "POST",
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert code == 201, body
    extra = json.loads(body)["status"]["userInfo"].get("extra", {})
    assert extra.get("authentication.kubernetes.io/node-name") == [NODE], body
    world.plane.create_fake_node(OTHER_NODE)
    code, body = as_token(
        world,
        token,
        "PATCH",
        f"/api/v1/nodes/{OTHER_NODE}",
        {"metadata": {"labels": {label: "slice-4"}}},
    )
    assert code == 403, (code, body)
    assert FENCE in body, body
    # As the agent writes: field manager gpuguard (the fence admits no other manager's entry).
    code, body = as_token(
        world,
        token,
        "PATCH",
        f"/api/v1/nodes/{NODE}?fieldManager=gpuguard",
        {"metadata": {"labels": {label: "slice-4"}}},
    )
    assert code == 200, (code, body)


def step_explain_inside_the_enforcer_pod_names_the_tenants_container(world: World) -> None:
    """The command docs/install.md and ``gpuguard --help`` give, as written."""
    neighbour = world.pod(TENANTS, NEIGHBOUR.name)
    pid = main_process(neighbour, "python3")
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    out, _ = exec_in(world, enforcer, "enforcer", ["gpuguard", "explain", str(pid), "--json"])
    got = json.loads(out)
    container_id = container_status(neighbour)["containerID"].removeprefix("containerd://")
    assert got["pid"] == pid, got
    assert got["is_pod"] is True, got
    assert got["pod_uid"] == neighbour["metadata"]["uid"], got
    assert got["container_id"] == container_id, got
    # The kubelet's cgroupfs driver names containers by their bare ID (no cri-containerd-
    # prefix, unlike the systemd driver): the cgroup does not say which runtime, and explain
    # says so rather than guess.
    assert got["runtime"] is None, got
    # This hybrid host's cgroup file has the v1 lines and a ``0::`` line naming the same path;
    # gpuguard reads the unified one when it names the container.
    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    unified = f"\n0::/{world.node.cgroup_root}/kubepods/"
    assert got["cgroup_version"] == (2 if unified in "\n" + cgroup else 1), cgroup
    assert got["pod_found"] is True, got
    assert got["pod_namespace"] == TENANTS, got
    assert got["pod_name"] == NEIGHBOUR.name, got
    assert got["container_name"] == "train", got
    assert got["limit_bytes"] == 4 * GiB, got


def step_the_kubelets_pod_resources_reach_gpuguard_through_its_socket(world: World) -> None:
    """The device plugin's ``<uuid>::<k>`` replicas as the real kubelet answers them on its
    pod-resources socket: read here, and by ``gpuguard inspect`` in the enforcer pod through the
    chart's read-only mount of the kubelet's directory (``kubelet.podResourcesDir``)."""
    for tenant in GPU_TENANTS:
        ensure_tenant(world, tenant)
    wait_running(world, NEIGHBOUR)
    enforcer = only_pod(world, ENFORCER_SELECTOR)
    mounted = {v["name"]: v.get("hostPath", {}).get("path") for v in enforcer["spec"]["volumes"]}
    assert mounted["pod-resources"] == str(pod_resources_socket(world.node).parent), mounted

    held = kubelet_answer(world, GPU_TENANTS)
    for name, devices in held.items():
        assert [d for d, _ in devices] == [f"train {gpu.RESOURCE}"], (name, held)
    # One replica each, four pods: every ID the plugin advertises, none twice.
    ids = sorted(i for devices in held.values() for _, i in devices)
    assert ids == sorted(gpu.advertised_device_ids([GPU_UUID], REPLICAS)), held

    rows = inspect_rows(world, enforcer, NEIGHBOUR.name)
    for row in rows:
        assert row["uuid"] == GPU_UUID, row
        # Only an answer naming this GPU (the replica's <uuid>::<k>) reads "allocated": without
        # the socket it is unknown, with the pod listed without devices not_allocated.
        assert row["allocation"] == "allocated", (row["allocation"], row["allocated"])
        # The neighbour's own replica, as the kubelet's answer holds it.
        (neighbour_id,) = [i for _, i in held[NEIGHBOUR.name]]
        assert row["allocated"] == f"{gpu.RESOURCE} {neighbour_id} (container train)", row


def reported_unallocated(world: World, pod: str) -> list[dict[str, Any]]:
    return [e for e in world.events(TENANTS, pod) if e["reason"] == "GPUUsedWithoutAllocation"]


def step_gpu_use_without_an_allocation_is_reported_and_left_running(world: World) -> None:
    """``enforcement.unallocated = report`` (the chart's default): a pod that requested no GPU
    but opened it gets a Warning Event, is counted and shown by inspect, and keeps running."""
    assert "unallocated" not in world.values["config"]["enforcement"], world.values
    ensure_tenant(world, STOWAWAY)
    pids = pod_pids(wait_running(world, STOWAWAY))
    wait_until(
        lambda: bool(reported_unallocated(world, STOWAWAY.name)),
        timeout=60,
        interval=0.5,
        what="GPUUsedWithoutAllocation on the stowaway",
    )
    seen = time.monotonic()
    event = reported_unallocated(world, STOWAWAY.name)[0]
    assert event["type"] == "Warning", event
    assert f"GPU 0 ({GPU_UUID})" in event["message"], event
    assert "the pod was allocated: no GPU" in event["message"], event

    enforcer = only_pod(world, ENFORCER_SELECTOR)
    url = metrics_url(world, enforcer)
    wait_until(
        lambda: (
            sample(scrape(world, url), "gpuguard_unallocated_gpu_use_total", UUID=GPU_UUID) == 1
        ),
        timeout=15,
        interval=0.5,
        what="gpuguard_unallocated_gpu_use_total 1 (the stowaway, once)",
    )
    rows = inspect_rows(world, enforcer, STOWAWAY.name)
    assert [(r["allocation"], r["allocated"]) for r in rows] == [("not_allocated", "no GPU")], rows

    # Past the time a stop would have taken (two listings and the grace; no SIGTERM handler).
    time.sleep(max(0.0, seen + 3 * GRACE - time.monotonic()))
    now = world.pod(TENANTS, STOWAWAY.name)
    assert container_status(now)["restartCount"] == 0, container_status(now)
    assert pod_pids(now) == pids, "the stowaway's processes are the same"
    assert not reasons_and_messages(world, STOWAWAY.name).keys() & {
        "GPUProcessKilled",
        "GPUMemoryLimitExceeded",
    }
    assert not reported_unallocated(world, NEIGHBOUR.name), "the neighbour has its replica"


def step_with_unallocated_stop_the_stowaway_is_stopped_and_its_neighbour_lives(
    world: World,
) -> None:
    """``helm upgrade`` with ``config.enforcement.unallocated=stop``: the enforcer pod rolls
    with the new config and stops the stowaway's container (the kubelet restarts it); the
    neighbour, on the same GPU with its replica, keeps its processes."""
    for tenant in (NEIGHBOUR, STOWAWAY):
        ensure_tenant(world, tenant)
    neighbour_pids = pod_pids(wait_running(world, NEIGHBOUR))
    wait_running(world, STOWAWAY)
    before = only_pod(world, ENFORCER_SELECTOR)["metadata"]["uid"]

    t = time.monotonic()
    done = upgrade_release(world, {"config": {"enforcement": {"unallocated": "stop"}}})
    assert done.returncode == 0, done.stdout + done.stderr
    rolled = time.monotonic() - t
    assert only_pod(world, ENFORCER_SELECTOR)["metadata"]["uid"] != before, "the enforcer rolled"
    stowaway, _ = watch_restarts(world, STOWAWAY, restarts=1, timeout=60)
    print(f"helm upgrade --wait {rolled:.1f}s, stowaway stopped {time.monotonic() - t:.1f}s")

    assert last_termination(stowaway).get("exitCode") == 137, last_termination(stowaway)
    events = reasons_and_messages(world, STOWAWAY.name)
    assert any("enforcement.unallocated = stop" in m for m in events["GPUUsedWithoutAllocation"])
    assert any("used without an allocation" in m for m in events["GPUProcessKilled"]), events
    assert "GPUMemoryLimitExceeded" not in events, events

    neighbour = world.pod(TENANTS, NEIGHBOUR.name)
    assert container_status(neighbour)["restartCount"] == 0, container_status(neighbour)
    assert pod_pids(neighbour) == neighbour_pids, "the neighbour's processes are the same"
    assert not reasons_and_messages(world, NEIGHBOUR.name).keys() & {
        "GPUUsedWithoutAllocation",
        "GPUProcessKilled",
    }


def enforced_condition(world: World) -> dict[str, Any] | None:
    """The Node's ``GPUMemoryEnforced`` condition, as the API server has it."""
    node = world.api("GET", f"/api/v1/nodes/{NODE}")
    found = [c for c in node["status"].get("conditions", []) if c["type"] == "GPUMemoryEnforced"]
    return found[0] if found else None


def wait_condition(world: World, status: str, reason: str) -> dict[str, Any]:
    wait_until(
        lambda: (
            (c := enforced_condition(world)) is not None
            and (c["status"], c["reason"]) == (status, reason)
        ),
        timeout=60,
        interval=0.5,
        what=f"GPUMemoryEnforced {status}/{reason} on the Node",
    )
    condition = enforced_condition(world)
    assert condition is not None
    return condition


def step_the_nodes_condition_flips_with_the_enforcers_mode(world: World) -> None:
    """The enforcer, through its fenced ``patch`` of ``nodes/status`` with the token the kubelet
    projects, says on its real Node whether it enforces: ``True``/``Enforcing`` in enforce
    mode, ``False``/``AuditMode`` after ``helm upgrade`` to audit mode, and back; the kubelet's
    own conditions stay as the kubelet writes them."""
    assert world.values["enforcement"]["mode"] == "enforce", world.values
    enforcing = wait_condition(world, "True", "Enforcing")
    t = time.monotonic()
    done = upgrade_release(world, {"enforcement": {"mode": "audit"}})
    assert done.returncode == 0, done.stdout + done.stderr
    audit = wait_condition(world, "False", "AuditMode")
    print(f"GPUMemoryEnforced False/AuditMode {time.monotonic() - t:.1f}s after helm upgrade")
    assert audit["lastTransitionTime"] >= enforcing["lastTransitionTime"], (enforcing, audit)
    done = upgrade_release(world, {"enforcement": {"mode": "enforce"}})
    assert done.returncode == 0, done.stdout + done.stderr
    wait_condition(world, "True", "Enforcing")
    node = world.api("GET", f"/api/v1/nodes/{NODE}")
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert [c["status"] for c in ready] == ["True"], ready


def step_helm_uninstall_leaves_no_gpuguard_object(world: World) -> None:
    done = world.helm_run("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "2m")
    assert done.returncode == 0, done.stdout + done.stderr
    wait_until(
        lambda: not release_objects(lambda path: world.api("GET", path)),
        timeout=60,
        interval=0.5,
        what="no release object",
    )


STEPS = (
    step_the_chart_runs_with_its_security_context,
    step_the_offender_is_stopped_and_restarted_while_its_neighbours_live,
    step_signals_land,
    step_metrics_are_scraped_from_the_pod_ip_through_the_service,
    step_the_agent_labels_its_node_through_the_fence,
    step_explain_inside_the_enforcer_pod_names_the_tenants_container,
    step_the_kubelets_pod_resources_reach_gpuguard_through_its_socket,
    step_gpu_use_without_an_allocation_is_reported_and_left_running,
    step_with_unallocated_stop_the_stowaway_is_stopped_and_its_neighbour_lives,
    step_the_nodes_condition_flips_with_the_enforcers_mode,
    step_helm_uninstall_leaves_no_gpuguard_object,
)


@pytest.mark.parametrize("round_", range(1, ROUNDS + 1))
def test_the_chart_on_a_real_node_stops_the_offender_and_leaves_nothing_behind(
    binaries: Binaries, tmp_path: Path, round_: int
) -> None:
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with real_world(tmp_path, binaries) as world:
        node = world.node
        timings["ready"] = time.monotonic() - t0
        for step in STEPS:
            if ONLY and step.__name__ not in ONLY and "uninstall" not in step.__name__:
                continue
            t = time.monotonic()
            try:
                step(world)
            except (AssertionError, pytest.fail.Exception) as e:
                # wait_until's timeouts are pytest.fail's: with the logs too.
                raise AssertionError(f"{step.__name__}: {e}\n{world.diagnostics()}") from e
            timings[step.__name__.removeprefix("step_")] = time.monotonic() - t
    left = node.leftovers()
    assert not left, f"round {round_} left behind: {left}"
    print(f"round {round_}: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
