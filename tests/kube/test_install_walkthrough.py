"""A newcomer's install, on a fresh real control plane: docs/install.md's
commands, run verbatim and in order, and the traps a first install fell into.

The walkthrough runs every fenced ``sh`` block of docs/install.md that follows a
``<!-- walkthrough -->`` line, command by command, through bash, from the repository root, with
only ``helm`` on PATH (no kubectl is built for the tests), against a control plane that has what
NVIDIA's GPU operator leaves on a cluster (GPU nodes labelled by GPU feature discovery, the
RuntimeClass ``nvidia``) and nothing of gpuguard's: no namespace ``gpuguard``, no ``gpu-operator``.
It must end with both DaemonSets rolled out and Ready on every GPU node, in enforce mode. README's
marked block must hold the same commands. So the docs cannot drift from what works.

Each trap gets a control plane of its own (seconds to start) and runs the documented install
command: without the RuntimeClass it must fail before creating anything, saying how to fix it;
without ``gpu-operator`` it must install (not leave a half-installed, failed release) and say
so, and the same command run again once the namespace exists must grant the agent NVIDIA's two
ConfigMaps; after a failed install (``--wait`` timed out: the namespace's Pod Security level
rejects the enforcer's pods) the same command run again must recover the release.

Binaries as in test_chart_install.py: etcd, kube-apiserver and helm from scripts/ensure-
testbin.sh; kube-controller-manager, kube-scheduler and kwok from scripts/ensure-controlplane.sh.
Missing, they skip locally and fail in CI. Every process is stopped by PID, also after a failure.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuguard.config import load_settings
from gpuguard.core.model import Mode
from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    KubeCluster,
    PlaneBinaries,
    control_plane,
    helm_binary,
    helm_env,
    plane_binaries,
    wait_until,
)
from rigs.kubefixtures import create_nvidia_runtime_class, ensure_namespace
from tests.chart_release import (
    GPU_TAINT,
    NAMESPACE,
    RELEASE,
    RELEASE_SELECTOR,
    gpu_operator_labels,
    is_ready,
    ready_nodes,
    release_objects,
)

REPO = Path(__file__).resolve().parents[2]
INSTALL_DOC = REPO / "docs" / "install.md"
README = REPO / "README.md"
WALKTHROUGH_MARK = "<!-- walkthrough -->"
TOOLS = frozenset({"helm"})
"""What a walkthrough command may run: the tests build helm, not kubectl."""

NVIDIA_NAMESPACE = "gpu-operator"
NVIDIA_CONFIG_MAPS = ("nvidia-time-slicing-config", "nvidia-mig-config")
DAEMONSETS = ("gpuguard", "gpuguard-agent")  # the enforcer's, the agent's
AGENT_USER = f"system:serviceaccount:{NAMESPACE}:gpuguard-agent"
GPU_NODES = {
    "gpu-a100-0": (gpu_operator_labels("NVIDIA-A100-SXM4-80GB", 8, 81920), [GPU_TAINT]),
    "gpu-t4-0": (gpu_operator_labels("Tesla-T4", 4, 15360), []),
}
CPU_NODE = "cpu-0"


# ---------------------------------------------------------------------------------------------
# The docs' commands


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """One shell command of a walkthrough block (continuation lines joined)."""

    text: str
    where: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def walkthrough_commands(path: Path) -> list[Command]:
    """The commands of every ``sh`` block marked ``<!-- walkthrough -->`` in ``path``, in
    order. A mark not followed by an ``sh`` fence is an error, not a silent skip."""
    lines = path.read_text().splitlines()
    commands: list[Command] = []
    for i, line in enumerate(lines):
        if line.strip() != WALKTHROUGH_MARK:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        assert fence.strip() == "```sh", (
            f"{path.name}:{i + 1}: {WALKTHROUGH_MARK} must be followed by a ```sh block"
        )
        indent = len(fence) - len(fence.lstrip())
        pending: list[str] = []
        start = 0
        j = i + 2
        while j < len(lines) and lines[j].strip() != "```":
            text = lines[j][indent:]
            if not pending and (not text.strip() or text.lstrip().startswith("#")):
                j += 1
                continue
            if not pending:
                start = j + 1
            pending.append(text.removesuffix("\\"))
            if not text.endswith("\\"):
                commands.append(Command(text=" ".join(pending), where=f"{path.name}:{start}"))
                pending = []
            j += 1
        assert j < len(lines), f"{path.name}:{i + 2}: unclosed ```sh block"
    return commands


def install_command() -> Command:
    """docs/install.md's first walkthrough command: the install."""
    commands = walkthrough_commands(INSTALL_DOC)
    assert commands, f"no {WALKTHROUGH_MARK} block in {INSTALL_DOC}"
    assert commands[0].argv[:2] == ["helm", "upgrade"], commands[0]
    return commands[0]


