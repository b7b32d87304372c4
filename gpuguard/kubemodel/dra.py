"""DRA objects as the API server writes them, translated into gpuguard's model: which
ResourceClaims a pod's containers use, what a claim's allocation holds, the NVML UUID of each
device this node's ResourceSlices publish, and from those the pod's ``dra`` declaration
(``core.model.Declaration.shares``; docs/dra.md).

Owns the shape of ``resource.k8s.io/v1`` claims and slices and of the pod's DRA fields
(``spec.resourceClaims``, ``status.resourceClaimStatuses``, containers' ``resources.claims``,
``status.extendedResourceClaimStatus``). The reads are ``dra_claims``'; the limit on a device
(the sum of the shares there) is ``core.limits``'.

A share is one allocation result: the scheduler accounts ``consumedCapacity.memory`` per result
(one claim may hold several results on one device, each with its own ``shareID``), and a claim
reserved for several pods is one share it counted once. The allocation is written by the
scheduler and cannot be changed once set, but everything here is still read as hostile: any type
in any field, lengths and counts bounded, never an exception. A malformed allocation is an error
(never a limit), a claim not read yet or pending is ``unresolved`` (held like a pod that declares
nothing, never a guess of the share). Which claims a node reads at all is ``ration_claims``'.

Pure: no I/O, no logging, no ``kubernetes`` import.

Size: over 600 lines, on purpose: the whole pure translation of DRA objects (pods' claim
references, claims, slices, declarations); most of its lines bound and check hostile input, and the
tests (tests/test_dra_translate.py) cover it as one unit.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gpuguard.core.limits import MIN_LIMIT_BYTES
from gpuguard.core.model import Declaration, DraShare, GpuUuid
from gpuguard.kubemodel.quantity import InvalidQuantity, parse_quantity_bytes, show

NVIDIA_DRIVER = "gpu.nvidia.com"
"""NVIDIA's DRA driver (``spec.driver`` of its slices, ``driver`` of its results)."""
GPU_TYPE = "gpu"
MIG_TYPE = "mig"
ENFORCED_TYPES = frozenset({GPU_TYPE, MIG_TYPE})
"""The device ``type`` attributes of ``NVIDIA_DRIVER`` whose memory shares gpuguard holds pods to
(``share_refusal``). The driver also publishes ``mig`` and ``vfio`` (``cmd/gpu-kubelet-plugin``,
``GpuDeviceType``, ``MigStaticDeviceType``/``MigDynamicDeviceType``, ``VfioDeviceType``)."""
NVIDIA_DEVICE_CLASSES: Mapping[str, tuple[str, str]] = {
    "gpu.nvidia.com": (NVIDIA_DRIVER, GPU_TYPE),
    "mig.nvidia.com": (NVIDIA_DRIVER, MIG_TYPE),
    "vfio.gpu.nvidia.com": (NVIDIA_DRIVER, "vfio"),
}
"""The DeviceClasses NVIDIA's chart installs for its GPU driver, and the driver and device type
each one's selector admits (``deployments/helm/dra-driver-nvidia-gpu/templates/deviceclass-*.yaml``
at 9593204: ``device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type ==
'gpu'``, ``'mig'``, ``'vfio'``)."""
MISSING: Literal["missing"] = "missing"
"""The state of a claim the API server does not have (404): gone, its share forgotten."""

MAX_NAME = 253
"""The longest name or namespace the API server accepts (a DNS subdomain)."""
MAX_POD_CLAIMS = 128
"""``spec.resourceClaims``, ``status.resourceClaimStatuses`` and a container's
``resources.claims`` read at most (the API server allows 32 of the first)."""
MAX_CONTAINERS = 1024
"""Containers (init and regular) read per pod at most."""
MAX_MAPPINGS = 1024
"""``extendedResourceClaimStatus.requestMappings`` read at most."""
MAX_RESULTS = 32
"""``status.allocation.devices.results`` the API server allows (AllocationResultsMaxSize)."""
MAX_RESERVED = 256
"""``status.reservedFor`` entries the API server allows (ResourceClaimReservedForMaxSize)."""
MAX_SLICES = 1024
"""ResourceSlices read per call at most."""
MAX_DEVICES = 4096
"""Devices read over all slices at most (a slice holds at most 128)."""
MAX_ERRORS = 8
"""Messages kept per pod or claim: the first ones say enough."""
MAX_WHERE_CLAIMS = 4
"""Claims named in ``Declaration.where``; more are counted."""

_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 3
_SHORT.maxlevel = 3
_UUID = re.compile(r"GPU-[0-9a-fA-F-]{8,64}", re.ASCII)
_MIG_UUID = re.compile(r"MIG-[0-9a-fA-F-]{8,64}", re.ASCII)
_MIG_NAME = re.compile(
    r"gpu-([0-9]{1,3})-mig-([a-z0-9-]{1,64})-([0-9]{1,3})-([0-9]{1,3})", re.ASCII
)
"""The driver's canonical MIG device name, ``gpu-<minor>-mig-<profile>-<profile ID>-<placement
start>`` (``MigSpecTuple.ToCanonicalName`` and ``canonicalMigNameRegex`` in
``cmd/gpu-kubelet-plugin/mig.go``, kubernetes-sigs/dra-driver-nvidia-gpu at 9593204)."""

