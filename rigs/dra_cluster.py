"""A DRA control plane for the integration rig: the real kube-apiserver, kube-controller-manager
(with the ResourceClaim controller) and kube-scheduler v1.37.2, kwok playing the kubelet of one
GPU node, and the objects NVIDIA's DRA driver and a tenant would create, for
``tests/integration/test_dra.py`` and ``scripts/dra_demo.py``.

Owns: ``DraCluster`` (its own etcd, API server and ``rigs.controlplane.DRAControlPlane``, started
and stopped by PID: the session cluster of ``rigs/kubefixtures.py`` stays controller-free);
publishing the DeviceClass and the node's ResourceSlice (bodies from ``rigs/dra_objects.py``,
shared with the scale benchmark's DRA mode); claim templates asking for a memory share; pods
the real scheduler places on the node; and
``running_pod``, which waits for kwok to mark a pod Running and then reports its container's
ID as kubelet would (the rig's workers sit in the cgroup that ID names). ``DraRig``: the
integration ``Rig`` whose enforcer config may carry a cluster default.

The GPUs are the rig's (``rig.GPU_UUIDS``, 80 GiB each): device ``gpu-<i>`` is the stand-in's
GPU ``i``.

Must not: touch the session cluster, or leave a process behind (``close`` stops each by PID).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rigs import dra_objects
from rigs.cgroups import kernel_problem
from rigs.controlplane import (
    AdminRequestError,
    ControlPlane,
    DRAControlPlane,
    KubeCluster,
    plane_binaries,
    wait_until,
)
from rigs.kubefixtures import (
    RBAC_MANIFEST,
    SA_NAME,
    SA_NAMESPACE,
    apply_manifest,
    ensure_namespace,
)
from rigs.node import GPU_TOTAL_BYTES, GPU_UUIDS, PodInfo, Rig, rig_on_fresh_tree
from rigs.prereq import require

RESOURCE_API = dra_objects.RESOURCE_API
GPU_MEMORY = dra_objects.memory_quantity(GPU_TOTAL_BYTES)
"""The slice's ``memory`` capacity: the rig's GPUs' total in Mi."""