# ---------------------------------------------------------------------------------------------
# A fresh control plane


@dataclass(frozen=True, slots=True, kw_only=True)
class Binaries:
    plane: PlaneBinaries
    helm: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Fresh:
    """A fresh control plane with kwok GPU nodes, and a shell that has only helm on PATH."""

    cluster: KubeCluster
    plane: ControlPlane
    env: dict[str, str]

    def shell(self, command: Command, *, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        """``command`` verbatim, through bash, from the repository root."""
        tool = command.argv[0] if command.argv else ""
        assert tool in TOOLS, (
            f"{command.where}: a walkthrough command may run only {sorted(TOOLS)}, not {tool!r} "
            "(no kubectl is built for the tests)"
        )
        return self._run(["bash", "-euo", "pipefail", "-c", command.text], timeout)

    def run(self, argv: Sequence[str], *, timeout: float = 400) -> subprocess.CompletedProcess[str]:
        """``argv`` without a shell (a documented command with flags added)."""
        return self._run(list(argv), timeout)

    def _run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip

    def failure(self, done: subprocess.CompletedProcess[str]) -> str:
        return f"exit {done.returncode}\n{done.stdout}\n{done.stderr}\n{self.plane.logs()}"

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.cluster.admin_request("GET", path)
        except AdminRequestError as e:
            if e.code == 404:
                return None
            raise


@pytest.fixture(scope="module")
def binaries() -> Binaries:
    return Binaries(plane=plane_binaries(), helm=helm_binary())


@pytest.fixture
def fresh(binaries: Binaries, tmp_path: Path) -> Iterator[Fresh]:
    """Its own etcd, kube-apiserver, controller-manager, scheduler and kwok (stopped by PID),
    with the GPU nodes GPU feature discovery labelled and a CPU node; nothing else."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "helm").symlink_to(binaries.helm)
    with control_plane(tmp_path / "cluster", binaries.plane) as plane:
        cluster = plane.cluster
        env = helm_env(
            tmp_path / "home",
            f"{tools}:/usr/bin:/bin",
            KUBECONFIG=str(cluster.admin_kubeconfig),
        )
        for name, (labels, taints) in GPU_NODES.items():
            plane.create_fake_node(name, labels=labels, taints=taints)
        plane.create_fake_node(CPU_NODE, labels={"node.kubernetes.io/instance-type": "m5.large"})
        wait_until(
            lambda: ready_nodes(cluster) >= {*GPU_NODES, CPU_NODE},
            timeout=60,
            what="kwok to mark the nodes Ready",
        )
        yield Fresh(cluster=cluster, plane=plane, env=env)


# ---------------------------------------------------------------------------------------------
# What an install left


def release_status(fresh: Fresh) -> str | None:
    """The release's status as Helm records it (``None``: no release)."""
    done = fresh.run(["helm", "status", RELEASE, "-n", NAMESPACE, "-o", "json"], timeout=60)
    if done.returncode != 0:
        assert "not found" in done.stderr, fresh.failure(done)
        return None
    status: str = json.loads(done.stdout)["info"]["status"]
    return status


def pods_of(fresh: Fresh, daemonset: str) -> list[dict[str, Any]]:
    """The DaemonSet's pods, not being deleted (each DaemonSet's pods carry its name as
    ``app.kubernetes.io/name``)."""
    path = (
        f"/api/v1/namespaces/{NAMESPACE}/pods"
        f"?labelSelector=app.kubernetes.io/name={daemonset},{RELEASE_SELECTOR}"
    )
    pods: list[dict[str, Any]] = fresh.cluster.admin_request("GET", path)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def assert_rolled_out_and_ready_on_every_gpu_node(fresh: Fresh) -> None:
    """Both DaemonSets: their latest template on exactly one Ready pod per GPU node, none on
    the CPU node (what ``--wait`` promises when it returns)."""
    for name in DAEMONSETS:
        ds = fresh.cluster.admin_request(
            "GET", f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/{name}"
        )
        status = ds["status"]
        assert status.get("observedGeneration") == ds["metadata"]["generation"], (name, status)
        for key in ("desiredNumberScheduled", "currentNumberScheduled", "updatedNumberScheduled"):
            assert status.get(key) == len(GPU_NODES), (name, key, status)
        assert status.get("numberReady") == len(GPU_NODES), (name, status)
        assert status.get("numberMisscheduled", 0) == 0, (name, status)
        checksum = ds["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        pods = pods_of(fresh, name)
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(GPU_NODES), (name, pods)
        for pod in pods:
            assert is_ready(pod), (name, pod["metadata"]["name"], pod.get("status"))
            assert pod["metadata"]["annotations"]["checksum/config"] == checksum, (
                f"{pod['metadata']['name']} runs an older config than {name}'s template"
            )


def enforcement_mode(fresh: Fresh, tmp: Path) -> Mode:
    """The mode of the config.toml the release rendered, as gpuguard's own loader reads it."""
    config = fresh.cluster.admin_request(
        "GET", f"/api/v1/namespaces/{NAMESPACE}/configmaps/gpuguard-config"
    )
    path = tmp / "config.toml"
    path.write_text(config["data"]["config.toml"])
    mode: Mode = load_settings(config_path=path, environ={}).enforcement.mode
    return mode


def agent_may_read(fresh: Fresh, namespace: str, name: str) -> bool:
    """SubjectAccessReview: may the agent's ServiceAccount get/list/watch ConfigMap ``name``?"""
    allowed = []
    for verb in ("get", "list", "watch"):
        review = fresh.cluster.admin_request(
            "POST",
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": AGENT_USER,
                    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{NAMESPACE}"],
                    "resourceAttributes": {
                        "namespace": namespace,
                        "verb": verb,
                        "resource": "configmaps",
                        "name": name,
                    },
                },
            },
        )
        allowed.append(bool(review["status"].get("allowed")))
    assert len(set(allowed)) == 1, allowed
    return allowed[0]


