"""DRA claims and claim templates found in manifests, for ``check-pod``: the GPU memory share each
device request would be held to, and which of them a pod's containers use.

Owns the manifest side of a ResourceClaim or ResourceClaimTemplate (``resource.k8s.io/v1``;
``v1beta2`` has the same shape; ``v1beta1`` puts ``exactly``'s fields on the request itself) and
the scheduler's rounding of a memory request: NVIDIA's DRA driver in ``memory`` mode publishes a
``requestPolicy`` of min 1Mi, step 1Mi, max and default the whole GPU, so a request is rounded up
to a whole MiB (``1500M`` is held to ``1431Mi``) and no request is the whole GPU. A claim that
is already allocated is held to its results' ``consumedCapacity.memory``, as the enforcer is.

Pure: no I/O, no client, no logging. Every input is hostile: any type anywhere gives a problem
string, never an exception, and counts are bounded by the API server's own limits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuguard.core.units import format_bytes
from gpuguard.kubemodel.dra import (
    NVIDIA_DEVICE_CLASSES,
    ContainerClaim,
    class_device,
    pod_claim_refs,
    share_refusal,
)
from gpuguard.kubemodel.quantity import (
    MAX_BYTES,
    InvalidQuantity,
    parse_quantity_bytes,
    show,
)

MEBIBYTE = 1 << 20
"""The step (and minimum) of the NVIDIA driver's ``memory`` request policy."""
MAX_SHARE_BYTES = (MAX_BYTES // MEBIBYTE) * MEBIBYTE
"""The largest share shown: the int64 bound quantities saturate at, rounded down to the step."""
MAX_REQUESTS = 32
"""``spec.devices.requests`` items the API server allows (DeviceRequestsMaxSize)."""
MAX_SUBREQUESTS = 8
"""``firstAvailable`` items the API server allows (FirstAvailableDeviceRequestMaxSize)."""
MAX_RESULTS = 32
"""``status.allocation.devices.results`` items the API server allows (AllocationResultsMaxSize)."""

CLAIM = "ResourceClaim"
TEMPLATE = "ResourceClaimTemplate"
API_VERSIONS = ("resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1")
NOT_ALLOCATED = "(not allocated)"


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestShare:
    """What one device request (or, allocated, one result) is held to."""

    request: str
    """The request's name; ``gpu/small`` for a ``firstAvailable`` subrequest or its result."""
    memory_bytes: int | None
    """Rounded up to 1Mi (a result's ``consumedCapacity.memory`` as written); ``None``: no
    memory was requested, the share is the whole GPU."""
    driver: str = ""
    pool: str = NOT_ALLOCATED
    device: str = NOT_ALLOCATED
    refusal: str | None = None
    """Why it is no GPU memory share gpuguard enforces (``dra.share_refusal``, the enforcer's
    rule, on the driver and device type its DeviceClass admits, or its result's driver);
    ``None``: it is one."""

    @property
    def top_request(self) -> str:
        """The request a container's ``resources.claims[].request`` names (``gpu`` of
        ``gpu/small``)."""
        return self.request.partition("/")[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimObject:
    """A ResourceClaim or ResourceClaimTemplate of the files."""

    kind: str
    namespace: str
    name: str
    where: str
    shares: tuple[RequestShare, ...]
    allocated: bool
    """Shares are the allocation's results (``consumedCapacity``), not the requests."""
    problems: tuple[str, ...] = ()
    """Why a share cannot be known (a wrong shape, an invalid quantity): no dra limit from it."""
    notes: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


ClaimKey = tuple[str, str, str]
"""``(kind, namespace, name)``."""


def claim_object(obj: Mapping[str, object], *, where: str) -> ClaimObject | None:
    """The claim or claim template ``obj`` is; ``None`` for any other kind (or no name)."""
    kind = obj.get("kind")
    if kind not in (CLAIM, TEMPLATE):
        return None
    metadata = _mapping(obj.get("metadata"))
    name = metadata.get("name")
    namespace = metadata.get("namespace") or "default"
    if not isinstance(name, str) or not name or not isinstance(namespace, str):
        return None
    api_version = obj.get("apiVersion")
    problems: list[str] = []
    notes: list[str] = []
    shares: list[RequestShare] = []
    allocation = _mapping(_mapping(obj.get("status")).get("allocation"))
    allocated = kind == CLAIM and bool(allocation)
    if api_version not in API_VERSIONS:
        problems.append(
            f"apiVersion {_show(api_version)} is not one check-pod reads "
            f"({', '.join(API_VERSIONS)})"
        )
    elif allocated:
        results = _mapping(allocation.get("devices")).get("results")
        classes = _request_classes(_mapping(_mapping(obj.get("spec")).get("devices")))
        shares = _results(results, problems, classes)
    else:
        path = "spec.spec.devices" if kind == TEMPLATE else "spec.devices"
        devices = _walk(obj, path, problems)
        requests = _mapping(devices).get("requests")
        inline = api_version == "resource.k8s.io/v1beta1"
        shares = _requests(requests, inline=inline, problems=problems, notes=notes)
    return ClaimObject(
        kind=kind,
        namespace=namespace,
        name=name,
        where=where,
        shares=tuple(shares),
        allocated=allocated,
        problems=tuple(problems),
        notes=tuple(notes),
    )


def round_up_to_step(value_bytes: int) -> int:
    """``value_bytes`` as the scheduler accounts it: at least 1Mi, rounded up to a 1Mi step
    (at most ``MAX_SHARE_BYTES``: a quantity saturated at the int64 bound stays in it)."""
    return min(MAX_SHARE_BYTES, max(MEBIBYTE, -(-value_bytes // MEBIBYTE) * MEBIBYTE))


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareUse:
    """A container's use of one share."""

    container: str
    claim: str
    """The pod's name for the claim (``spec.resourceClaims[].name``)."""
    source: ClaimObject
    share: RequestShare


@dataclass(frozen=True, slots=True, kw_only=True)
class PodShares:
    """What a pod's containers use of the claims in the files."""

    uses: tuple[ShareUse, ...] = ()
    missing: tuple[str, ...] = ()
    """Claims and templates the pod names that are not in the files (``ResourceClaimTemplate
    team-a/gpu-10gi``)."""
    problems: tuple[str, ...] = ()
    """Why a share is unknown (a claim's problem, a wrong shape in the pod): no dra limit."""
    warnings: tuple[str, ...] = ()


def pod_shares(
    pod: Mapping[str, object], *, namespace: str, claims: Mapping[ClaimKey, ClaimObject]
) -> PodShares:
    """The shares ``pod``'s containers use (a Pod, or a workload's pod template), looked up in
    ``claims`` in ``namespace``. The pod's references are read by ``dra.pod_claim_refs`` (as
    the enforcer reads them); a pod's ``status.resourceClaimStatuses`` name the claim made from
    a template: when that claim is in the files it is used instead of the template."""
    read = pod_claim_refs(pod)
    problems = list(read.errors)
    warnings: list[str] = []
    uses: list[ShareUse] = []
    missing: list[str] = []
    for ref in read.containers:
        found = _claim_in_files(ref, namespace, claims)
        if found is None:
            kind, name = (
                (CLAIM, ref.claim_name) if ref.template is None else (TEMPLATE, ref.template)
            )
            missing.append(f"{kind} {namespace}/{name}")
            continue
        problems.extend(f"{found.description}: {p}" for p in found.problems)
        warnings.extend(f"{found.description}: {n}" for n in found.notes)
        chosen = [s for s in found.shares if ref.request is None or s.top_request == ref.request]
        if ref.request is not None and not chosen:
            problems.append(
                f"container {ref.container} uses request {_show(ref.request)} of claim "
                f"{ref.claim}, which {found.description} does not have"
            )
        for share in chosen:
            if share.refusal is not None:
                warnings.append(
                    f"{found.description} request {share.request}: {share.refusal}; gpuguard "
                    "holds the pod to no share of it"
                )
                continue
            uses.append(
                ShareUse(container=ref.container, claim=ref.claim, source=found, share=share)
            )
    return PodShares(
        uses=tuple(uses),
        missing=tuple(dict.fromkeys(missing)),
        problems=tuple(dict.fromkeys(problems)),
        warnings=tuple(dict.fromkeys(warnings)),
    )


def _claim_in_files(
    ref: ContainerClaim, namespace: str, claims: Mapping[ClaimKey, ClaimObject]
) -> ClaimObject | None:
    """The claim ``ref`` names, else (made from a template) the claim made from it when the
    files hold it, else the template."""
    found = None
    if ref.claim_name is not None:
        found = claims.get((CLAIM, namespace, ref.claim_name))
    if found is None and ref.template is not None:
        found = claims.get((TEMPLATE, namespace, ref.template))
    return found


# ---------------------------------------------------------------------------------------------


def _requests(
    requests: object, *, inline: bool, problems: list[str], notes: list[str]
) -> list[RequestShare]:
    if requests is None:
        return []
    requests = _bounded_list(requests, "spec.devices.requests", MAX_REQUESTS, problems)
    shares: list[RequestShare] = []
    for index, request in enumerate(requests):
        where = f"spec.devices.requests[{index}]"
        name = _mapping(request).get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"{where}.name is missing or not a string")
            continue
        assert isinstance(request, Mapping)
        exactly = request.get("exactly")
        first = request.get("firstAvailable")
        if exactly is None and first is None and inline:
            exactly = request
        if isinstance(exactly, Mapping):
            memory, problem = _memory(exactly, f"request {name}")
            if problem is None:
                refusal = _class_refusal(exactly.get("deviceClassName"))
                shares.append(RequestShare(request=name, memory_bytes=memory, refusal=refusal))
            else:
                problems.append(problem)
        elif isinstance(first, list):
            share = _first_available(name, first, problems, notes)
            if share is not None:
                shares.append(share)
        else:
            problems.append(f"request {name} has neither exactly nor firstAvailable")
    return shares


def _first_available(
    name: str, subrequests: list[object], problems: list[str], notes: list[str]
) -> RequestShare | None:
    """The largest subrequest (the whole GPU above all): which one the scheduler picks is known
    only once allocated, and check-pod never shows less than the pod may be given."""
    if not subrequests or len(subrequests) > MAX_SUBREQUESTS:
        problems.append(
            f"request {name}: firstAvailable has {len(subrequests)} items (1 to "
            f"{MAX_SUBREQUESTS} allowed)"
        )
        return None
    shares: list[RequestShare] = []
    for sub in subrequests:
        sub_name = _mapping(sub).get("name")
        if not isinstance(sub_name, str) or not sub_name:
            problems.append(f"request {name}: a firstAvailable item has no name")
            return None
        assert isinstance(sub, Mapping)
        memory, problem = _memory(sub, f"request {name}/{sub_name}")
        if problem is not None:
            problems.append(problem)
            return None
        shares.append(
            RequestShare(
                request=f"{name}/{sub_name}",
                memory_bytes=memory,
                refusal=_class_refusal(sub.get("deviceClassName")),
            )
        )
    largest = max(shares, key=lambda s: (s.memory_bytes is None, s.memory_bytes or 0))
    if len(shares) > 1:
        listed = ", ".join(f"{s.request} {_size(s.memory_bytes)}" for s in shares)
        notes.append(
            f"request {name} is firstAvailable ({listed}): the scheduler picks one, shown is the "
            f"largest, {largest.request}; the enforcer holds the pod to the one allocated"
        )
    return largest


def _memory(fields: Mapping[str, object], what: str) -> tuple[int | None, str | None]:
    """``capacity.requests.memory`` rounded up to the 1Mi step; ``None``: the whole GPU."""
    capacity = fields.get("capacity")
    if capacity is None:
        return None, None
    if not isinstance(capacity, Mapping):
        return None, f"{what}: capacity is {_show(capacity)}, not a mapping"
    amounts = capacity.get("requests")
    if amounts is None:
        return None, None
    if not isinstance(amounts, Mapping):
        return None, f"{what}: capacity.requests is {_show(amounts)}, not a mapping"
    if "memory" not in amounts:
        return None, None
    value, problem = _bytes(amounts["memory"], f"{what}: capacity.requests.memory")
    return (None if value is None else round_up_to_step(value)), problem


def _class_refusal(device_class: object) -> str | None:
    """``share_refusal`` on what a request's DeviceClass admits: NVIDIA's classes are known
    (``dra.NVIDIA_DEVICE_CLASSES``); any other may select any driver's devices, so it is no
    share check-pod can show."""
    driver, device_type = class_device(device_class)
    if driver is None:
        return (
            f"DeviceClass {_show(device_class)} is not one of NVIDIA's GPU DeviceClasses "
            f"({', '.join(NVIDIA_DEVICE_CLASSES)}): check-pod cannot tell which devices it selects"
        )
    return share_refusal(driver, device_type)


def _request_classes(devices: Mapping[str, object]) -> dict[str, object]:
    """An allocated claim's requests (and ``firstAvailable`` subrequests, ``gpu/small``) →
    their ``deviceClassName``, as written (any type)."""
    classes: dict[str, object] = {}
    requests = devices.get("requests")
    if not isinstance(requests, list) or len(requests) > MAX_REQUESTS:
        return classes
    for request in requests:
        fields = _mapping(request)
        name = fields.get("name")
        if not isinstance(name, str):
            continue
        exactly = _mapping(fields.get("exactly"))
        classes[name] = exactly.get("deviceClassName", fields.get("deviceClassName"))
        first = fields.get("firstAvailable")
        if isinstance(first, list) and len(first) <= MAX_SUBREQUESTS:
            for sub in first:
                sub_name = _mapping(sub).get("name")
                if isinstance(sub_name, str):
                    classes[f"{name}/{sub_name}"] = _mapping(sub).get("deviceClassName")
    return classes


def _results(
    results: object, problems: list[str], classes: Mapping[str, object]
) -> list[RequestShare]:
    results = _bounded_list(results, "status.allocation.devices.results", MAX_RESULTS, problems)
    shares: list[RequestShare] = []
    for index, result in enumerate(results):
        fields = _mapping(result)
        request = fields.get("request")
        if not isinstance(request, str) or not request:
            problems.append(f"status.allocation.devices.results[{index}].request is missing")
            continue
        consumed = fields.get("consumedCapacity")
        memory: int | None = None
        if isinstance(consumed, Mapping) and "memory" in consumed:
            memory, problem = _bytes(consumed["memory"], f"result {request}: consumedCapacity")
            if problem is not None:
                problems.append(problem)
                continue
        elif consumed is not None and not isinstance(consumed, Mapping):
            problems.append(f"result {request}: consumedCapacity is {_show(consumed)}")
            continue
        driver = _text(fields.get("driver"))
        shares.append(
            RequestShare(
                request=request,
                memory_bytes=memory,
                driver=driver,
                pool=_text(fields.get("pool")),
                device=_text(fields.get("device")),
                refusal=share_refusal(driver, class_device(classes.get(request))[1]),
            )
        )
    return shares


def _bounded_list(value: object, where: str, bound: int, problems: list[str]) -> list[object]:
    """``value`` if it is a list of at most ``bound`` items (the API server's own limit); else
    a problem and nothing read."""
    if not isinstance(value, list):
        problems.append(f"{where} is {_show(value)}, not a list")
        return []
    if len(value) > bound:
        problems.append(
            f"{where} has {len(value)} items, more than the {bound} the API server allows"
        )
        return []
    return value


def _bytes(value: object, what: str) -> tuple[int | None, str | None]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        return None, f"{what} is {_show(value)}, not a quantity"
    try:
        return parse_quantity_bytes(value), None
    except InvalidQuantity as error:
        return None, f"{what}: {error}"


def _walk(obj: Mapping[str, object], path: str, problems: list[str]) -> object:
    """``obj`` at the dotted ``path``; ``None`` (a problem said) where it is not a mapping."""
    node: object = obj
    for depth, key in enumerate(path.split(".")):
        node = _mapping(node).get(key)
        if not isinstance(node, Mapping):
            where = ".".join(path.split(".")[: depth + 1])
            problems.append(f"{where} is {_show(node)}, not a mapping")
            return None
    return node


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, Mapping) else {}


def _text(value: object) -> str:
    return value if isinstance(value, str) and len(value) <= 253 else ""


def _show(value: object) -> str:
    return show(value) if isinstance(value, str) else show(repr(value))


def _size(memory_bytes: int | None) -> str:
    return "the whole GPU" if memory_bytes is None else format_bytes(memory_bytes)
