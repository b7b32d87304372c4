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

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DRIVER = "gpu.nvidia.com"
DEVICE_CLASS = "gpu.nvidia.com"
MIG_DEVICE_CLASS = "mig.nvidia.com"
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


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One MIG GPU instance profile as NVML describes it (``nvmlGpuInstanceProfileInfo_t``):
    the sizes are illustrative, the shape is NVIDIA's."""

    name: str
    """As go-nvlib's ``MigProfile.String()`` writes it (``1g.10gb``)."""
    profile_id: int
    memory_mib: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...]
    """``(start, size)`` in memory slices."""


H100_PROFILES = (
    MigProfile("1g.10gb", 19, 9984, 16, tuple((i, 1) for i in range(7))),
    MigProfile("3g.40gb", 9, 40448, 60, ((0, 4), (4, 4))),
    MigProfile("7g.80gb", 0, 80896, 132, ((0, 8),)),
)
"""An 80 GB card's profiles: the largest (``7g.80gb``) has less memory than the card."""


def mig_device_name(minor: int, profile: MigProfile, start: int) -> str:
    """``gpu-<minor>-mig-<profile, RFC 1123, no dots>-<profile ID>-<placement start>``, as the
    driver's ``MigSpecTuple.ToCanonicalName`` builds it (``cmd/gpu-kubelet-plugin/mig.go``)."""
    pname = re.sub(r"[^a-z0-9-.]", "-", profile.name.replace(".", "").lower()).strip("-")
    return f"gpu-{minor}-mig-{pname}-{profile.profile_id}-{start}"