# ---------------------------------------------------------------------------------------------
# The walkthrough


def test_readme_shows_the_same_install_commands_as_docs_install_md() -> None:
    readme = [c.argv for c in walkthrough_commands(README)]
    assert readme, f"no {WALKTHROUGH_MARK} block in README.md"
    assert readme == [c.argv for c in walkthrough_commands(INSTALL_DOC)]


@pytest.mark.apiserver
def test_docs_install_commands_run_verbatim_end_in_ready_daemonsets_in_enforce_mode(
    fresh: Fresh, tmp_path: Path
) -> None:
    """Done when: docs/install.md's commands, run in order on a fresh control plane,
    end in Ready DaemonSets in enforce mode, with no step the doc does not show."""
    create_nvidia_runtime_class(fresh.cluster)  # the GPU operator's
    commands = walkthrough_commands(INSTALL_DOC)
    assert len(commands) >= 2, commands  # install, then the switch to enforce
    for command in commands:
        done = fresh.shell(command)
        assert done.returncode == 0, f"{command.where}: {command.text}\n{fresh.failure(done)}"

    assert release_status(fresh) == "deployed"
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)
    for pod in pods_of(fresh, "gpuguard"):
        assert pod["spec"].get("runtimeClassName") == "nvidia"
    assert enforcement_mode(fresh, tmp_path) is Mode.ENFORCE


@pytest.mark.apiserver
def test_the_install_command_run_again_with_a_value_added_keeps_enforce_mode(
    fresh: Fresh, tmp_path: Path
) -> None:
    """The install command is the one the docs and NOTES say to run again (after a failure,
    after the GPU operator, with more values). Run after the switch to enforce with a value
    added, as an admin would, it must keep enforce: a plain ``helm upgrade --install`` with any
    ``--set`` or ``-f`` drops every earlier value, and the release would go back to audit."""
    create_nvidia_runtime_class(fresh.cluster)
    for command in walkthrough_commands(INSTALL_DOC):
        done = fresh.shell(command)
        assert done.returncode == 0, f"{command.where}: {command.text}\n{fresh.failure(done)}"
    done = fresh.run([*install_command().argv, "--set-string", "podLabels.team=ml-platform"])
    assert done.returncode == 0, fresh.failure(done)
    assert enforcement_mode(fresh, tmp_path) is Mode.ENFORCE
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)
    for pod in pods_of(fresh, "gpuguard"):
        assert pod["metadata"]["labels"].get("team") == "ml-platform", pod["metadata"]


# ---------------------------------------------------------------------------------------------
# The traps