SliceDevice = tuple[str, str, str]
"""``(driver, pool, device)``: a device as a result and a slice name it (``core.model``'s
``DeviceKey`` is the NVML unit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SlicedDevice:
    """A device as this node's ResourceSlices publish it."""

    uuid: GpuUuid | None
    """A full GPU's ``uuid`` attribute: NVML's UUID of the GPU; ``None`` for any other device
    (a MIG device's own ``uuid`` is ``mig_uuid``)."""
    memory_bytes: int | None = None
    """Its advertised ``capacity.memory.value``; ``None`` when absent or unreadable. Not always
    the GPU's memory: with the driver's DynamicMIG feature it is the largest MIG profile's
    (``_whole``)."""
    type: str = GPU_TYPE
    """Its ``type`` attribute (``gpu``, ``mig``, ``vfio``); ``gpu`` where a device with a GPU
    UUID has none."""
    parent_uuid: GpuUuid | None = None
    """A MIG device's ``parentUUID``: the GPU it is cut from."""
    mig_uuid: str | None = None
    """A static MIG device's own ``uuid`` (``MIG-…``); a dynamic one has none until made."""
    profile: str | None = None
    """A MIG device's ``profile`` (``1g.10gb``)."""
    mig_placement: tuple[int, int] | None = None
    """A dynamic MIG device's GPU instance profile ID and placement start, read from its name
    (``_dynamic_placement``); ``None`` for a static one (``mig_uuid``) or a name of another
    shape."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimKey:
    """A ResourceClaim by namespace/name."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimUse:
    """One claim a pod's containers use."""

    key: ClaimKey
    requests: frozenset[str] | None
    """Results of these requests only; ``None``: all the claim's results."""
    containers: tuple[str, ...]
    """Container names using it (for ``check-pod`` and ``explain``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodClaims:
    """The claims a pod's containers use, as its manifest says."""

    uses: tuple[ClaimUse, ...] = ()
    """Distinct claims; a claim's requests are merged (one use of all its results wins)."""
    pending: tuple[str, ...] = ()
    """Pod claim names (``spec.resourceClaims[].name``) a container uses whose claim made from
    a template is not named yet in ``status.resourceClaimStatuses``."""
    errors: tuple[str, ...] = ()
    """Malformed fields, for messages."""
    running: bool = False
    """The kubelet reports the pod ``Running``, or one of its containers running (an init
    container runs while the pod is ``Pending``): it may have GPU processes, so its claims are
    read before those of pods that cannot (``ration_claims``). Pod status, which tenants do not
    write; a pod whose claims do not exist never gets there on a real kubelet."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AllocationResult:
    """One ``status.allocation.devices.results[]`` entry."""

    request: str
    """``<request>`` or ``<request>/<subrequest>`` (``firstAvailable``)."""
    driver: str
    pool: str
    device: str
    share_id: str | None
    memory_bytes: int | None
    """``consumedCapacity.memory``; ``None`` when absent (or zero: no memory was accounted):
    the device is held whole."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Claim:
    """A ResourceClaim as read."""

    key: ClaimKey
    uid: str
    resource_version: str
    results: tuple[AllocationResult, ...]
    """Empty when ``status.allocation`` is absent (deallocated) or malformed."""
    allocated: bool
    reserved_for: int
    """Entries of ``status.reservedFor`` of resource ``pods``."""
    deleting: bool
    """``metadata.deletionTimestamp`` set: still allocated while a pod reserves it."""
    error: str | None = None
    """A malformed allocation (an unparsable ``consumedCapacity.memory``): never a limit."""


ClaimState = Claim | Literal["missing"] | str
"""Read (``Claim``), gone (``MISSING``: a 404), or why it could not be read (any other text).
A claim absent from the mapping was not read yet."""


# -- which devices hold a share gpuguard enforces ---------------------------------------------


def share_refusal(driver: str | None, device_type: str | None) -> str | None:
    """Why a device of ``driver`` and ``device_type`` holds no GPU memory share gpuguard
    enforces; ``None`` when it does. The one rule for the enforcer (``dra_declaration``, with
    the type the node's slices give) and ``check-pod`` (``dra_templates``, with the type a
    DeviceClass admits). ``None`` for either: not known where it is asked (``check-pod`` has no
    slices), judged on what is known.

    Only NVIDIA's GPU driver and its device types ``ENFORCED_TYPES``: another driver's device
    may be anything (a NIC, an FPGA), and a ``vfio`` GPU is passed to a VM, where no process
    of the node's NVML runs."""
    if driver is not None and driver != NVIDIA_DRIVER:
        return f"driver {_show(driver)} is not NVIDIA's GPU driver {NVIDIA_DRIVER}"
    if device_type == MIG_TYPE and MIG_TYPE not in ENFORCED_TYPES:
        return (
            "it is a MIG device (type mig): gpuguard does not map a DRA share of a MIG "
            "device to its MIG instance"
        )
    if device_type is not None and device_type not in ENFORCED_TYPES:
        return f"its device type is {_show(device_type)}, not a GPU (type gpu)"
    return None


