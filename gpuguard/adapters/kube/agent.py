"""The sharing agent's reads and writes through the API server (docs/design.md, Sharing config).

Owns ``KubeSharingSource`` (``ports.SharingSource``): list + watch of the agent's Node, its
node's pods (those holding a GPU), the sharing ConfigMap and the two NVIDIA ConfigMaps the
sharing config names (followed as the config changes), validated together into one
``SharingDocument`` per content version; and ``KubeNodeWriter`` (``ports.NodeWriter``): the one
merge patch a turn makes (field manager ``gpuguard``, conditional on the Node's resourceVersion:
409 is ``WriteConflict``) and evictions through the Eviction API (429: a PodDisruptionBudget).
Must not decide anything (``core.reconcile`` does) and never blocks ``inputs()``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.kube.configmaps import ConfigMapState, ConfigMapWatch
from gpuguard.adapters.kube.errors import translate_error
from gpuguard.adapters.kube.reflector import MAX_LIST_PAGES, POD_PAGE_SIZE, Reflector, raw
from gpuguard.adapters.sharing_documents import (
    SHARING_KEY,
    DocumentError,
    Findings,
    config_map_profiles,
    config_map_ref,
    config_map_where,
    data_value,
    missing_config_map,
    single_document,
    validate_sharing,
)
from gpuguard.core.agent import (
    EvictionOutcome,
    NodePatch,
    PodOwner,
    SharingDocument,
    SharingInputs,
)
from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import CORDONED_BY_AGENT, CORDONED_BY_ANNOTATION, CordonAction
from gpuguard.core.reconcile import NodeView as AgentNodeView
from gpuguard.core.sharing import ConfigMapRef, MissingConfig
from gpuguard.errors import GpuguardError, WriteConflict
from gpuguard.kubemodel.translate import (
    GPUGUARD_FIELD_MANAGER,
    agent_node_from_json,
    gpu_pod_from_json,
    gpu_pod_owner_from_json,
    node_pod_selector,
    pod_uid,
)
from gpuguard.ports import HealthRecorder

log = structlog.get_logger(__name__)

FIELD_MANAGER = GPUGUARD_FIELD_MANAGER
MERGE_PATCH = "application/merge-patch+json"
_REFERENCES = ("devicePluginConfig", "migConfig")
"""The sharing config's two references to NVIDIA's ConfigMaps, in ``parse_sharing``'s order."""


@dataclass(frozen=True, slots=True)
class _PodSeen:
    """One pod object as read, translated (the agent keeps nothing else of it): its uid, the
    pod when it holds a GPU and has not finished, and whether it is being deleted."""

    uid: PodUid | None
    ref: PodRef | None
    owner: PodOwner | None
    """Its controller (kind, name) and whether it is a mirror pod, for a GPU pod only."""
    terminating: bool


def _pod_seen(obj: dict[str, Any]) -> _PodSeen:
    ref = gpu_pod_from_json(obj)
    return _PodSeen(
        uid=pod_uid(obj),
        ref=ref,
        owner=gpu_pod_owner_from_json(obj) if ref is not None else None,
        terminating=ref is not None and _terminating(obj),
    )


