"""The one translation of Kubernetes JSON into ``core.model``: a Pod manifest → ``Pod``, a Node →
``NodeFacts``, a Namespace → whether it carries the admin's exempt label; for the sharing agent,
a Node → ``core.reconcile.NodeView`` and a pod → whether it holds a GPU.

Owns what an object means to gpuguard, for every source: the API server (``pods``, ``nodes``),
the pods file (``adapters.podfile``), ``check-pod`` and the simulator (``gpuguard.sim``), so a
manifest means the same everywhere (an unquoted ``limit: 8`` is invalid in all four). Every field
is hostile input of any shape (a pods file or a manifest is not validated by an API server): a
value of the wrong type is ignored, never an exception; what is kept of it is bounded by what
gpuguard reads, not by what a tenant wrote (``kept_annotations``). Must not import the
``kubernetes`` client (so the pods file, ``check-pod`` and the simulator can use it without
one), read files or log.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gpuguard.core.agent import PodOwner, holds_gpu
from gpuguard.core.limits import ANNOTATION_PREFIX
from gpuguard.core.model import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_MIRROR_ANNOTATION,
    LIMIT_ANNOTATION,
    ContainerId,
    NodeFacts,
    Pod,
    PodRef,
    PodUid,
)
from gpuguard.core.reconcile import NodeView
from gpuguard.kubemodel.declared import declarations
from gpuguard.kubemodel.quantity import (
    MAX_VALUE_CHARS,
    parse_limit_annotation,
    quantity_above_zero,
)

REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
CONTAINER_STATUS_LISTS = (
    "initContainerStatuses",
    "containerStatuses",
    "ephemeralContainerStatuses",
)
READ_ANNOTATIONS = (LIMIT_ANNOTATION, CONFIG_HASH_ANNOTATION, CONFIG_MIRROR_ANNOTATION)
"""The annotations a ``Pod`` keeps by name: the limit (``core.limits``, ``core.policy``) and a
static pod's two (``Pod.config_hash``). Other schedulers' annotations are read into
``Pod.declared`` and not kept."""
MAX_UNKNOWN_KEYS = 16
"""Other ``gpuguard.io/`` keys kept on a ``Pod`` (the first in sorted order), each reported as
unknown (``core.limits``): a tenant may write thousands, and one is enough to warn about."""
MAX_KEY_CHARS = 253 + 1 + 63
"""Longest annotation key the API server accepts (a DNS-subdomain prefix, ``/``, a name); a
longer one (a pods file is not validated) is not kept."""
MAX_KEPT_VALUE_CHARS = MAX_VALUE_CHARS
"""Longest annotation value kept whole: no value gpuguard reads is valid past it (a limit is at
most ``quantity.MAX_VALUE_CHARS``, a static pod's hash 32). A longer one is kept as its first
``MAX_KEPT_VALUE_CHARS`` characters, its length and a digest (``bounded_value``): still
invalid, still told apart from another long value, never 256 KiB kept per pod."""


def pod_from_json(obj: object) -> Pod | None:
    """A ``Pod`` from a pod's JSON, or ``None`` when it is not a pod with a uid/name/namespace
    (what the API server and the pods file hold)."""
    if not isinstance(obj, Mapping):
        return None
    meta = _mapping(obj.get("metadata"))
    uid, name, namespace = meta.get("uid"), meta.get("name"), meta.get("namespace")
    if not (isinstance(uid, str) and uid and isinstance(name, str) and isinstance(namespace, str)):
        return None
    return pod_from_manifest(obj, uid=PodUid(uid), namespace=namespace, name=name)


def pod_from_manifest(
    manifest: Mapping[str, Any], *, uid: PodUid, namespace: str, name: str
) -> Pod:
    """A ``Pod`` from a Pod manifest or pod template whose identity the caller has decided
    (``check-pod``: a template's pods carry their workload's namespace and name, and no uid
    before the API server assigns one).

    The limit annotation goes through ``kubemodel.quantity.parse_limit_annotation`` only, so a
    non-string value (unquoted ``8`` in YAML) is invalid everywhere, never "8 bytes".
    """
    raw_annotations = _mapping(_mapping(manifest.get("metadata")).get("annotations"))
    annotations = kept_annotations(raw_annotations)
    limit, error = parse_limit_annotation(raw_annotations)
    return Pod(
        uid=uid,
        namespace=namespace,
        name=name,
        annotations=MappingProxyType(annotations),
        config_hash=_mirror_hash(annotations),
        containers=MappingProxyType(_containers(_mapping(manifest.get("status")))),
        annotation_limit=limit,
        annotation_error=error,
        declared=MappingProxyType(declarations(manifest)),
    )


def kept_annotations(raw: Mapping[str, Any]) -> dict[str, str]:
    """The annotations gpuguard reads later, bounded: ``READ_ANNOTATIONS`` and at most
    ``MAX_UNKNOWN_KEYS`` other ``gpuguard.io/`` keys (any case), string values only, each
    value through ``bounded_value``. Everything else a tenant wrote is dropped here."""
    kept: dict[str, str] = {}
    unknown: list[str] = []
    for key, value in raw.items():
        if not (isinstance(key, str) and isinstance(value, str)) or len(key) > MAX_KEY_CHARS:
            continue
        if key in READ_ANNOTATIONS:
            kept[key] = bounded_value(value)
        elif key.lower().startswith(ANNOTATION_PREFIX):
            unknown.append(key)
    for key in sorted(unknown)[:MAX_UNKNOWN_KEYS]:
        kept[key] = bounded_value(raw[key])
    return kept


def bounded_value(value: str) -> str:
    """``value`` when it is at most ``MAX_KEPT_VALUE_CHARS`` long; else its start, its length
    and the first 16 hex digits of its SHA-256 (longer than the bound, so invalid wherever a
    value is checked, and two long values stay apart for ``core.policy``'s one Event per
    value)."""
    if len(value) <= MAX_KEPT_VALUE_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{value[:MAX_KEPT_VALUE_CHARS]}… ({len(value)} characters, sha256 {digest})"


MAX_CONTAINER_STATUSES = 256
"""Container statuses read per pod, over its three lists: ``Pod.containers`` maps a process's
container ID to the name a per-container declaration names, so it is bounded like every
other field (a pods file is not validated)."""
MAX_CONTAINER_NAME_CHARS = 63
"""A container's name is a DNS label: a longer one names no container and is not kept."""
MAX_CONTAINER_ID_CHARS = 128
"""A runtime's container ID (containerd's and CRI-O's are 64 hex digits); a longer one is not
kept."""


def _containers(status: Mapping[str, Any]) -> dict[ContainerId, str]:
    """Bare container ID → name, from the pod's container statuses, bounded: at most
    ``MAX_CONTAINER_STATUSES`` read, names and IDs of sane length only. An ID two statuses give
    different names belongs to neither (never charged to a guessed name)."""
    containers: dict[ContainerId, str] = {}
    clashing: set[ContainerId] = set()
    read = 0
    for key in CONTAINER_STATUS_LISTS:
        statuses = status.get(key)
        for raw_status in statuses if isinstance(statuses, list) else ():
            read += 1
            if read > MAX_CONTAINER_STATUSES:
                break
            cs = _mapping(raw_status)
            cid, cname = _bare_container_id(cs.get("containerID")), cs.get("name")
            if cid is None or not isinstance(cname, str):
                continue
            if len(cid) > MAX_CONTAINER_ID_CHARS or len(cname) > MAX_CONTAINER_NAME_CHARS:
                continue
            if containers.get(cid, cname) != cname:
                clashing.add(cid)
            containers[cid] = cname
    for cid in clashing:
        del containers[cid]
    return containers


def _bare_container_id(raw: object) -> ContainerId | None:
    """``containerd://<id>`` (or ``cri-o://``, ``docker://``) → ``<id>``; empty → ``None``."""
    if not isinstance(raw, str) or "://" not in raw:
        return None
    bare = raw.split("://", 1)[1].strip()
    return ContainerId(bare) if bare else None


_CONFIG_HASH = re.compile(r"[0-9a-f]{32}")
"""The kubelet's static-pod hash: 32 lowercase hex digits (an MD5), the form cgroups carry."""


def _mirror_hash(annotations: Mapping[str, str]) -> str | None:
    """The static pod's hash when these are a kubelet mirror pod's annotations, else ``None``:
    only the kubelet's mirror pods carry ``config.mirror`` (the API server forbids adding it to
    an existing pod), and it must name the same hash as ``config.hash``."""
    config_hash = annotations.get(CONFIG_HASH_ANNOTATION)
    if config_hash is None or annotations.get(CONFIG_MIRROR_ANNOTATION) != config_hash:
        return None
    return config_hash if _CONFIG_HASH.fullmatch(config_hash) else None


def node_facts_from_json(obj: object, *, name: str) -> NodeFacts:
    """This node's facts from its Node JSON; ``obj`` is ``None`` when the Node list answered
    without it (no such Node: no labels, but known to have none, so ``seen``)."""
    labels = _mapping(_mapping(_mapping(obj).get("metadata")).get("labels"))
    replicas: int | None = None
    raw = labels.get(REPLICAS_LABEL)
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and int(raw) > 0:
        replicas = int(raw)
    state = labels.get(MIG_CONFIG_STATE_LABEL)
    return NodeFacts(
        name=name,
        replicas=replicas,
        mig_config_state=state if isinstance(state, str) else None,
        seen=True,
    )


def labelled_namespace(obj: object, key: str, value: str) -> str | None:
    """A Namespace's name when it carries the label ``key=value``, else ``None`` (any shape):
    the admin's exempt label (``limits.exempt_namespace_label``), for the API server's watch
    and the pods file alike."""
    meta = _mapping(obj.get("metadata")) if isinstance(obj, Mapping) else {}
    name = meta.get("name")
    labels = _mapping(meta.get("labels"))
    if not isinstance(name, str) or not name:
        return None
    return name if labels.get(key) == value else None


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def agent_node_from_json(obj: object) -> tuple[NodeView, str]:
    """The agent's view of its Node (labels, annotations, ``spec.unschedulable``) and its
    ``metadata.resourceVersion`` (every agent patch is conditional on it). Values that are not
    strings are dropped: a label the agent cannot read is one it does not own."""
    meta = _mapping(_mapping(obj).get("metadata"))
    spec = _mapping(_mapping(obj).get("spec"))
    name = meta.get("name")
    version = meta.get("resourceVersion")
    unschedulable = spec.get("unschedulable") is True
    view = NodeView(
        name=name if isinstance(name, str) else "",
        labels=_strings(meta.get("labels")),
        annotations=_strings(meta.get("annotations")),
        unschedulable=unschedulable,
        unschedulable_by_gpuguard=unschedulable
        and _field_managers(meta.get("managedFields"), "f:spec", "f:unschedulable")
        == {GPUGUARD_FIELD_MANAGER},
    )
    return view, version if isinstance(version, str) else ""


GPUGUARD_FIELD_MANAGER = "gpuguard"
"""The field manager of every gpuguard write (``adapters.kube.agent.FIELD_MANAGER``)."""


def _field_managers(managed: object, *path: str) -> set[str]:
    """The managers whose ``managedFields`` entry (``fieldsV1``) owns the field at ``path``
    (``"f:spec", "f:unschedulable"``): only that fact is kept, never the entries. An entry of
    any other shape owns nothing; a manager that is not a string is named ``""`` (never
    gpuguard's)."""
    owners: set[str] = set()
    for entry in managed if isinstance(managed, list) else ():
        fields: object = _mapping(entry).get("fieldsV1")
        for key in path:
            fields = _mapping(fields).get(key)
        if fields is not None:
            manager = _mapping(entry).get("manager")
            owners.add(manager if isinstance(manager, str) else "")
    return owners


FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
"""Pod phases after which none of the pod's containers runs (the kubelet reports one only once
every container has stopped). The watches ask the API server to leave such pods out
(``NODE_POD_SELECTOR``), and the translation drops one that comes anyway."""
NODE_POD_SELECTOR = "spec.nodeName={node},status.phase!=Succeeded,status.phase!=Failed"
"""The field selector of every list and watch of a node's pods: its pods that have not
finished. A pod that finishes leaves the watch as ``DELETED``; the terminated-pod GC may keep
it in the API server for long (by default until 12,500 such pods exist in the cluster)."""


def node_pod_selector(node: str) -> str:
    return NODE_POD_SELECTOR.format(node=node)


def pod_finished(obj: object) -> bool:
    """The pod's ``status.phase`` is one of ``FINISHED_PHASES``."""
    return _mapping(_mapping(obj).get("status")).get("phase") in FINISHED_PHASES


def pod_uid(obj: object) -> PodUid | None:
    """``metadata.uid`` when it is a non-empty string."""
    uid = _mapping(_mapping(obj).get("metadata")).get("uid")
    return PodUid(uid) if isinstance(uid, str) and uid else None


def gpu_pod_from_json(obj: object) -> PodRef | None:
    """The pod, when it holds a GPU resource (``core.agent.holds_gpu``) and has not finished.

    Counted: every app container; an init container while the pod is ``Pending`` (init
    containers run then) and a sidecar (``restartPolicy: Always``) always. A pod being deleted
    still holds its GPU until it is gone.
    """
    pod = _mapping(obj)
    meta = _mapping(pod.get("metadata"))
    uid, name, namespace = meta.get("uid"), meta.get("name"), meta.get("namespace")
    if not (isinstance(uid, str) and uid and isinstance(name, str) and isinstance(namespace, str)):
        return None
    phase = _mapping(pod.get("status")).get("phase")
    if phase in FINISHED_PHASES:
        return None
    spec = _mapping(pod.get("spec"))
    names: set[str] = set()
    containers = spec.get("containers")
    inits = spec.get("initContainers")
    for raw in containers if isinstance(containers, list) else ():
        names.update(_resource_names(raw))
    for raw in inits if isinstance(inits, list) else ():
        if phase == "Pending" or _mapping(raw).get("restartPolicy") == "Always":
            names.update(_resource_names(raw))
    if not holds_gpu(names):
        return None
    return PodRef(uid=PodUid(uid), namespace=namespace, name=name)


def _resource_names(container: object) -> set[str]:
    """The resources a container requests or limits above zero (``nvidia.com/gpu: 0`` holds no
    GPU: the device plugin allocates none and a kubelet runs the pod even on a cordoned node).
    A quantity that is no quantity (only a pods file or a manifest can carry one; the API server
    refuses it) counts: the agent never takes a pod that may hold a GPU for idle."""
    resources = _mapping(_mapping(container).get("resources"))
    names: set[str] = set()
    for part in ("requests", "limits"):
        for key, amount in _mapping(resources.get(part)).items():
            if isinstance(key, str) and quantity_above_zero(amount) is not False:
                names.add(key)
    return names


OWNER_TEXT_CHARS = 253
"""Longest owner kind or name kept (a DNS subdomain's length): ``ownerReferences`` are written
by whoever creates the pod, and their names reach Events and logs."""
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
"""Set by the kubelet on the API server's copy of a static pod: deleting it only makes the
kubelet create it again."""


def gpu_pod_owner_from_json(obj: object) -> PodOwner:
    """Who keeps the pod on its node, as ``kubectl drain`` reads it: its controller
    (``ownerReferences`` entry with ``controller: true``) and whether it is a mirror pod."""
    meta = _mapping(_mapping(obj).get("metadata"))
    mirror = MIRROR_ANNOTATION in _mapping(meta.get("annotations"))
    refs = meta.get("ownerReferences")
    for raw in refs if isinstance(refs, list) else ():
        ref = _mapping(raw)
        kind, name = ref.get("kind"), ref.get("name")
        if ref.get("controller") is True and isinstance(kind, str) and isinstance(name, str):
            return PodOwner(
                kind=kind[:OWNER_TEXT_CHARS], name=name[:OWNER_TEXT_CHARS], mirror=mirror
            )
    return PodOwner(mirror=mirror)


def _strings(value: object) -> Mapping[str, str]:
    return MappingProxyType(
        {k: v for k, v in _mapping(value).items() if isinstance(k, str) and isinstance(v, str)}
    )