def class_device(device_class: object) -> tuple[str | None, str | None]:
    """The driver and device type a DeviceClass admits, for NVIDIA's own
    (``NVIDIA_DEVICE_CLASSES``); ``(None, None)`` for any other name (not known)."""
    if isinstance(device_class, str):
        found = NVIDIA_DEVICE_CLASSES.get(device_class)
        if found is not None:
            return found
    return None, None


# -- the pod ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ContainerClaim:
    """One container's use of one of its pod's claims, resolved as far as the pod itself says."""

    container: str
    claim: str
    """The pod's name for the claim (``spec.resourceClaims[].name``)."""
    request: str | None
    """The request the container names; ``None``: all the claim's results."""
    template: str | None
    """``resourceClaimTemplateName``; ``None`` for a claim the pod names directly."""
    claim_name: str | None
    """The ResourceClaim: ``resourceClaimName``, or the one ``status.resourceClaimStatuses``
    says was made from the template; ``None`` when not made (yet)."""
    pending: bool
    """From a template, and the status does not say yet which claim was made from it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PodClaimRefs:
    """A pod's claim references as its manifest writes them, before any claim is read."""

    names_claims: bool = False
    """``spec.resourceClaims`` names at least one claim (used by a container or not)."""
    containers: tuple[ContainerClaim, ...] = ()
    errors: tuple[str, ...] = ()
    """Malformed fields, unbounded (callers bound what they show)."""


def pod_claim_refs(manifest: Mapping[str, Any]) -> PodClaimRefs:
    """The one reader of a pod's claim references (``spec.resourceClaims``,
    ``status.resourceClaimStatuses``, containers' ``resources.claims``): used by ``pod_claims``
    and by ``check-pod`` (``dra_templates``), which looks templates up in files. Containers are
    read only when the pod names claims or has an ``extendedResourceClaimStatus``."""
    errors: list[str] = []
    spec = _mapping(_mapping(manifest).get("spec"))
    status = _mapping(_mapping(manifest).get("status"))
    refs = _pod_refs(spec.get("resourceClaims"), errors)
    generated = _generated(status.get("resourceClaimStatuses"), errors)
    if not refs and status.get("extendedResourceClaimStatus") is None:
        return PodClaimRefs(errors=tuple(errors))
    containers: list[ContainerClaim] = []
    for container, claim, request in _container_claims(spec, errors):
        ref = refs.get(claim)
        if ref is None:
            errors.append(
                f"container {container} uses claim {_show(claim)}, which spec.resourceClaims "
                "does not name"
            )
            continue
        template = ref[1] if ref[0] == "template" else None
        containers.append(
            ContainerClaim(
                container=container,
                claim=claim,
                request=request,
                template=template,
                claim_name=ref[1] if template is None else generated.get(claim),
                pending=template is not None and claim not in generated,
            )
        )
    return PodClaimRefs(names_claims=bool(refs), containers=tuple(containers), errors=tuple(errors))


def pod_claims(manifest: Mapping[str, Any]) -> PodClaims:
    """The claims ``manifest``'s containers use (namespace: the pod's). A claim the pod lists
    that no container names grants no container a device: left out."""
    metadata = _mapping(_mapping(manifest).get("metadata"))
    status = _mapping(_mapping(manifest).get("status"))
    namespace = _name(metadata.get("namespace"))
    read = pod_claim_refs(manifest)
    errors = list(read.errors)
    extended = status.get("extendedResourceClaimStatus")
    if not read.names_claims and extended is None:
        return PodClaims(errors=_bounded(errors))
    if namespace is None:
        errors.append(f"metadata.namespace is {_show(metadata.get('namespace'))}")
        return PodClaims(errors=_bounded(errors))
    found: dict[ClaimKey, tuple[set[str] | None, list[str]]] = {}
    pending: list[str] = []

    def use(key: ClaimKey, request: str | None, container: str) -> None:
        if key not in found and len(found) >= MAX_POD_CLAIMS:
            errors.append(f"more than {MAX_POD_CLAIMS} claims: the rest are not read")
            return
        requests, containers = found.setdefault(key, (set(), []))
        if request is None:
            found[key] = (None, containers)
        elif requests is not None:
            requests.add(request)
        if container not in containers:
            containers.append(container)

    for ref in read.containers:
        if ref.pending:
            if ref.claim not in pending:
                pending.append(ref.claim)
        elif ref.claim_name is not None:
            use(ClaimKey(namespace=namespace, name=ref.claim_name), ref.request, ref.container)
        # else: the status says no claim was needed for it: nothing is allocated.
    for container, claim_name, request in _extended(extended, errors):
        use(ClaimKey(namespace=namespace, name=claim_name), request, container)
    uses = tuple(
        ClaimUse(
            key=key,
            requests=None if requests is None else frozenset(requests),
            containers=tuple(containers),
        )
        for key, (requests, containers) in found.items()
    )
    return PodClaims(
        uses=uses, pending=tuple(pending), errors=_bounded(errors), running=_runs(status)
    )