@pytest.mark.apiserver
def test_without_the_runtime_class_the_install_fails_before_creating_anything_and_says_how(
    fresh: Fresh,
) -> None:
    """No RuntimeClass ``nvidia``: the enforcer's pods could never be created (the DaemonSet
    sat at 0 of N with an Event nobody reads). The install must refuse, create nothing, and
    name the fix; with ``runtimeClassName=""`` (NVIDIA's runtime the nodes' default) it runs."""
    command = install_command()
    done = fresh.shell(command, timeout=120)
    assert done.returncode != 0, f"installed without RuntimeClass nvidia:\n{fresh.failure(done)}"
    message = done.stderr
    assert 'RuntimeClass "nvidia" (value runtimeClassName) does not exist' in message, message
    assert "GPU operator" in message, message
    assert "container toolkit" in message, message
    assert '--set runtimeClassName=""' in message, message
    assert fresh.get(f"/api/v1/namespaces/{NAMESPACE}") is None, "the namespace was created"
    assert release_objects(lambda path: fresh.cluster.admin_request("GET", path)) == []

    done = fresh.run([*command.argv, "--set", "runtimeClassName="])
    assert done.returncode == 0, fresh.failure(done)
    assert release_status(fresh) == "deployed"
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)
    for pod in pods_of(fresh, "gpuguard"):
        assert "runtimeClassName" not in pod["spec"], pod["spec"]
    assert "runtimeClassName is empty" in done.stdout


@pytest.mark.apiserver
def test_without_nvidias_namespace_the_install_succeeds_and_running_it_again_grants_the_role(
    fresh: Fresh,
) -> None:
    """No ``gpu-operator`` namespace: the Role there failed the install after the DaemonSets
    were created (a failed release that ``helm install`` could not retry). Now the install
    succeeds without that Role and its NOTES say so; run again once the namespace exists, the
    same command grants the agent NVIDIA's two ConfigMaps."""
    create_nvidia_runtime_class(fresh.cluster)
    command = install_command()
    done = fresh.shell(command)
    assert done.returncode == 0, fresh.failure(done)
    assert release_status(fresh) == "deployed"
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)
    notes = " ".join(done.stdout.split())
    assert f"WARNING: namespace {NVIDIA_NAMESPACE} does not exist" in notes, done.stdout
    for name in NVIDIA_CONFIG_MAPS:
        assert f"{NVIDIA_NAMESPACE}/{name}" in notes, done.stdout
        assert not agent_may_read(fresh, NVIDIA_NAMESPACE, name)
    assert "helm upgrade --install" in notes

    ensure_namespace(fresh.cluster, NVIDIA_NAMESPACE)  # the GPU operator, installed later
    done = fresh.shell(command)
    assert done.returncode == 0, fresh.failure(done)
    assert release_status(fresh) == "deployed"
    # The namespace's warning is gone; the walkthrough sets no config.limits.default, whose
    # warning (unannotated GPU pods are unlimited) stays.
    assert "WARNING: namespace" not in done.stdout, done.stdout
    assert "WARNING: config.limits.default is not set" in done.stdout, done.stdout
    for name in NVIDIA_CONFIG_MAPS:
        assert agent_may_read(fresh, NVIDIA_NAMESPACE, name), name
    assert not agent_may_read(fresh, NVIDIA_NAMESPACE, "some-other-configmap")
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)


@pytest.mark.apiserver
def test_a_failed_install_is_recovered_by_running_the_same_command_again(fresh: Fresh) -> None:
    """An install that fails after creating objects leaves the release ``failed``; the
    documented command, run again once the cause is fixed, must recover it in place (``helm
    install`` refused: 'cannot reuse a name that is still in use'). The cause here: the
    namespace enforces Pod Security ``baseline``, which rejects the enforcer's pods (hostPID,
    host paths), so ``--wait`` times out."""
    create_nvidia_runtime_class(fresh.cluster)
    fresh.cluster.admin_request(
        "POST",
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": NAMESPACE,
                "labels": {"pod-security.kubernetes.io/enforce": "baseline"},
            },
        },
    )
    command = install_command()
    done = fresh.run([*command.argv, "--timeout=15s"])
    assert done.returncode != 0, (
        "the documented install returned 0 although the namespace rejects the enforcer's pods "
        f"(no --wait?):\n{fresh.failure(done)}"
    )
    assert release_status(fresh) == "failed"
    enforcer = fresh.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/daemonsets/gpuguard")
    assert enforcer is not None, "the failed install created no DaemonSet"
    assert enforcer["status"].get("currentNumberScheduled", 0) == 0, enforcer["status"]

    fresh.cluster.admin_request(
        "PATCH",
        f"/api/v1/namespaces/{NAMESPACE}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
        content_type="application/merge-patch+json",
    )
    done = fresh.shell(command)
    assert done.returncode == 0, fresh.failure(done)
    assert release_status(fresh) == "deployed"
    assert_rolled_out_and_ready_on_every_gpu_node(fresh)