@dataclass(slots=True)
class DraCluster:
    """etcd, kube-apiserver, the controllers, the scheduler and kwok; the enforcer's RBAC."""

    cluster: KubeCluster
    plane: ControlPlane

    def close(self) -> None:
        try:
            self.plane.close()
        finally:
            self.cluster.close()

    # -- requests ------------------------------------------------------------------------------

    def get(self, path: str) -> dict[str, Any]:
        return self.cluster.admin_request("GET", path)

    def post(self, path: str, body: Mapping[str, object]) -> dict[str, Any]:
        return self.cluster.admin_request("POST", path, body)

    def gone(self, path: str) -> bool:
        try:
            self.get(path)
        except AdminRequestError as e:
            if e.code == 404:
                return True
            raise
        return False

    def kubeconfig(self, server: str | None = None) -> Path:
        """The enforcer's ServiceAccount (manifests/rbac.yaml, as applied at start)."""
        return self.cluster.kubeconfig_for_sa(SA_NAMESPACE, SA_NAME, server=server)

    # -- the driver's side ---------------------------------------------------------------------

    def add_gpu_node(self, name: str) -> dict[str, Any]:
        """A kwok node, Ready, and the ResourceSlice the driver's kubelet plugin publishes."""
        node = self.plane.create_fake_node(name)
        wait_until(
            lambda: _ready(self.get(f"/api/v1/nodes/{name}")),
            timeout=60,
            what=f"kwok to mark {name} Ready",
        )
        self.publish_slice(node)
        return node

    def publish_slice(self, node: Mapping[str, Any], generation: int = 1) -> dict[str, Any]:
        """One slice holding all the node's GPUs (``GPU_UUIDS``), owned by the Node."""
        body = dra_objects.nvidia_slice(node, GPU_UUIDS, GPU_MEMORY, generation)
        return self.post(f"{RESOURCE_API}/resourceslices", body)

    def publish_dynamic_mig_slices(self, node_name: str, generation: int) -> None:
        """Replace the node's slices by those the driver publishes with its ``DynamicMIG``
        feature on (``dra_objects.dynamic_mig_slices``): a full GPU's ``memory`` is then the
        largest MIG profile's, less than the rig's GPUs have."""
        node = self.get(f"/api/v1/nodes/{node_name}")
        self.delete_slices(node_name)
        for body in dra_objects.dynamic_mig_slices(node, GPU_UUIDS, generation=generation):
            self.post(f"{RESOURCE_API}/resourceslices", body)

    def node_slices(self, node: str) -> list[dict[str, Any]]:
        found = self.get(f"{RESOURCE_API}/resourceslices?fieldSelector=spec.nodeName={node}")
        return list(found.get("items") or [])

    def delete_slices(self, node: str) -> None:
        for s in self.node_slices(node):
            self.cluster.admin_request(
                "DELETE", f"{RESOURCE_API}/resourceslices/{s['metadata']['name']}"
            )

    def publish_static_mig_slice(
        self,
        node_name: str,
        generation: int,
        instances: list[tuple[dra_objects.MigProfile, int, str]],
    ) -> None:
        """Replace the node's slice by one with static MIG: GPU 0 whole, GPU 1 cut into
        ``instances`` (``(profile, placement start, MIG UUID)``), as the driver publishes them
        (``dra_objects.static_mig_slice``)."""
        node = self.get(f"/api/v1/nodes/{node_name}")
        self.delete_slices(node_name)
        body = dra_objects.static_mig_slice(
            node, GPU_UUIDS[1], 1, instances, full_gpus=[(0, GPU_UUIDS[0], GPU_MEMORY)]
        )
        body["spec"]["pool"]["generation"] = generation
        self.post(f"{RESOURCE_API}/resourceslices", body)

    # -- the tenant's side ---------------------------------------------------------------------

    def add_template(
        self, namespace: str, name: str, memory: str | None, *, gpu: int | None = None
    ) -> dict[str, Any]:
        """A ResourceClaimTemplate for one memory share of a ``gpu.nvidia.com`` GPU (``gpu``:
        only GPU ``gpu``, chosen by its ``uuid`` attribute, as a user pins a model; ``memory``
        ``None``: the whole GPU)."""
        return self.post(
            f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates",
            dra_objects.claim_template(namespace, name, memory, _uuid(gpu)),
        )

    def add_mig_template(
        self, namespace: str, name: str, memory: str | None, selector: str
    ) -> dict[str, Any]:
        """A ResourceClaimTemplate for a share of the MIG device ``selector`` picks."""
        return self.post(
            f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates",
            dra_objects.mig_claim_template(namespace, name, memory, selector),
        )

    def add_claim(
        self, namespace: str, name: str, memory: str, *, gpu: int | None = None
    ) -> dict[str, Any]:
        """A ResourceClaim the tenant creates itself (pods name it: ``resourceClaimName``)."""
        return self.post(
            f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims",
            dra_objects.resource_claim(namespace, name, memory, gpu_uuid=_uuid(gpu)),
        )

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        template: str | None = None,
        claim: str | None = None,
    ) -> dict[str, Any]:
        """A pod with one container ``main`` using the claim ``gpu`` (made from ``template``,
        or the tenant's ``claim``), left to the real scheduler (only ``node`` fits it)."""
        return self.post(
            f"/api/v1/namespaces/{namespace}/pods",
            dra_objects.claim_pod(namespace, name, node=node, template=template, claim=claim),
        )

    def running_pod(self, namespace: str, name: str, *, timeout: float = 60.0) -> PodInfo:
        """Wait until the scheduler placed the pod and kwok runs it, then report its container
        ``main`` with a containerd ID, as kubelet does once the runtime started it (kwok does
        not invent IDs); the rig's workers run in that ID's cgroup."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        wait_until(
            lambda: self.get(path).get("status", {}).get("phase") == "Running",
            timeout=timeout,
            what=f"pod {name} scheduled, allocated and Running",
        )
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        self.cluster.set_container_statuses(
            namespace, name, [{"name": "main", "containerID": f"containerd://{cid}"}]
        )
        pod = self.get(path)
        return PodInfo(namespace=namespace, name=name, uid=pod["metadata"]["uid"], container_id=cid)

    def pod_claim(self, namespace: str, pod: str) -> dict[str, Any]:
        """The ResourceClaim behind the pod's claim ``gpu`` (generated or the tenant's)."""
        p = self.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        entry = p["spec"]["resourceClaims"][0]
        name = entry.get("resourceClaimName")
        if name is None:
            statuses = p.get("status", {}).get("resourceClaimStatuses") or []
            name = next(s["resourceClaimName"] for s in statuses if s["name"] == entry["name"])
        return self.get(f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims/{name}")

    def shares(self, namespace: str, pod: str) -> list[Share]:
        return claim_shares(self.pod_claim(namespace, pod))


@dataclass(frozen=True, slots=True)
class Share:
    """One allocation result, as the scheduler wrote it."""

    claim: str
    device: str
    share_id: str
    memory: str

    @property
    def gpu(self) -> int:
        """The stand-in's GPU index: device ``gpu-<i>`` is GPU ``i``."""
        return int(self.device.removeprefix("gpu-"))