def _runs(status: Mapping[str, Any]) -> bool:
    """``PodClaims.running``: phase ``Running``, or any container's ``state.running`` set."""
    if status.get("phase") == "Running":
        return True
    for group in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        for entry in _list(status.get(group), f"status.{group}", MAX_CONTAINERS, []):
            if _mapping(_mapping(entry).get("state")).get("running") is not None:
                return True
    return False


def _pod_refs(entries: object, errors: list[str]) -> dict[str, tuple[str, str]]:
    """``spec.resourceClaims``: the pod's claim name → ``("claim" | "template", name)``."""
    refs: dict[str, tuple[str, str]] = {}
    for entry in _list(entries, "spec.resourceClaims", MAX_POD_CLAIMS, errors):
        fields = _mapping(entry)
        name = _name(fields.get("name"))
        claim = fields.get("resourceClaimName")
        template = fields.get("resourceClaimTemplateName")
        if name is None:
            errors.append(f"a spec.resourceClaims entry has no valid name: {_show(entry)}")
        elif (claim_name := _name(claim)) is not None and template is None:
            refs[name] = ("claim", claim_name)
        elif (template_name := _name(template)) is not None and claim is None:
            refs[name] = ("template", template_name)
        else:
            errors.append(
                f"spec.resourceClaims {_show(name)} needs exactly one of resourceClaimName and "
                "resourceClaimTemplateName"
            )
    return refs


def _generated(statuses: object, errors: list[str]) -> dict[str, str | None]:
    """``status.resourceClaimStatuses``: the pod's claim name → the claim made from its
    template (``None``: the status says no claim was needed)."""
    out: dict[str, str | None] = {}
    for status in _list(statuses, "status.resourceClaimStatuses", MAX_POD_CLAIMS, errors):
        fields = _mapping(status)
        name, claim = _name(fields.get("name")), fields.get("resourceClaimName")
        if name is None or (claim is not None and _name(claim) is None):
            errors.append(f"a status.resourceClaimStatuses entry is malformed: {_show(status)}")
            continue
        out[name] = _name(claim)
    return out


def _container_claims(
    spec: Mapping[str, Any], errors: list[str]
) -> list[tuple[str, str, str | None]]:
    """``(container, pod claim name, request or None for all its results)``."""
    uses: list[tuple[str, str, str | None]] = []
    counted = 0
    for group in ("initContainers", "containers"):
        for container in _list(spec.get(group), f"spec.{group}", MAX_CONTAINERS, errors):
            counted += 1
            if counted > MAX_CONTAINERS:
                errors.append(f"more than {MAX_CONTAINERS} containers: the rest are not read")
                return uses
            fields = _mapping(container)
            claims = _mapping(fields.get("resources")).get("claims")
            if claims is None:
                continue
            label = _name(fields.get("name")) or "<no name>"
            for claim in _list(
                claims, f"container {label}: resources.claims", MAX_POD_CLAIMS, errors
            ):
                ref = _mapping(claim)
                name, request = _name(ref.get("name")), ref.get("request")
                if name is None or not (request is None or _name(request) is not None):
                    errors.append(f"container {label}: resources.claims entry {_show(claim)}")
                    continue
                uses.append((label, name, _name(request)))
    return uses


def _extended(status: object, errors: list[str]) -> list[tuple[str, str, str]]:
    """``status.extendedResourceClaimStatus``: ``(container, claim, request)`` per mapping."""
    if status is None:
        return []
    fields = _mapping(status)
    claim = _name(fields.get("resourceClaimName"))
    if claim is None:
        errors.append(
            f"status.extendedResourceClaimStatus.resourceClaimName is "
            f"{_show(fields.get('resourceClaimName'))}"
        )
        return []
    out: list[tuple[str, str, str]] = []
    mappings = fields.get("requestMappings")
    where = "status.extendedResourceClaimStatus.requestMappings"
    for mapping in _list(mappings, where, MAX_MAPPINGS, errors):
        entry = _mapping(mapping)
        container, request = _name(entry.get("containerName")), _name(entry.get("requestName"))
        if container is None or request is None:
            errors.append(f"a {where} entry is malformed: {_show(mapping)}")
            continue
        out.append((container, claim, request))
    return out


