"""The DRA objects NVIDIA's DRA driver, a tenant and the scheduler write, as plain dicts.

Owns: the DeviceClass and the ResourceSlice exactly as ``kubernetes-sigs/dra-driver-nvidia-gpu``
publishes them with ``--consumable-shares=memory`` (one slice per node, pool = node name,
devices ``gpu-<minor>`` with a ``uuid`` attribute and a consumable ``memory`` capacity whose
request policy defaults to the whole GPU in 1Mi steps, ``allowMultipleAllocations``), a
ResourceClaim asking for a memory share, and the allocation the scheduler writes into a claim's
status (``tests/data/dra`` holds what the real v1.37.2 scheduler wrote). Shared by
``rigs/dra_cluster.py``, ``benchmarks/scale.py``'s DRA mode and ``scripts/gpu_e2e.py --dra``
(which plays the scheduler on a GPU machine that runs only etcd and kube-apiserver).

Must not: import gpuguard or pytest (the GPU machine may have neither), or talk to anything.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
RESOURCE_API = "/apis/resource.k8s.io/v1"
MIB = 1 << 20
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists"}


def memory_quantity(total_bytes: int) -> str:
    """The slice's ``memory`` capacity: NVML's total rounded down to 1Mi, as the driver does."""
    return f"{total_bytes // MIB}Mi"


def nvidia_gpu(
    index: int, gpu_uuid: str, *, memory: str, product: str = "NVIDIA H200"
) -> dict[str, Any]:
    """One full GPU as the driver's ``GpuInfo.GetDevice()`` with ``--consumable-shares=memory``
    builds it (``cmd/gpu-kubelet-plugin/deviceinfo.go``, ``consumable_shares.go``)."""
    return {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": gpu_uuid},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.95.5"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{0x18 + 0x12 * index:02x}:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
            "resource.kubernetes.io/numaNode": {"int": 0},
        },
        "capacity": {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": "1Mi", "max": memory, "step": "1Mi"},
                },
            }
        },
    }


def nvidia_slice(
    node: Mapping[str, Any],
    gpu_uuids: Sequence[str],
    memory: str,
    generation: int = 1,
    *,
    product: str = "NVIDIA H200",
) -> dict[str, Any]:
    """The node's one ResourceSlice, as the kubelet-plugin helper publishes it: generateName
    ``<index>-<driver>-<node>-``, owned by the Node, pool = node name; device ``gpu-<i>`` is
    ``gpu_uuids[i]``."""
    name = node["metadata"]["name"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": f"0-{DRIVER}-{name}-",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": name,
                    "uid": node["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": {
            "driver": DRIVER,
            "pool": {"name": name, "generation": generation, "resourceSliceCount": 1},
            "nodeName": name,
            "devices": [
                nvidia_gpu(i, u, memory=memory, product=product) for i, u in enumerate(gpu_uuids)
            ],
        },
    }


def device_class() -> dict[str, Any]:
    """``gpu.nvidia.com`` as the driver's chart installs it on ``resource.k8s.io/v1``."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": DEVICE_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{DRIVER}' && "
                        f"device.attributes['{DRIVER}'].type == 'gpu'"
                    }
                }
            ],
            "extendedResourceName": "nvidia.com/gpu",
        },
    }


def memory_request(name: str, memory: str, gpu_uuid: str | None = None) -> dict[str, Any]:
    """A claim's request for one ``memory`` share of a ``gpu.nvidia.com`` GPU (``gpu_uuid``:
    only that GPU, chosen by its ``uuid`` attribute, as a user pins a model)."""
    exactly: dict[str, Any] = {
        "deviceClassName": DEVICE_CLASS,
        "capacity": {"requests": {"memory": memory}},
    }
    if gpu_uuid is not None:
        exactly["selectors"] = [
            {"cel": {"expression": f"device.attributes['{DRIVER}'].uuid == '{gpu_uuid}'"}}
        ]
    return {"name": name, "exactly": exactly}


def claim_template(
    namespace: str, name: str, memory: str, gpu_uuid: str | None = None
) -> dict[str, Any]:
    """A ResourceClaimTemplate for one memory share (claim ``gpu`` of the pods that name it)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [memory_request("gpu", memory, gpu_uuid)]}}},
    }


def claim_pod(
    namespace: str,
    name: str,
    *,
    node: str,
    template: str | None = None,
    claim: str | None = None,
) -> dict[str, Any]:
    """A pod with one container ``main`` using the claim ``gpu`` (made from ``template``, or
    the tenant's ``claim``), for the real scheduler to place on the kwok node ``node``."""
    source = (
        {"resourceClaimTemplateName": template}
        if template is not None
        else {"resourceClaimName": claim}
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "tolerations": [KWOK_TOLERATION],
            "resourceClaims": [{"name": "gpu", **source}],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/cuda:1",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def resource_claim(
    namespace: str, name: str, memory: str, *, request: str = "gpu", gpu_uuid: str | None = None
) -> dict[str, Any]:
    """A ResourceClaim the tenant creates itself (pods name it: ``resourceClaimName``)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [memory_request(request, memory, gpu_uuid)]}},
    }


def allocated(
    claim: Mapping[str, Any],
    *,
    node: str,
    device: str,
    memory: str,
    pod: Mapping[str, Any],
    request: str = "gpu",
) -> dict[str, Any]:
    """``claim`` (as the API server returned it) with the status the scheduler writes when it
    places one memory share of ``device`` of ``node``'s pool for ``pod``: one result with a
    fresh ``shareID`` and ``consumedCapacity.memory``, the node selector, ``reservedFor`` the
    pod (tests/data/dra/claim-p1-gpu-7w5lv.yaml has the real scheduler's)."""
    result = {
        "request": request,
        "driver": DRIVER,
        "pool": node,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": memory},
    }
    selector = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
        ]
    }
    meta = pod["metadata"]
    return {
        **claim,
        "status": {
            "allocation": {"devices": {"results": [result]}, "nodeSelector": selector},
            "reservedFor": [{"resource": "pods", "name": meta["name"], "uid": meta["uid"]}],
        },
    }


def bound_pod(namespace: str, name: str, *, node: str, claims: Sequence[str]) -> dict[str, Any]:
    """A pod that sets ``spec.nodeName`` itself (the scheduler never sees it) and whose one
    container uses the ResourceClaims ``claims`` by name: nothing checks that they exist. On a
    real kubelet it stays Pending, its claims unprepared; kwok runs it anyway."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "tolerations": [KWOK_TOLERATION],
            "resourceClaims": [
                {"name": f"c{i}", "resourceClaimName": claim} for i, claim in enumerate(claims)
            ],
            "containers": [
                {
                    "name": "main",
                    "image": "registry.invalid/cuda:1",
                    "resources": {"claims": [{"name": f"c{i}"} for i in range(len(claims))]},
                }
            ],
        },
    }