def claim_shares(claim: Mapping[str, Any]) -> list[Share]:
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {})
    return [
        Share(
            claim=claim["metadata"]["name"],
            device=r["device"],
            share_id=r.get("shareID", ""),
            memory=(r.get("consumedCapacity") or {}).get("memory", ""),
        )
        for r in results.get("results") or []
    ]


def _uuid(gpu: int | None) -> str | None:
    """The rig's GPU ``gpu`` (``None``: any)."""
    return None if gpu is None else GPU_UUIDS[gpu]


def _ready(node: Mapping[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def start_dra_cluster(workdir: Path) -> DraCluster:
    """Build or find the binaries (``require``: skip locally, fail under CI=true), start the
    whole control plane, apply manifests/rbac.yaml and the DeviceClass."""
    binaries = plane_binaries()
    cluster = KubeCluster(workdir, binaries.cluster)
    plane = DRAControlPlane(cluster, binaries.plane)
    dra = DraCluster(cluster=cluster, plane=plane)
    try:
        cluster.start()
        plane.start()
        ensure_namespace(cluster, SA_NAMESPACE)
        ensure_namespace(cluster, "gpu-operator")
        apply_manifest(cluster, RBAC_MANIFEST)
        dra.post(f"{RESOURCE_API}/deviceclasses", dra_objects.device_class())
        dra.post(f"{RESOURCE_API}/deviceclasses", dra_objects.mig_device_class())
    except BaseException:
        dra.close()
        raise
    return dra


class DraRig(Rig):
    """The integration rig on a DRA cluster's kwok node; ``default`` (e.g. ``"2Gi"``) puts a
    cluster default in every enforcer config it writes from then on."""

    default: str | None = None

    def config(self, **kwargs: Any) -> Path:
        path = super().config(**kwargs)
        if self.default is not None:
            text = path.read_text().replace(
                "\n[metrics]\n", f'\ndefault = "{self.default}"\n[metrics]\n', 1
            )
            path.write_text(text)
        return path


@contextlib.contextmanager
def fresh_dra_rig(
    dra: DraCluster, *, stub_lib: Path, device_node: Path, workdir: Path
) -> Iterator[DraRig]:
    """A fresh kwok GPU node with its ResourceSlice, a fresh namespace and the integration rig
    on them (the ``rig`` fixture of the DRA test modules); all of it removed at the end."""
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    node = f"gpu-{uuid.uuid4().hex[:8]}"
    namespace = f"t-{uuid.uuid4().hex[:10]}"
    dra.add_gpu_node(node)
    ensure_namespace(dra.cluster, namespace)
    try:
        with rig_on_fresh_tree(
            lambda tree: DraRig(
                cluster=dra.cluster,
                namespace=namespace,
                node=node,
                tree=tree,
                workdir=workdir,
                stub_lib=stub_lib,
                device_node=device_node,
                kubeconfig=dra.kubeconfig,
            )
        ) as rig:
            yield rig
    finally:
        with contextlib.suppress(Exception):
            dra.cluster.admin_request("DELETE", f"/api/v1/namespaces/{namespace}")