# -- the claim -------------------------------------------------------------------------------


def claim_from_json(obj: object) -> Claim | None:
    """The claim ``obj`` is; ``None`` when it is not a ResourceClaim with a namespace and name."""
    fields = _mapping(obj)
    if fields.get("kind", "ResourceClaim") != "ResourceClaim":
        return None
    metadata = _mapping(fields.get("metadata"))
    namespace, name = _name(metadata.get("namespace")), _name(metadata.get("name"))
    if namespace is None or name is None:
        return None
    status = _mapping(fields.get("status"))
    errors: list[str] = []
    allocation = status.get("allocation")
    results: list[AllocationResult] = []
    if allocation is not None and not isinstance(allocation, Mapping):
        errors.append(f"status.allocation is {_show(allocation)}, not a mapping")
    elif allocation is not None:
        raw = _mapping(allocation.get("devices")).get("results")
        items = _list(raw, "status.allocation.devices.results", MAX_RESULTS, errors)
        for index, item in enumerate(items):
            result = _result(item, f"status.allocation.devices.results[{index}]", errors)
            if result is not None:
                results.append(result)
    reserved = status.get("reservedFor")
    pods = sum(
        1
        for entry in _list(reserved, "status.reservedFor", MAX_RESERVED, [])
        if _mapping(entry).get("resource") == "pods" and not _mapping(entry).get("apiGroup")
    )
    return Claim(
        key=ClaimKey(namespace=namespace, name=name),
        uid=_text(metadata.get("uid"), 128),
        resource_version=_text(metadata.get("resourceVersion"), 64),
        results=() if errors else tuple(results),
        allocated=allocation is not None,
        reserved_for=pods,
        deleting=metadata.get("deletionTimestamp") is not None,
        error="; ".join(_bounded(errors)) or None,
    )


def _result(item: object, where: str, errors: list[str]) -> AllocationResult | None:
    fields = _mapping(item)
    names = {key: _name(fields.get(key)) for key in ("request", "driver", "pool", "device")}
    for key, value in names.items():
        if value is None:
            errors.append(f"{where}.{key} is {_show(fields.get(key))}")
            return None
    consumed = fields.get("consumedCapacity")
    memory: int | None = None
    if consumed is not None and not isinstance(consumed, Mapping):
        errors.append(f"{where}.consumedCapacity is {_show(consumed)}, not a mapping")
        return None
    if consumed is not None and consumed.get("memory") is not None:
        memory, problem = _memory(consumed["memory"])
        if problem is not None:
            errors.append(f"{where}.consumedCapacity.memory {problem}")
            return None
    share_id = fields.get("shareID")
    return AllocationResult(
        request=names["request"] or "",
        driver=names["driver"] or "",
        pool=names["pool"] or "",
        device=names["device"] or "",
        share_id=share_id if isinstance(share_id, str) and len(share_id) <= 64 else None,
        memory_bytes=memory,
    )