def _mig_capacities(profile: MigProfile) -> dict[str, dict[str, Any]]:
    """``CommonCapacitiesMig``: the profile's engines and memory (bytes, BinarySI)."""
    return {
        "multiprocessors": {"value": str(profile.multiprocessors)},
        "copyEngines": {"value": str(max(1, profile.multiprocessors // 16))},
        "decoders": {"value": str(max(1, profile.multiprocessors // 19))},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": str(max(1, profile.multiprocessors // 19))},
        "ofaEngines": {"value": "1" if profile.multiprocessors > 100 else "0"},
        "memory": {"value": f"{profile.memory_mib}Mi"},
    }


def _counters(capacity: Mapping[str, Mapping[str, Any]], start: int, size: int) -> dict[str, Any]:
    """``capacitiesToCounters`` + ``addCountersForMemSlices`` (``partitions.go``)."""
    dns = {
        "copyEngines": "copy-engines",
        "jpegEngines": "jpeg-engines",
        "ofaEngines": "ofa-engines",
    }
    counters: dict[str, Any] = {dns.get(k, k): {"value": v["value"]} for k, v in capacity.items()}
    counters.update({f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)})
    return counters


def _memory_shares(capacity: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``applyConsumableShares`` in ``memory`` mode: the request policy on ``memory``."""
    memory = capacity["memory"]["value"]
    capacity["memory"]["requestPolicy"] = {
        "default": memory,
        "validRange": {"min": "1Mi", "max": memory, "step": "1Mi"},
    }
    return capacity


def dynamic_mig_slices(
    node: Mapping[str, Any],
    gpu_uuids: Sequence[str],
    *,
    profiles: Sequence[MigProfile] = H100_PROFILES,
    generation: int = 1,
    product: str = "NVIDIA H100 80GB HBM3",
) -> list[dict[str, Any]]:
    """The node's slices with the driver's ``DynamicMIG`` and ``ConsumableShares`` features on
    (``--consumable-shares=memory``), split as on Kubernetes 1.35+ (``driver.go``
    ``generateSplitResourceSlices``): one slice of shared counters (one counter set per GPU),
    then one slice per GPU with the full GPU (``GpuInfo.PartGetDevice``) and every MIG profile
    and placement it can be cut into (``MigSpec.PartGetDevice``: no ``uuid``, a
    ``parentUUID``, the profile and placement in the name).

    The full GPU's capacities are the maximum over its MIG profiles (``PartCapacities``,
    ``maxCapacities``): its ``memory`` is the largest profile's, less than the GPU has."""
    name = node["metadata"]["name"]
    count = len(gpu_uuids) + 1
    slices_needed = max(s + n for p in profiles for s, n in p.placements)
    largest = {
        k: max((_mig_capacities(p)[k] for p in profiles), key=lambda v: _magnitude(v["value"]))
        for k in _mig_capacities(profiles[0])
    }

    def body(devices: list[dict[str, Any]] | None, counters: list[Any] | None) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": DRIVER,
            "pool": {"name": name, "generation": generation, "resourceSliceCount": count},
            "nodeName": name,
        }
        if devices is not None:
            spec["devices"] = devices
        if counters is not None:
            spec["sharedCounters"] = counters
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": f"{name}-{DRIVER}-",
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
            "spec": spec,
        }

    counter_sets = [
        {
            "name": f"gpu-{minor}-counter-set",
            "counters": _counters(largest, 0, slices_needed),
        }
        for minor in range(len(gpu_uuids))
    ]
    out = [body(None, counter_sets)]
    for minor, gpu_uuid in enumerate(gpu_uuids):
        full = nvidia_gpu(minor, gpu_uuid, memory="0", product=product)
        full["capacity"] = _memory_shares({k: dict(v) for k, v in largest.items()})
        full["consumesCounters"] = [
            {
                "counterSet": f"gpu-{minor}-counter-set",
                "counters": _counters(largest, 0, slices_needed),
            }
        ]
        devices = [full]
        for profile in profiles:
            for start, size in profile.placements:
                attributes = {
                    k: v for k, v in full["attributes"].items() if k not in ("uuid", "type")
                }
                attributes.update(
                    {
                        "type": {"string": "mig"},
                        "parentUUID": {"string": gpu_uuid},
                        "profile": {"string": profile.name},
                    }
                )
                capacity = _mig_capacities(profile)
                devices.append(
                    {
                        "name": mig_device_name(minor, profile, start),
                        "allowMultipleAllocations": True,
                        "attributes": attributes,
                        "capacity": _memory_shares(capacity),
                        "consumesCounters": [
                            {
                                "counterSet": f"gpu-{minor}-counter-set",
                                "counters": _counters(_mig_capacities(profile), start, size),
                            }
                        ],
                    }
                )
        devices.sort(key=lambda d: str(d["name"]))
        out.append(body(devices, None))
    return out


def static_mig_slice(
    node: Mapping[str, Any],
    gpu_uuid: str,
    minor: int,
    instances: Sequence[tuple[MigProfile, int, str]],
    *,
    full_gpus: Sequence[tuple[int, str, str]] = (),
    product: str = "NVIDIA H100 80GB HBM3",
) -> dict[str, Any]:
    """The node's one slice with static MIG (``DynamicMIG`` off, ``--consumable-shares=memory``):
    the full GPUs ``full_gpus`` (``(minor, uuid, memory)``) and GPU ``minor``'s MIG devices
    ``instances`` (``(profile, placement start, MIG UUID)``), each as
    ``MigDeviceInfo.GetDevice`` publishes it (``deviceinfo.go``: its own ``uuid``, a
    ``parentUUID``, the profile's capacities and one ``memorySlice<i>`` per memory slice it
    holds), with the memory request policy of ``applyConsumableShares``."""
    body = nvidia_slice(node, [], "0", product=product)
    devices = [nvidia_gpu(m, u, memory=mem, product=product) for m, u, mem in full_gpus]
    parent = nvidia_gpu(minor, gpu_uuid, memory="0", product=product)["attributes"]
    for profile, start, mig_uuid in instances:
        size = dict(profile.placements)[start]
        capacity = _memory_shares(_mig_capacities(profile))
        capacity.update({f"memorySlice{i}": {"value": "1"} for i in range(start, start + size)})
        attributes = {k: v for k, v in parent.items() if k not in ("uuid", "type")}
        attributes.update(
            {
                "type": {"string": "mig"},
                "uuid": {"string": mig_uuid},
                "parentUUID": {"string": gpu_uuid},
                "profile": {"string": profile.name},
            }
        )
        devices.append(
            {
                "name": mig_device_name(minor, profile, start),
                "allowMultipleAllocations": True,
                "attributes": attributes,
                "capacity": capacity,
            }
        )
    body["spec"]["devices"] = devices
    return body


def mig_device_class() -> dict[str, Any]:
    """``mig.nvidia.com`` as the driver's chart installs it (``deviceclass-mig.yaml``)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": MIG_DEVICE_CLASS},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{DRIVER}' && "
                        f"device.attributes['{DRIVER}'].type == 'mig'"
                    }
                }
            ]
        },
    }


def mig_claim_template(
    namespace: str, name: str, memory: str | None, selector: str
) -> dict[str, Any]:
    """A ResourceClaimTemplate for one memory share (``None``: all) of a MIG device of
    ``mig.nvidia.com`` that the CEL ``selector`` picks."""
    exactly: dict[str, Any] = {
        "deviceClassName": MIG_DEVICE_CLASS,
        "selectors": [{"cel": {"expression": selector}}],
    }
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}},
    }


def _magnitude(value: str) -> int:
    return int(value.removesuffix("Mi")) << (20 if value.endswith("Mi") else 0)


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


def memory_request(name: str, memory: str | None, gpu_uuid: str | None = None) -> dict[str, Any]:
    """A claim's request for one ``memory`` share of a ``gpu.nvidia.com`` GPU (``gpu_uuid``:
    only that GPU, chosen by its ``uuid`` attribute, as a user pins a model; ``memory``
    ``None``: no memory request, the whole GPU in ``memory`` mode)."""
    exactly: dict[str, Any] = {"deviceClassName": DEVICE_CLASS}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    if gpu_uuid is not None:
        exactly["selectors"] = [
            {"cel": {"expression": f"device.attributes['{DRIVER}'].uuid == '{gpu_uuid}'"}}
        ]
    return {"name": name, "exactly": exactly}


def claim_template(
    namespace: str, name: str, memory: str | None, gpu_uuid: str | None = None
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