class KubeSharingSource:
    """``ports.SharingSource`` over list + watch; ``start()`` once, ``stop()`` at shutdown."""

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        sharing_namespace: str,
        sharing_name: str,
        health: HealthRecorder | None = None,
        watch_timeout_seconds: float = 60.0,
        connect_timeout_seconds: float = 5.0,
        inactivity_seconds: float = 15.0,
    ) -> None:
        self.node_name = node_name
        self._core: Any = k8s.CoreV1Api(api)
        self._health = health
        self._timeouts: dict[str, Any] = {
            "watch_timeout_seconds": watch_timeout_seconds,
            "connect_timeout_seconds": connect_timeout_seconds,
            "inactivity_seconds": inactivity_seconds,
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._node: tuple[AgentNodeView, str] | None = None
        self._node_synced = False
        self._pods: dict[PodUid, PodRef] = {}
        self._owners: dict[PodUid, PodOwner] = {}
        self._terminating: set[PodUid] = set()
        self._pods_synced = False
        self._problems: dict[str, GpuguardError] = {}
        self._nvidia: dict[tuple[str, str], ConfigMapWatch] = {}
        self._wanted: set[tuple[str, str]] = set()  # NVIDIA ConfigMaps followed: those named
        self._dropped: list[ConfigMapWatch] = []
        self._parsed: tuple[str, object] | None = None  # one version parsed, or DocumentError
        self._cache: tuple[str, SharingDocument] | None = None
        self._threads: list[threading.Thread] = []
        self._sharing = ConfigMapWatch(
            self._core,
            namespace=sharing_namespace,
            name=sharing_name,
            on_change=self._sharing_changed,
            health=health,
            **self._timeouts,
        )
        common: dict[str, Any] = {"stop_event": self._stop, "health": health, **self._timeouts}
        self._reflectors = self._watches(node_name, common)

    def _watches(self, node_name: str, common: dict[str, Any]) -> tuple[Reflector[Any], ...]:
        """The list + watch of the agent's Node and of its node's pods (translated as read)."""
        return (
            Reflector(
                name="agent node",
                call=self._core.list_node,
                field_selector=f"metadata.name={node_name}",
                resource="nodes",
                scope="cluster scope",
                translate=raw,
                on_replace=lambda items: self._node_seen(items[0] if items else None),
                on_event=lambda kind, obj: self._node_seen(None if kind == "DELETED" else obj),
                on_contact=lambda: None,
                on_problem=lambda p: self._set_problem("node", p),
                **common,
            ),
            Reflector(
                name="agent pods",
                call=self._core.list_pod_for_all_namespaces,
                field_selector=node_pod_selector(node_name),
                resource="pods",
                scope="cluster scope",
                translate=_pod_seen,
                on_replace=self._pods_replaced,
                on_event=self._pod_event,
                on_contact=lambda: None,
                on_problem=lambda p: self._set_problem("pods", p),
                page_size=POD_PAGE_SIZE,
                **common,
            ),
        )

    # -- ports.Lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("KubeSharingSource already started")
        for reflector in self._reflectors:
            t = reflector.thread(f"gpuguard-{reflector.name}")
            self._threads.append(t)
            t.start()
        self._sharing.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        for reflector in self._reflectors:
            reflector.interrupt()
        self._sharing.stop(timeout)
        with self._lock:
            watches = [*self._nvidia.values(), *self._dropped]
        for watch in watches:
            watch.stop(timeout)
        for t in self._threads:
            t.join(timeout)

    def wait_synced(self, timeout_seconds: float) -> bool:
        deadline = threading.Event()
        for _ in range(max(1, int(timeout_seconds / 0.05))):
            if self.inputs().synced:
                return True
            deadline.wait(0.05)
        return self.inputs().synced

    def problem(self) -> GpuguardError | None:
        """The Node, pods or sharing ConfigMap cannot be read. An NVIDIA ConfigMap the sharing
        config names but the agent cannot read (or that does not exist) is not a problem of the
        agent's: the labels that need it are held, per rule, and reported on the Node
        (``SharingConfigInvalid``); the rest of the config applies."""
        with self._lock:
            problems = list(self._problems.values())
        sharing = self._sharing.current().problem
        return problems[0] if problems else sharing

    # -- ports.SharingSource ---------------------------------------------------------------------

    def inputs(self) -> SharingInputs:
        sharing = self._sharing.current()
        with self._lock:
            node, node_synced = self._node, self._node_synced
            pods = tuple(sorted(self._pods.values(), key=lambda p: (p.namespace, p.name)))
            terminating = frozenset(self._terminating)
            owners = dict(self._owners)
            pods_synced = self._pods_synced
        synced, document = self._document(sharing)
        return SharingInputs(
            synced=synced and node_synced and pods_synced,
            node=node[0] if node else None,
            resource_version=node[1] if node else "",
            gpu_pods=pods,
            terminating=terminating,
            owners=owners,
            document=document,
        )

    def gpu_pods_now(self) -> tuple[PodRef, ...]:
        """A quorum read (no resourceVersion: from etcd, not a cache) of the node's pods holding
        a GPU: the watch may lag behind a pod bound a moment ago. Read in pages of
        ``POD_PAGE_SIZE``, each translated before the next is asked for (one consistent view:
        the continuations read at the first page's resourceVersion)."""
        found: list[PodRef] = []
        token: str | None = None
        for _ in range(MAX_LIST_PAGES):
            refs, token = self._gpu_pods_page(token)
            found.extend(refs)
            if token is None:
                break
        return tuple(found)

    def _gpu_pods_page(self, token: str | None) -> tuple[list[PodRef], str | None]:
        """One page of ``gpu_pods_now``: its GPU pods and the continue token (``None`` last);
        the raw body lives in this frame only."""
        kwargs: dict[str, Any] = {"limit": POD_PAGE_SIZE}
        if token:
            kwargs["_continue"] = token
        try:
            resp = self._core.list_pod_for_all_namespaces(
                field_selector=node_pod_selector(self.node_name),
                _preload_content=False,
                _request_timeout=(self._timeouts["connect_timeout_seconds"], 30.0),
                **kwargs,
            )
            try:
                body = json.loads(resp.read())  # read(): .data would keep the body
            finally:
                resp.release_conn()
        except Exception as exc:
            raise _error(exc, "list", "pods", "cluster scope") from exc
        body = body if isinstance(body, dict) else {}
        items = body.get("items")
        refs = [gpu_pod_from_json(i) for i in (items if isinstance(items, list) else ())]
        meta = body.get("metadata")
        cont = meta.get("continue") if isinstance(meta, dict) else None
        return [r for r in refs if r is not None], cont if isinstance(cont, str) and cont else None

    # -- the sharing document --------------------------------------------------------------------

    def _document(self, sharing: ConfigMapState) -> tuple[bool, SharingDocument | None]:
        """Whether every source it needs has answered, and the validated document."""
        if not sharing.synced:
            return False, None
        if sharing.data is None:
            return True, None
        document = self._parse(sharing)
        if isinstance(document, DocumentError):
            return True, SharingDocument(
                version=sharing.version, config=None, errors=(str(document),)
            )
        where = self._where()
        refs = [config_map_ref(document, ref) for ref in _REFERENCES]
        states = [self._watch(ref) if ref is not None else None for ref in refs]
        if any(s is not None and not s.synced and s.problem is None for s in states):
            return False, None  # not answered yet
        version = "|".join([sharing.version, *(_version(s) for s in states)])
        with self._lock:
            if self._cache is not None and self._cache[0] == version:
                return True, self._cache[1]
        result = self._validate(document, where, refs, states, version)
        with self._lock:
            self._cache = (version, result)
        return True, result

    def _where(self) -> str:
        return f"configmap {self._sharing.namespace}/{self._sharing.name}"

    def _parse(self, sharing: ConfigMapState) -> object:
        """The sharing document of this ConfigMap version (parsed once per version), or the
        ``DocumentError`` that says why there is none."""
        with self._lock:
            if self._parsed is not None and self._parsed[0] == sharing.version:
                return self._parsed[1]
        where = self._where()
        document: object
        try:
            text = data_value(sharing.data or {}, SHARING_KEY, where)
            document = single_document(text, f"{where}: {SHARING_KEY}", "sharing")
        except DocumentError as error:
            document = error
        with self._lock:
            self._parsed = (sharing.version, document)
        return document

    def _validate(
        self,
        document: object,
        where: str,
        refs: list[ConfigMapRef | None],
        states: list[ConfigMapState | None],
        version: str,
    ) -> SharingDocument:
        findings = Findings()
        profiles: list[frozenset[str] | None] = []
        missing: dict[str, MissingConfig] = {}
        for reference, ref, state in zip(_REFERENCES, refs, states, strict=True):
            gone = None if ref is None or state is None else _missing(ref, state)
            if gone is not None:
                missing[reference] = gone
            if ref is None or state is None or state.data is None or gone is not None:
                profiles.append(None)
            else:
                profiles.append(config_map_profiles(ref, state.data, findings))
        validation = validate_sharing(
            document,
            where=where,
            findings=findings,
            device_plugin=profiles[0],
            mig=profiles[1],
            missing=missing,
        )
        return SharingDocument(
            version=version,
            config=validation.config if not findings.errors else None,
            errors=tuple(findings.errors),
            warnings=tuple(findings.warnings),
        )

    def _watch(self, ref: ConfigMapRef) -> ConfigMapState:
        key = (ref.namespace, ref.name)
        with self._lock:
            watch = self._nvidia.get(key)
            if watch is None and key in self._wanted and not self._stop.is_set():
                watch = self._nvidia[key] = ConfigMapWatch(
                    self._core,
                    namespace=ref.namespace,
                    name=ref.name,
                    on_change=lambda: None,
                    health=self._health,
                    **self._timeouts,
                )
                watch.start()
        return watch.current() if watch is not None else ConfigMapState()

    def _sharing_changed(self) -> None:
        """Stop following the NVIDIA ConfigMaps the new sharing config no longer names."""
        state = self._sharing.current()
        wanted: set[tuple[str, str]] = set()
        if state.data is not None:
            document = self._parse(state)
            for reference in _REFERENCES:
                ref = config_map_ref(document, reference)
                if ref is not None:
                    wanted.add((ref.namespace, ref.name))
        with self._lock:
            self._wanted = wanted
            dropped = [w for k, w in self._nvidia.items() if k not in wanted]
            self._nvidia = {k: w for k, w in self._nvidia.items() if k in wanted}
            self._dropped = [w for w in self._dropped if w.alive] + dropped
        for watch in dropped:
            watch.stop(0.0)  # joined in stop()

    # -- Node and pods ---------------------------------------------------------------------------

    def _node_seen(self, obj: Mapping[str, Any] | None) -> None:
        with self._lock:
            self._node = agent_node_from_json(obj) if obj is not None else None
            self._node_synced = True

    def _pods_replaced(self, items: list[_PodSeen]) -> None:
        pods: dict[PodUid, PodRef] = {}
        owners: dict[PodUid, PodOwner] = {}
        terminating: set[PodUid] = set()
        for item in items:
            if item.ref is not None:
                pods[item.ref.uid] = item.ref
                if item.owner is not None:
                    owners[item.ref.uid] = item.owner
                if item.terminating:
                    terminating.add(item.ref.uid)
        with self._lock:
            self._pods = pods
            self._owners = owners
            self._terminating = terminating
            self._pods_synced = True

    def _pod_event(self, kind: str, seen: _PodSeen) -> None:
        ref = None if kind == "DELETED" else seen.ref
        with self._lock:
            if ref is not None:
                self._pods[ref.uid] = ref
                if seen.owner is not None:
                    self._owners[ref.uid] = seen.owner
                if seen.terminating:
                    self._terminating.add(ref.uid)
            elif seen.uid is not None:
                self._pods.pop(seen.uid, None)
                self._owners.pop(seen.uid, None)
                self._terminating.discard(seen.uid)

    def _set_problem(self, name: str, problem: GpuguardError | None) -> None:
        with self._lock:
            if problem is None:
                self._problems.pop(name, None)
            else:
                self._problems[name] = problem


def _version(state: ConfigMapState | None) -> str:
    """One NVIDIA ConfigMap's part of the validated content's version."""
    if state is None:
        return "-"
    if not state.synced:
        return "unreadable"
    return state.version or "absent"


def _terminating(obj: Mapping[str, Any]) -> bool:
    meta = obj.get("metadata")
    return isinstance(meta, Mapping) and bool(meta.get("deletionTimestamp"))


def _missing(ref: ConfigMapRef, state: ConfigMapState) -> MissingConfig | None:
    """A referenced NVIDIA ConfigMap the agent cannot use: it cannot be read (a name RBAC does
    not grant) or does not exist. Only the labels whose rules need it are held, per rule: a
    cluster with the device plugin but without NVIDIA's MIG manager still gets its time-slicing
    labels. ``None``: it is there (its content is validated as usual)."""
    if not state.synced and state.problem is not None:
        return MissingConfig(
            code="config_map_unreadable",
            detail=f"{config_map_where(ref)} cannot be read ({state.problem}); grant the agent "
            "get/list/watch on it or name another",
        )
    if state.data is None:
        return missing_config_map(ref)
    return None


class KubeNodeWriter:
    """``ports.NodeWriter``: the agent's Node patch and its evictions."""

    def __init__(
        self, api: k8s.ApiClient, *, node_name: str, request_timeout_seconds: float = 10.0
    ) -> None:
        self._core: Any = k8s.CoreV1Api(api)
        self._node = node_name
        self._timeout = request_timeout_seconds

    def patch_node(self, patch: NodePatch) -> str:
        body = node_patch_body(patch)
        try:
            resp = self._core.patch_node(
                self._node,
                body,
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            answer = json.loads(resp.data)
            resp.release_conn()
        except Exception as exc:
            if isinstance(exc, k8s.ApiException) and exc.status == 409:
                raise WriteConflict(f"patch node {self._node}: the Node changed (409)") from exc
            raise _error(exc, "patch", "nodes", "cluster scope") from exc
        version = (answer.get("metadata") or {}).get("resourceVersion")
        return version if isinstance(version, str) else ""

    def evict(self, pod: PodRef) -> EvictionOutcome:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod.name, "namespace": pod.namespace},
            "deleteOptions": {"preconditions": {"uid": pod.uid}},
        }
        try:
            resp = self._core.create_namespaced_pod_eviction(
                pod.name,
                pod.namespace,
                body,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            _ = resp.data
            resp.release_conn()
        except Exception as exc:
            if isinstance(exc, k8s.ApiException) and exc.status == 429 and _budget(exc):
                return EvictionOutcome.BLOCKED
            if isinstance(exc, k8s.ApiException) and exc.status in (404, 409):
                return EvictionOutcome.GONE  # 409: the uid precondition: another pod now
            raise _error(exc, "create", "pods/eviction", f"namespace {pod.namespace!r}") from exc
        return EvictionOutcome.EVICTED


def _budget(exc: k8s.ApiException) -> bool:
    """A 429 from a PodDisruptionBudget (cause ``DisruptionBudget``), not from the API server's
    own request throttling (a retryable error like any other)."""
    try:
        body = json.loads(exc.body or b"{}")
        causes = (body.get("details") or {}).get("causes") or []
        return any(isinstance(c, dict) and c.get("reason") == "DisruptionBudget" for c in causes)
    except (ValueError, TypeError, AttributeError):
        return False


def node_patch_body(patch: NodePatch) -> dict[str, Any]:
    """The merge patch: ``resourceVersion`` (a conflict is a 409), the labels, the cordon and
    its annotation."""
    metadata: dict[str, Any] = {"resourceVersion": patch.resource_version}
    body: dict[str, Any] = {"metadata": metadata}
    if patch.labels:
        metadata["labels"] = dict(patch.labels)
    if patch.cordon is CordonAction.CORDON:
        body["spec"] = {"unschedulable": True}
        metadata["annotations"] = {CORDONED_BY_ANNOTATION: CORDONED_BY_AGENT}
    elif patch.cordon is CordonAction.UNCORDON:
        body["spec"] = {"unschedulable": None}
        metadata["annotations"] = {CORDONED_BY_ANNOTATION: None}
    elif patch.cordon is CordonAction.FORGET:
        metadata["annotations"] = {CORDONED_BY_ANNOTATION: None}
    return body


def _error(exc: BaseException, verb: str, resource: str, scope: str) -> GpuguardError:
    err = translate_error(exc, verb=verb, resource=resource, scope=scope)
    if isinstance(err, GpuguardError):
        return err
    return GpuguardError(f"{verb} {resource} ({scope}): {exc!r}")