def _memory(value: object) -> tuple[int | None, str | None]:
    """A ``consumedCapacity.memory`` quantity: bytes, ``None`` for zero (the ``unlimited`` and
    ``<N>`` share modes account no memory: the device is held whole), or why not."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None, f"is {_show(value)}, not a quantity"
    try:
        memory = parse_quantity_bytes(value)
    except InvalidQuantity as error:
        if error.code == "zero":
            return None, None
        return None, f"is invalid: {error}"
    if memory < MIN_LIMIT_BYTES:
        return None, f"is {memory} bytes, below the smallest limit of 1Mi: never a limit"
    return memory, None


# -- the slices ------------------------------------------------------------------------------


def slice_devices(slices: Iterable[object]) -> dict[SliceDevice, SlicedDevice]:
    """Each device of ``slices`` (ResourceSlice JSON) → what gpuguard reads of it: a full GPU's
    NVML UUID (its ``uuid`` attribute, ``GPU-…``) and advertised memory, from the slices of each
    pool's newest ``spec.pool.generation``.

    MIG devices (``type`` ``mig``) and devices of other types are kept with their type (whether
    gpuguard enforces their shares is ``share_refusal``'s); a device two slices of one
    generation name differently is left out (never a guess)."""
    read: list[tuple[str, str, int, object]] = []
    newest: dict[tuple[str, str], int] = {}
    for count, obj in enumerate(slices):
        if count >= MAX_SLICES:
            break
        spec = _mapping(_mapping(obj).get("spec"))
        pool = _mapping(spec.get("pool"))
        driver, name, generation = (
            _name(spec.get("driver")),
            _name(pool.get("name")),
            pool.get("generation"),
        )
        if driver is None or name is None:
            continue
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            generation = 0
        read.append((driver, name, generation, spec.get("devices")))
        newest[driver, name] = max(newest.get((driver, name), generation), generation)
    found: dict[SliceDevice, SlicedDevice] = {}
    clashes: set[SliceDevice] = set()
    budget = MAX_DEVICES
    for driver, pool_name, generation, devices in read:
        if generation != newest[driver, pool_name] or not isinstance(devices, list):
            continue
        for device in devices[:budget]:
            fields = _mapping(device)
            name, sliced = _name(fields.get("name")), _sliced(driver, fields)
            if name is None or sliced is None:
                continue
            key = (driver, pool_name, name)
            if found.get(key, sliced) != sliced:
                clashes.add(key)
            found[key] = sliced
        budget -= min(budget, len(devices))
        if budget == 0:
            break
    return {key: device for key, device in found.items() if key not in clashes}


def _sliced(driver: str, device: Mapping[str, Any]) -> SlicedDevice | None:
    """A device's attributes (keys bare or qualified by the driver's domain): a full GPU by its
    ``uuid`` (``GPU-…``), a MIG device by its ``parentUUID`` and own ``uuid`` (``MIG-…``, static
    MIG only), any other by its ``type``; ``None`` for a device with none of these."""
    fields = _mapping(device.get("attributes"))
    kind = _attribute(fields, driver, "type")
    uuid = _attribute(fields, driver, "uuid")
    memory = _capacity_memory(device)
    if kind == MIG_TYPE:
        parent = _attribute(fields, driver, "parentUUID")
        mig_uuid = uuid if uuid is not None and _MIG_UUID.fullmatch(uuid) else None
        profile = _attribute(fields, driver, "profile")
        return SlicedDevice(
            uuid=None,
            memory_bytes=memory,
            type=MIG_TYPE,
            parent_uuid=GpuUuid(parent) if parent and _UUID.fullmatch(parent) else None,
            mig_uuid=mig_uuid,
            profile=profile,
            mig_placement=(
                None if uuid is not None else _dynamic_placement(device.get("name"), profile)
            ),
        )
    if kind in (None, GPU_TYPE):
        if uuid is None or not _UUID.fullmatch(uuid):
            return None
        return SlicedDevice(uuid=GpuUuid(uuid), memory_bytes=memory)
    return SlicedDevice(uuid=None, memory_bytes=memory, type=kind)


def _dynamic_placement(name: object, profile: str | None) -> tuple[int, int] | None:
    """A dynamic MIG device's ``(profile ID, placement start)`` from its name, only where the
    name is of the driver's shape (``_MIG_NAME``) and its profile part is the device's
    ``profile`` attribute as the driver writes it there (lowercase, no dots, RFC 1123: ``1g.10gb``
    is ``1g10gb``, ``1g.10gb+me`` is ``1g10gb-me``); ``None`` otherwise (never a guess)."""
    if not isinstance(name, str) or profile is None:
        return None
    found = _MIG_NAME.fullmatch(name)
    written = re.sub(r"[^a-z0-9-.]", "-", profile.replace(".", "").lower()).strip("-")
    if found is None or found.group(2) != written:
        return None
    return int(found.group(3)), int(found.group(4))


def _capacity_memory(device: Mapping[str, Any]) -> int | None:
    """A device's ``capacity.memory.value`` in bytes; ``None`` when absent or not a quantity."""
    value = _mapping(_mapping(_mapping(device.get("capacity")).get("memory"))).get("value")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        return parse_quantity_bytes(value)
    except InvalidQuantity:
        return None


def _attribute(attributes: Mapping[str, Any], driver: str, name: str) -> str | None:
    for key in (name, f"{driver}/{name}"):
        value = _mapping(attributes.get(key)).get("string")
        if isinstance(value, str) and len(value) <= 128:
            return value
    return None


# -- which claims a node reads ---------------------------------------------------------------


def ration_claims(
    wanted: Mapping[ClaimKey, bool],
    missing: Collection[ClaimKey] = (),
    *,
    budget: int,
    missing_budget: int,
) -> tuple[tuple[ClaimKey, ...], tuple[ClaimKey, ...]]:
    """Which of the claims a node's pods name are read: ``(read, gone)``, at most ``budget``
    and ``missing_budget`` of them; any other is never read (its pods are unresolved).

    ``wanted`` maps each claim to whether a running pod names it (``PodClaims.running``);
    ``missing``: those whose last read answered 404. A claim that answered 404 takes no slot
    of ``budget``: it is gone and grants nothing, and the first ``missing_budget`` of them are
    read again (``gone``) in case it comes back, the rest not. Anyone can name claims that do
    not exist (a pod that sets ``spec.nodeName`` skips the scheduler, and nothing checks its
    claims), so the order is what keeps them from crowding out the claims of pods with GPU
    processes:

    - claims running pods name first, then those only pods not running name (whatever their
      names sort as);
    - within each, namespaces take turns, one claim each per round, by name: a namespace
      naming many claims gets only what the others leave over, and cannot spend their share.
    """
    gone = set(missing)
    read = _in_turns([k for k, runs in wanted.items() if runs and k not in gone])
    read += _in_turns([k for k, runs in wanted.items() if not runs and k not in gone])
    again = _in_turns([k for k, runs in wanted.items() if runs and k in gone])
    again += _in_turns([k for k, runs in wanted.items() if not runs and k in gone])
    return tuple(read[: max(0, budget)]), tuple(again[: max(0, missing_budget)])


def _in_turns(keys: Iterable[ClaimKey]) -> list[ClaimKey]:
    """``keys`` with namespaces taking turns: each one's first claim by name, then each one's
    second, and so on (namespaces by name)."""
    queues: dict[str, list[ClaimKey]] = {}
    for key in sorted(keys, key=lambda k: (k.namespace, k.name)):
        queues.setdefault(key.namespace, []).append(key)
    turns: list[ClaimKey] = []
    active, i = list(queues.values()), 0
    while active:
        turns.extend(q[i] for q in active)
        i += 1
        active = [q for q in active if len(q) > i]
    return turns


# -- the declaration -------------------------------------------------------------------------


def dra_declaration(
    pod: PodClaims,
    claims: Mapping[ClaimKey, ClaimState],
    devices: Mapping[SliceDevice, SlicedDevice],
) -> Declaration | None:
    """The pod's ``dra`` declaration from what was read; ``None`` when it uses no claim.

    One share per distinct allocation result its containers use on a device ``share_refusal``
    accepts. Unresolved (held like a pod that declares nothing: ``core.limits``) while a claim it
    uses was not read or could not be, a claim of its is not created yet, or a share is on a MIG
    device; a claim gone (404) or not allocated contributes nothing (a warning)."""
    if not pod.uses and not pod.pending and not pod.errors:
        return None
    where = _where(pod)
    if pod.errors:
        return Declaration(where=where, error="; ".join(pod.errors[:MAX_ERRORS]))
    shares: list[DraShare] = []
    unresolved: list[str] = [
        f"pod claim {_show(name)}: its ResourceClaim is not created yet" for name in pod.pending
    ]
    warnings: list[str] = []
    errors: list[str] = []
    for use in _merged(pod.uses):
        state = claims.get(use.key)
        if state is None:
            unresolved.append(f"ResourceClaim {use.key} is not read yet")
        elif isinstance(state, Claim):
            _claim_shares(
                use,
                state,
                devices=devices,
                shares=shares,
                unresolved=unresolved,
                warnings=warnings,
                errors=errors,
            )
        elif state == MISSING:
            warnings.append(f"ResourceClaim {use.key} is gone: its share is forgotten")
        else:
            why = _clip(state) if isinstance(state, str) else "not a claim"
            unresolved.append(f"ResourceClaim {use.key} could not be read: {why}")
    if unresolved:  # unresolved, not invalid: a default stands in, acted on after a re-read
        warnings, errors = [*errors, *warnings], []
    return Declaration(
        where=where,
        error="; ".join(errors[:MAX_ERRORS]) or None,
        warnings=tuple(warnings[:MAX_ERRORS]),
        shares=tuple(shares),
        unresolved="; ".join(unresolved[:MAX_ERRORS]) or None,
    )


def _merged(uses: tuple[ClaimUse, ...]) -> list[ClaimUse]:
    """One use per claim (its requests merged, all of them winning): a result is one share
    however many containers, or requests naming it, use it."""
    merged: dict[ClaimKey, ClaimUse] = {}
    for use in uses:
        seen = merged.get(use.key)
        if seen is None:
            merged[use.key] = use
            continue
        requests = (
            None if seen.requests is None or use.requests is None else seen.requests | use.requests
        )
        containers = tuple(dict.fromkeys((*seen.containers, *use.containers)))
        merged[use.key] = ClaimUse(key=use.key, requests=requests, containers=containers)
    return list(merged.values())


def _claim_shares(
    use: ClaimUse,
    claim: Claim,
    *,
    devices: Mapping[SliceDevice, SlicedDevice],
    shares: list[DraShare],
    unresolved: list[str],
    warnings: list[str],
    errors: list[str],
) -> None:
    """Append the shares of ``claim``'s results that ``use`` names, on devices
    ``share_refusal`` accepts (a result of another driver is no share; one on a device of
    another type, said so)."""
    if claim.error is not None:
        errors.append(f"ResourceClaim {use.key}: {claim.error}")
        return
    if not claim.allocated:
        warnings.append(f"ResourceClaim {use.key} is not allocated: it grants no share")
        return
    mine = [
        r
        for r in claim.results
        if share_refusal(r.driver, None) is None
        and (use.requests is None or r.request.partition("/")[0] in use.requests)
    ]
    if use.requests is not None:
        absent = sorted(
            q
            for q in use.requests
            if not any(r.request.partition("/")[0] == q for r in claim.results)
        )
        if absent:
            warnings.append(
                f"ResourceClaim {use.key} has no result for request {', '.join(absent[:4])}"
            )
    if mine and claim.reserved_for > 1:
        warnings.append(
            f"ResourceClaim {use.key} is reserved for {claim.reserved_for} pods: the scheduler "
            "counted its share once, so each of them is held to the whole share, and those on "
            "this node together to it (the largest users stopped first)"
        )
    for r in mine:
        sliced = devices.get((r.driver, r.pool, r.device))
        refusal = None if sliced is None else share_refusal(r.driver, sliced.type)
        what = f"ResourceClaim {use.key}: device {r.pool}/{r.device} of driver {r.driver}"
        if sliced is not None and refusal is not None:
            warnings.append(f"{what}: {refusal}: no GPU memory share, it caps nothing")
            continue
        if sliced is not None and sliced.type == MIG_TYPE and not _mig_known(sliced):
            unresolved.append(f"{what}: {_MIG_UNKNOWN}")
            continue
        shares.append(
            DraShare(
                claim_namespace=use.key.namespace,
                claim_name=use.key.name,
                request=r.request,
                driver=r.driver,
                pool=r.pool,
                device=r.device,
                share_id=r.share_id,
                memory_bytes=None if _whole(r, sliced) else r.memory_bytes,
                uuid=None if sliced is None else sliced.uuid or sliced.parent_uuid,
                pods_sharing=max(1, claim.reserved_for),
                mig_uuid=None if sliced is None else sliced.mig_uuid,
                mig_placement=(
                    None if sliced is None or sliced.mig_uuid is not None else sliced.mig_placement
                ),
            )
        )


_MIG_UNKNOWN = (
    "it is a MIG device whose MIG instance cannot be told: no parentUUID, or neither its own "
    "uuid (static MIG) nor a name gpu-<minor>-mig-<profile>-<profile ID>-<placement start> "
    "matching its profile (dynamic MIG)"
)


def _mig_known(device: SlicedDevice) -> bool:
    """Whether a MIG device's share can find its NVML MIG instance (``DraShare.is_on``): a
    static one by its own ``uuid``, a dynamic one by its profile and placement, both on its
    ``parentUUID``'s GPU. Never by the parent alone."""
    return device.parent_uuid is not None and (
        device.mig_uuid is not None or device.mig_placement is not None
    )


def _whole(result: AllocationResult, device: SlicedDevice | None) -> bool:
    """Whether ``result`` allocated its device whole: it consumed no memory capacity, or all
    the device advertises. A whole device is held to its real memory (NVML's total), never to
    the advertised number: with the driver's DynamicMIG feature a full GPU advertises the
    largest MIG profile's memory (``capacity`` is ``maxCapacities``, the maximum over the MIG
    profiles, ``cmd/gpu-kubelet-plugin/partitions.go`` ``PartCapacities`` and ``nvlib.go``
    ``inspectMigProfilesAndPlacements``, kubernetes-sigs/dra-driver-nvidia-gpu at 9593204), so
    a claim given the whole GPU (no memory request: the policy's default, all of it) consumes
    less than the GPU has, and a pod holding it to that would be stopped below what the
    scheduler gave it."""
    if result.memory_bytes is None:
        return True
    return (
        device is not None
        and device.memory_bytes is not None
        and (result.memory_bytes >= device.memory_bytes)
    )


def _where(pod: PodClaims) -> str:
    names = [str(use.key) for use in pod.uses]
    names += [f"pod claim {name} (not created yet)" for name in pod.pending]
    shown = ", ".join(_clip(n, 120) for n in names[:MAX_WHERE_CLAIMS])
    more = f" and {len(names) - MAX_WHERE_CLAIMS} more" if len(names) > MAX_WHERE_CLAIMS else ""
    if not names:
        return "ResourceClaims (malformed)"
    return f"ResourceClaim{'s' if len(names) > 1 else ''} {shown}{more}"


# -- hostile values --------------------------------------------------------------------------


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object, where: str, bound: int, errors: list[str]) -> list[object]:
    """``value`` when a list of at most ``bound`` items; else nothing read (``None`` silently)."""
    if value is None:
        return []
    if not isinstance(value, list):
        errors.append(f"{where} is {_show(value)}, not a list")
        return []
    if len(value) > bound:
        errors.append(f"{where} has {len(value)} items, more than {bound}: none is read")
        return []
    return value


def _name(value: object) -> str | None:
    """A non-empty string the API server could hold as a name (printable, bounded)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME and value.isprintable():
        return value
    return None


def _text(value: object, bound: int) -> str:
    return value if isinstance(value, str) and len(value) <= bound else ""


def _show(value: object) -> str:
    return show(value) if isinstance(value, str) else _SHORT.repr(value)


def _clip(text: str, bound: int = 300) -> str:
    return text if len(text) <= bound else text[:bound] + "…"


def _bounded(messages: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_clip(m) for m in messages))[:MAX_ERRORS]
