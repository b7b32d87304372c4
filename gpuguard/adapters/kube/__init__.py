"""Kubernetes adapter: this node's pods and Node labels (list + watch), Events on pods.

Owns everything that talks to the API server through the ``kubernetes`` client, and the ONE retry
policy of the project (``retry_policy``: jittered exponential backoff, ``Retry-After`` honoured).
Translates ``ApiException``/urllib3 errors into ``gpuguard.errors`` and JSON objects into
``core.model`` types: nothing above this module sees ``ApiException``, ``V1Pod`` or a raw dict.
Must not decide anything about enforcement (staleness is judged by the runtime from
``PodSnapshot.last_contact_at``), and must never block the caller of ``snapshot``, ``node``
or ``post``.

Threads, not asyncio tasks: the sync client blocks in socket reads for the whole life of a watch.
A blocked ``asyncio.to_thread`` call cannot be cancelled and pins a default-executor worker, so
loop shutdown would hang on it. Each watcher therefore runs in its own daemon thread with an
explicit ``start()``/``stop()``: ``stop()`` sets an event and closes the open response, which
ends the blocked read at once. The runtime only reads immutable snapshots.

Objects are read as raw JSON (``_preload_content=False``): one ``json.loads`` per event instead of
the client's model deserialisation, and no client model types leak into the translation code.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import structlog
import tenacity
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpuguard.adapters.quantity import parse_limit_annotation
from gpuguard.core.model import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_MIRROR_ANNOTATION,
    ContainerId,
    NodeFacts,
    Pod,
    PodEvent,
    PodSnapshot,
    PodUid,
    ambiguous_config_hashes,
    index_pods,
)
from gpuguard.errors import GpuguardError, KubeError, KubeForbidden, PermanentError
from gpuguard.ports import Clock

log = structlog.get_logger(__name__)

T = TypeVar("T")

REPLICAS_LABEL = "nvidia.com/gpu.replicas"
MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
EVENT_COMPONENT = "gpuguard"
RBAC_HINT = "apply manifests/rbac.yaml"

# ---------------------------------------------------------------------------------------------
# The retry policy (the only one in the project)

BACKOFF_INITIAL_SECONDS = 0.8
BACKOFF_MAX_SECONDS = 30.0
FORBIDDEN_RETRY_SECONDS = 60.0
"""Longest wait between retries of a 403. RBAC that is really missing does not fix itself in a
second, so the ladder climbs to a minute (never a crash-loop, matrix F6); but a 403 is also what
a restarted API server answers while its RBAC cache is still cold, so the ladder starts at the
ordinary first step and enforcement resumes seconds after the permission is back."""


def backoff_seconds(
    attempt: int, *, rng: random.Random | None = None, cap: float = BACKOFF_MAX_SECONDS
) -> float:
    """Wait before retry number ``attempt`` (1-based): 0.8 s doubling to ``cap`` (30 s), "equal
    jitter" (between half and all of the step) so that a fleet of nodes does not retry in
    lockstep."""
    step = min(cap, BACKOFF_INITIAL_SECONDS * 2.0 ** max(0, attempt - 1))
    jitter: float = (rng or random).random()
    return step * (0.5 + 0.5 * jitter)


class _Stopped(Exception):
    """Raised inside a retried call when ``stop()`` was requested; never retried."""


class _Gone(Exception):
    """``410 Gone``: the resourceVersion (or continue token) is too old; relist."""


class _RetryAfter(KubeError):
    """A retryable answer that named its own wait (429/503 ``Retry-After``)."""

    def __init__(self, message: str, retry_after_seconds: float) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


def _wait(state: tenacity.RetryCallState) -> float:
    exc = state.outcome.exception() if state.outcome is not None else None
    if isinstance(exc, KubeForbidden):
        return backoff_seconds(state.attempt_number, cap=FORBIDDEN_RETRY_SECONDS)
    seconds = backoff_seconds(state.attempt_number)
    if isinstance(exc, _RetryAfter):
        seconds = max(seconds, min(exc.retry_after_seconds, BACKOFF_MAX_SECONDS))
    return seconds


def _interruptible_sleep(stop_event: threading.Event, seconds: float) -> None:
    stop_event.wait(seconds)


def retry_policy(
    stop_event: threading.Event,
    *,
    what: str,
    retry_forbidden: bool = False,
    on_error: Callable[[GpuguardError], None] | None = None,
) -> tenacity.Retrying:
    """Retry ``KubeError`` (and ``KubeForbidden`` when asked) until success or ``stop_event``.

    Sleeps wake up on ``stop_event``; the call then raises the last error. Each call of the
    returned object starts from the first backoff step again (a success resets the backoff).
    """
    retryable: tuple[type[BaseException], ...] = (
        (KubeError, KubeForbidden) if retry_forbidden else (KubeError,)
    )

    def before_sleep(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, GpuguardError):
            if on_error is not None:
                on_error(exc)
            log.warning(
                "kube_retry",
                what=what,
                attempt=state.attempt_number,
                wait_seconds=round(state.upcoming_sleep, 2),
                error=str(exc),
            )

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(retryable),
        wait=_wait,
        stop=lambda _state: stop_event.is_set(),
        sleep=lambda seconds: _interruptible_sleep(stop_event, seconds),
        before_sleep=before_sleep,
        reraise=True,
    )


# ---------------------------------------------------------------------------------------------
# Error translation


def _status_message(exc: k8s.ApiException) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            text = body.decode() if isinstance(body, bytes) else str(body)
            message = json.loads(text).get("message")
            if isinstance(message, str) and message:
                return message
        except (ValueError, AttributeError):
            pass
    return str(getattr(exc, "reason", "") or "")


def _retry_after(exc: k8s.ApiException) -> float | None:
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def translate(exc: BaseException, *, verb: str, resource: str, scope: str) -> BaseException:
    """The gpuguard error for a client exception (``_Gone`` for 410); others pass through."""
    what = f"{verb} {resource} ({scope})"
    if isinstance(exc, k8s.ApiException):
        status = int(getattr(exc, "status", 0) or 0)
        message = _status_message(exc)
        if status == 403:
            return KubeForbidden(
                f"RBAC: the ServiceAccount cannot {verb!r} {resource!r} at {scope}; "
                f"{RBAC_HINT} (API server: {message})"
            )
        if status == 410:
            return _Gone(message)
        if status == 401:
            return KubeError(f"{what}: unauthorized (token expired or rotated?): {message}")
        if status in (429, 503):
            wait = _retry_after(exc)
            if wait is not None:
                return _RetryAfter(f"{what}: HTTP {status}: {message}", wait)
        if status == 0:
            return KubeError(f"{what}: cannot reach the API server: {message}")
        return KubeError(f"{what}: HTTP {status}: {message}")
    if isinstance(exc, (urllib3.exceptions.HTTPError, OSError, ValueError)):
        return KubeError(f"{what}: {type(exc).__name__}: {exc}")
    return exc


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An ``ApiClient`` from a kubeconfig file, or in-cluster (projected token, re-read on
    rotation by the client's refresh hook). urllib3's own retries are off: the retry policy
    above is the only one."""
    cfg = k8s.Configuration()
    if kubeconfig:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=cfg
        )
    else:
        k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=cfg
        )
    cfg.retries = False
    return k8s.ApiClient(configuration=cfg)


# ---------------------------------------------------------------------------------------------
# Translation of objects


def _bare_container_id(raw: object) -> ContainerId | None:
    """``containerd://<id>`` (or ``cri-o://``, ``docker://``) → ``<id>``; empty → ``None``."""
    if not isinstance(raw, str) or "://" not in raw:
        return None
    bare = raw.split("://", 1)[1].strip()
    return ContainerId(bare) if bare else None


def pod_from_json(obj: object) -> Pod | None:
    """A ``core.model.Pod`` from a pod's JSON, or ``None`` when it is not a pod with a
    uid/name/namespace.

    The one translation for the API server, the pods file and ``check-pod``. Every field is
    hostile input of any shape (a pods file or a manifest is not validated by an API server):
    a value of the wrong type is ignored, never an exception. The limit annotation goes through
    ``adapters.quantity.parse_limit_annotation`` only, so a non-string value (unquoted ``8`` in
    YAML) is invalid everywhere, never "8 bytes".
    """
    if not isinstance(obj, Mapping):
        return None
    meta = _mapping(obj.get("metadata"))
    uid, name, namespace = meta.get("uid"), meta.get("name"), meta.get("namespace")
    if not (isinstance(uid, str) and uid and isinstance(name, str) and isinstance(namespace, str)):
        return None
    raw_annotations = _mapping(meta.get("annotations"))
    annotations = {
        k: v for k, v in raw_annotations.items() if isinstance(k, str) and isinstance(v, str)
    }
    limit, error = parse_limit_annotation(raw_annotations)
    containers: dict[ContainerId, str] = {}
    status = _mapping(obj.get("status"))
    for key in ("initContainerStatuses", "containerStatuses", "ephemeralContainerStatuses"):
        statuses = status.get(key)
        for raw_status in statuses if isinstance(statuses, list) else ():
            cs = _mapping(raw_status)
            cid, cname = _bare_container_id(cs.get("containerID")), cs.get("name")
            if cid is not None and isinstance(cname, str):
                containers[cid] = cname
    return Pod(
        uid=PodUid(uid),
        namespace=namespace,
        name=name,
        annotations=MappingProxyType(annotations),
        config_hash=_mirror_hash(annotations),
        containers=MappingProxyType(containers),
        annotation_limit=limit,
        annotation_error=error,
    )


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


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLabels:
    """The labels of this node gpuguard reads, and whether the Node was seen at all."""

    found: bool
    replicas: int | None = None
    mig_config_state: str | None = None


def node_labels_from_json(obj: Mapping[str, Any] | None) -> NodeLabels:
    if obj is None:
        return NodeLabels(found=False)
    labels = (obj.get("metadata") or {}).get("labels") or {}
    replicas: int | None = None
    raw = labels.get(REPLICAS_LABEL)
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and int(raw) > 0:
        replicas = int(raw)
    state = labels.get(MIG_CONFIG_STATE_LABEL)
    return NodeLabels(
        found=True, replicas=replicas, mig_config_state=state if isinstance(state, str) else None
    )


# ---------------------------------------------------------------------------------------------
# List + watch of one selector


class _SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def _iter_lines(resp: Any) -> Iterator[bytes]:
    buffer = bytearray()
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer.extend(chunk)
        while (nl := buffer.find(b"\n")) != -1:
            line = bytes(buffer[:nl]).strip()
            del buffer[: nl + 1]
            if line:
                yield line
    if buffer.strip():
        yield bytes(buffer).strip()


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchStats:
    """Counters of one watcher, for metrics and tests."""

    lists: int
    watches: int
    gone: int
    errors: int


class _Reflector:
    """List, then watch from the list's resourceVersion; 410 → relist; errors → backoff.

    ``on_replace`` receives every object of a (re)list, ``on_event`` each watch event;
    ``on_contact`` is called after every successful answer from the API server.
    """

    def __init__(
        self,
        *,
        name: str,
        call: Callable[..., Any],
        field_selector: str,
        resource: str,
        scope: str,
        on_replace: Callable[[list[dict[str, Any]]], None],
        on_event: Callable[[str, dict[str, Any]], None],
        on_contact: Callable[[], None],
        on_problem: Callable[[GpuguardError | None], None],
        stop_event: threading.Event,
        watch_timeout_seconds: float,
        connect_timeout_seconds: float,
        inactivity_seconds: float,
        page_size: int = 500,
    ) -> None:
        self.name = name
        self._call = call
        self._selector = field_selector
        self._resource = resource
        self._scope = scope
        self._on_replace = on_replace
        self._on_event = on_event
        self._on_contact = on_contact
        self._on_problem = on_problem
        self._stop = stop_event
        self._watch_timeout = watch_timeout_seconds
        self._connect_timeout = connect_timeout_seconds
        self._inactivity = inactivity_seconds
        self._page_size = page_size
        self._rv: str | None = None
        self._resp_lock = threading.Lock()
        self._resp: Any = None
        self._gone_in_a_row = 0
        self.lists = 0
        self.watches = 0
        self.gone = 0
        self.errors = 0

    def stats(self) -> WatchStats:
        return WatchStats(
            lists=self.lists, watches=self.watches, gone=self.gone, errors=self.errors
        )

    def interrupt(self) -> None:
        """Close the open response (from another thread) so a blocked read returns now."""
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            with contextlib.suppress(AttributeError, OSError):
                resp.shutdown()  # urllib3 >= 2.3: unblocks a read in another thread
            with contextlib.suppress(OSError, ValueError, AttributeError):
                resp.close()

    def _on_retry_error(self, exc: GpuguardError) -> None:
        self.errors += 1
        if isinstance(exc, PermanentError):
            self._on_problem(exc)

    def _retrying(self, fn: Callable[[], T], what: str) -> T:
        for attempt in retry_policy(
            self._stop,
            what=f"{self.name}: {what}",
            retry_forbidden=True,
            on_error=self._on_retry_error,
        ):
            with attempt:
                if self._stop.is_set():
                    raise _Stopped
                return fn()
        raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover

    def run(self) -> None:
        try:
            while not self._stop.is_set():
                self._retrying(self._list, "list")
                while not self._stop.is_set():
                    try:
                        self._retrying(self._watch, "watch")
                        self._gone_in_a_row = 0
                    except _Gone as e:
                        self.gone += 1
                        self._gone_in_a_row += 1
                        log.info("kube_watch_gone", watcher=self.name, reason=str(e))
                        if self._gone_in_a_row > 1:  # 410 right after a relist: do not spin
                            self._stop.wait(backoff_seconds(self._gone_in_a_row - 1))
                        break
        except _Stopped:
            pass
        except GpuguardError:
            if not self._stop.is_set():
                raise

    def _request(self, verb: str, **kwargs: Any) -> Any:
        try:
            resp = self._call(field_selector=self._selector, _preload_content=False, **kwargs)
        except Exception as exc:
            raise translate(exc, verb=verb, resource=self._resource, scope=self._scope) from exc
        return resp

    def _list(self) -> None:
        for _ in range(3):
            try:
                self._list_pages()
                return
            except _Gone as e:  # the continue token expired between pages: start over
                log.info("kube_list_continue_expired", watcher=self.name, reason=str(e))
        raise KubeError(f"list {self._resource} ({self._scope}): continue token kept expiring")

    def _list_pages(self) -> None:
        items: list[dict[str, Any]] = []
        cont: str | None = None
        for _ in range(10_000):
            kwargs: dict[str, Any] = {"limit": self._page_size}
            if cont:
                kwargs["_continue"] = cont
            resp = self._request(
                "list",
                _request_timeout=(self._connect_timeout, self._inactivity),
                **kwargs,
            )
            try:
                body = json.loads(resp.data)
            except Exception as exc:
                raise translate(
                    exc, verb="list", resource=self._resource, scope=self._scope
                ) from exc
            finally:
                resp.release_conn()
            items.extend(i for i in body.get("items") or () if isinstance(i, dict))
            meta = body.get("metadata") or {}
            cont = meta.get("continue") or None
            if cont is None:
                self._rv = str(meta.get("resourceVersion") or "") or None
                break
        self.lists += 1
        self._on_contact()  # before the data, so a synced snapshot always has a contact time
        self._on_replace(items)
        self._on_problem(None)

    def _watch(self) -> None:
        """One watch request; returns at the server's timeout, raises on error or 410."""
        spread = random.uniform(0.8, 1.0)  # noqa: S311 - spreads re-watches of a fleet
        server_timeout = max(1, int(self._watch_timeout * spread))
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": server_timeout,
            "_request_timeout": (self._connect_timeout, server_timeout + self._inactivity),
        }
        if self._rv:
            kwargs["resource_version"] = self._rv
        resp = self._request("watch", **kwargs)
        with self._resp_lock:
            self._resp = resp
        if self._stop.is_set():  # stop() ran before _resp was set: it could not interrupt us
            self._release(resp)
            raise _Stopped
        self.watches += 1
        self._on_contact()
        try:
            for line in _iter_lines(resp):
                if self._stop.is_set():
                    raise _Stopped
                self._handle(json.loads(line))
            self._on_contact()  # the server closed the watch at timeoutSeconds: a contact
        except (_Stopped, _Gone, GpuguardError):
            raise
        except Exception as exc:
            if self._stop.is_set():
                raise _Stopped from exc
            raise translate(exc, verb="watch", resource=self._resource, scope=self._scope) from exc
        finally:
            self._release(resp)

    def _release(self, resp: Any) -> None:
        with self._resp_lock:
            self._resp = None
        with contextlib.suppress(Exception):
            # A watch can end mid-stream (stop, inactivity): close the connection rather than
            # hand a socket with unread bytes back to the pool.
            resp.close()
            resp.release_conn()

    def _handle(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            message = str(obj.get("message") or obj)
            if code == 410:
                raise _Gone(message)
            if code == 403:
                raise KubeForbidden(
                    f"RBAC: the ServiceAccount cannot 'watch' {self._resource!r} at "
                    f"{self._scope}; {RBAC_HINT} (API server: {message})"
                )
            raise KubeError(f"watch {self._resource} ({self._scope}): {message}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            self._on_event(kind, obj)
        if isinstance(rv, str) and rv:
            self._rv = rv
        self._on_contact()


# ---------------------------------------------------------------------------------------------
# The pod directory


class KubePodDirectory:
    """``ports.PodDirectory``: this node's pods and Node labels, kept by two watcher threads.

    Call ``start()`` once, ``stop()`` at shutdown. ``snapshot()``/``node()`` never block.
    """

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        clock: Clock | None = None,
        watch_timeout_seconds: float = 20.0,
        connect_timeout_seconds: float = 5.0,
        inactivity_seconds: float = 15.0,
        list_page_size: int = 500,
    ) -> None:
        """``watch_timeout_seconds`` is the server-side watch length: every re-watch is a
        contact, so keep it below the runtime's staleness bound (default 30 s) or
        ``last_contact_at`` of a quiet node would look stale. ``inactivity_seconds``: a watch
        that sends nothing for that long past its timeout is dropped (half-open TCP, F4)."""
        self.node_name = node_name
        self._clock: Clock = clock or _SystemClock()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pods: dict[PodUid, Pod] = {}
        self._ambiguous_hashes: tuple[str, ...] = ()
        self._view: Mapping[PodUid, Pod] = MappingProxyType({})
        self._synced = False
        self._last_contact: float | None = None
        self._labels = NodeLabels(found=False)
        self._node_synced = False
        self._problems: dict[str, GpuguardError] = {}
        self._synced_event = threading.Event()
        self._threads: list[threading.Thread] = []
        core: Any = k8s.CoreV1Api(api)
        common: dict[str, Any] = {
            "stop_event": self._stop,
            "watch_timeout_seconds": watch_timeout_seconds,
            "connect_timeout_seconds": connect_timeout_seconds,
            "inactivity_seconds": inactivity_seconds,
            "page_size": list_page_size,
        }
        self._pod_reflector = _Reflector(
            name="pods",
            call=core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node_name}",
            resource="pods",
            scope="cluster scope",
            on_replace=self._replace_pods,
            on_event=self._pod_event,
            on_contact=self._contact,
            on_problem=lambda p: self._set_problem("pods", p),
            **common,
        )
        self._node_reflector = _Reflector(
            name="node",
            call=core.list_node,
            field_selector=f"metadata.name={node_name}",
            resource="nodes",
            scope="cluster scope",
            on_replace=self._replace_node,
            on_event=self._node_event,
            on_contact=lambda: None,  # freshness is about pods only
            on_problem=lambda p: self._set_problem("node", p),
            **common,
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._threads:
            raise RuntimeError("KubePodDirectory already started")
        for reflector in (self._pod_reflector, self._node_reflector):
            t = threading.Thread(
                target=self._guarded,
                args=(reflector,),
                name=f"gpuguard-kube-{reflector.name}",
                daemon=True,
            )
            self._threads.append(t)
            t.start()

    def _guarded(self, reflector: _Reflector) -> None:
        try:
            reflector.run()
        except Exception as exc:  # a bug must not kill the thread silently
            log.exception("kube_watcher_crashed", watcher=reflector.name)
            self._set_problem(reflector.name, KubeError(f"{reflector.name} watcher crashed: {exc}"))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both watchers: interrupts open watches; joins the threads (bounded)."""
        self._stop.set()
        self._pod_reflector.interrupt()
        self._node_reflector.interrupt()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def wait_synced(self, timeout: float) -> bool:
        """Block until the first pod list completed (for start-up and tests)."""
        return self._synced_event.wait(timeout)

    # -- the port ------------------------------------------------------------------------------

    def snapshot(self) -> PodSnapshot:
        with self._lock:
            return PodSnapshot(
                synced=self._synced, last_contact_at=self._last_contact, pods=self._view
            )

    def node(self) -> NodeFacts:
        with self._lock:
            return NodeFacts(name=self.node_name, replicas=self._labels.replicas)

    # -- beyond the port -----------------------------------------------------------------------

    def node_labels(self) -> NodeLabels | None:
        """The node's labels gpuguard reads (``mig_config_state`` pauses enforcement);
        ``None`` before the first node list."""
        with self._lock:
            return self._labels if self._node_synced else None

    def problem(self) -> GpuguardError | None:
        """The current persistent problem (e.g. ``KubeForbidden``), cleared by a good list."""
        with self._lock:
            for key in ("pods", "node"):
                if key in self._problems:
                    return self._problems[key]
            return None

    def stats(self) -> Mapping[str, WatchStats]:
        return {
            "pods": self._pod_reflector.stats(),
            "node": self._node_reflector.stats(),
        }

    # -- callbacks from the watcher threads --------------------------------------------------

    def _contact(self) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._last_contact = now

    def _set_problem(self, key: str, problem: GpuguardError | None) -> None:
        with self._lock:
            if problem is None:
                self._problems.pop(key, None)
            else:
                if key not in self._problems:
                    log.error("kube_problem", watcher=key, error=str(problem))
                self._problems[key] = problem

    def _publish_pods(self) -> None:  # caller holds the lock
        self._view = index_pods(self._pods.values())
        ambiguous = ambiguous_config_hashes(self._pods.values())
        if ambiguous != self._ambiguous_hashes:
            self._ambiguous_hashes = ambiguous
            for config_hash in ambiguous:
                log.warning(
                    "static_pod_hash_ambiguous",
                    config_hash=config_hash,
                    pods=sorted(
                        f"{p.namespace}/{p.name}"
                        for p in self._pods.values()
                        if p.config_hash == config_hash
                    ),
                    detail="more than one pod claims this static pod's hash: its processes are "
                    "attributed to none of them",
                )

    def _replace_pods(self, items: list[dict[str, Any]]) -> None:
        pods: dict[PodUid, Pod] = {}
        for obj in items:
            pod = pod_from_json(obj)
            if pod is not None:
                pods[pod.uid] = pod
        with self._lock:
            self._pods = pods
            self._publish_pods()
            first = not self._synced
            self._synced = True
        self._synced_event.set()
        log.info("kube_pods_listed", node=self.node_name, pods=len(pods), first=first)

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        pod = pod_from_json(obj)
        if pod is None:
            return
        with self._lock:
            pods = dict(self._pods)
            if kind == "DELETED":
                pods.pop(pod.uid, None)
            else:
                pods[pod.uid] = pod
            self._pods = pods
            self._publish_pods()

    def _replace_node(self, items: list[dict[str, Any]]) -> None:
        labels = node_labels_from_json(items[0] if items else None)
        with self._lock:
            self._labels = labels
            self._node_synced = True

    def _node_event(self, kind: str, obj: dict[str, Any]) -> None:
        labels = node_labels_from_json(None if kind == "DELETED" else obj)
        with self._lock:
            self._labels = labels


# ---------------------------------------------------------------------------------------------
# Events


@dataclass(frozen=True, slots=True, kw_only=True)
class EventSinkStats:
    """What happened to posted events (all counters since start)."""

    posted: int
    sent: int
    dropped_buffer_full: int
    dropped_rate_limited: int
    failed: int
    """Given up on: RBAC denied, or the API refused this event (e.g. namespace gone)."""
    pending: int
    """Buffered plus in flight."""
    in_flight: int
    """Being sent (or retried) right now: 0 or 1."""


class _Bucket:
    __slots__ = ("tokens", "updated_at")

    def __init__(self, tokens: float, updated_at: float) -> None:
        self.tokens = tokens
        self.updated_at = updated_at


MAX_MESSAGE_CHARS = 1024


class KubeEventSink:
    """``ports.EventSink``: core/v1 Events on pods, posted by a background thread.

    ``post()`` never blocks: it rate-limits per pod (token bucket), appends to a bounded buffer
    (the oldest event is dropped, and counted, when the API is down long enough to fill it) and
    wakes the sender. The sender retries with the shared policy until the API is back.
    """

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        clock: Clock | None = None,
        buffer_size: int = 256,
        per_pod_burst: int = 5,
        per_pod_refill_seconds: float = 12.0,
        request_timeout_seconds: float = 10.0,
    ) -> None:
        # Any: the typed client declares model return types, but raw responses come back.
        self._core: Any = k8s.CoreV1Api(api)
        self._node = node_name
        self._clock: Clock = clock or _SystemClock()
        self._buffer: deque[PodEvent] = deque()
        self._buffer_size = buffer_size
        self._burst = float(per_pod_burst)
        self._refill = per_pod_refill_seconds
        self._timeout = request_timeout_seconds
        self._buckets: dict[PodUid, _Bucket] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._problem: GpuguardError | None = None
        self._in_flight = 0
        self._seq = itertools.count(random.getrandbits(20))  # unique names within this process
        self._posted = self._sent = self._dropped_full = self._dropped_rate = self._failed = 0

    def post(self, event: PodEvent) -> None:
        now = self._clock.monotonic()
        with self._cond:
            self._posted += 1
            if not self._take_token(event.pod.uid, now):
                self._dropped_rate += 1
                return
            if len(self._buffer) >= self._buffer_size:
                self._buffer.popleft()
                self._dropped_full += 1
            self._buffer.append(event)
            self._cond.notify()

    def _take_token(self, uid: PodUid, now: float) -> bool:  # caller holds the lock
        bucket = self._buckets.get(uid)
        if bucket is None:
            if len(self._buckets) > 4096:  # forget pods idle long enough to be full again
                horizon = self._refill * self._burst
                self._buckets = {
                    k: b for k, b in self._buckets.items() if now - b.updated_at < horizon
                }
            bucket = self._buckets[uid] = _Bucket(self._burst, now)
        refill = (now - bucket.updated_at) / self._refill if self._refill > 0 else self._burst
        bucket.tokens = min(self._burst, bucket.tokens + refill)
        bucket.updated_at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def stats(self) -> EventSinkStats:
        with self._cond:
            return EventSinkStats(
                posted=self._posted,
                sent=self._sent,
                dropped_buffer_full=self._dropped_full,
                dropped_rate_limited=self._dropped_rate,
                failed=self._failed,
                pending=len(self._buffer) + self._in_flight,
                in_flight=self._in_flight,
            )

    def problem(self) -> GpuguardError | None:
        with self._cond:
            return self._problem

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KubeEventSink already started")
        self._thread = threading.Thread(target=self._run, name="gpuguard-kube-events", daemon=True)
        self._thread.start()

    def stop(self, *, flush_seconds: float = 2.0) -> None:
        """Give pending events up to ``flush_seconds`` to go out, then stop the sender."""
        deadline = time.monotonic() + flush_seconds
        while time.monotonic() < deadline:
            with self._cond:
                if not self._buffer and not self._in_flight:
                    break
            time.sleep(0.05)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(1.0, self._timeout))

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cond:
                if not self._buffer and not self._in_flight:
                    return True
            time.sleep(0.02)
        return False

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._buffer and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                event = self._buffer.popleft()
                self._in_flight = 1
            try:
                self._send_with_retry(event)
            finally:
                with self._cond:
                    self._in_flight = 0

    def _send_with_retry(self, event: PodEvent) -> None:
        # One body, one name, for every attempt: when a response is lost after the API server
        # stored the Event (a dropped connection), the retry gets 409 instead of a duplicate.
        body = self.event_body(event)
        try:
            for attempt in retry_policy(self._stop, what="event"):
                with attempt:
                    self._send(event, body)
        except KubeForbidden as exc:
            with self._cond:
                self._failed += 1
                self._problem = exc
            log.error("kube_event_forbidden", error=str(exc))
            return
        except _EventRejected as exc:
            with self._cond:
                self._failed += 1
            log.warning("kube_event_rejected", error=str(exc))
            return
        except KubeError as exc:
            with self._cond:
                self._failed += 1
            if not self._stop.is_set():
                log.warning("kube_event_failed", error=str(exc))
            return
        with self._cond:
            self._sent += 1
            self._problem = None

    def _send(self, event: PodEvent, body: Mapping[str, Any]) -> None:
        try:
            resp = self._core.create_namespaced_event(
                event.pod.namespace,
                body,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            # NB: read the body before the connection goes back to the pool, else the next
            # request on it reads this response's leftover bytes (BadStatusLine).
            _ = resp.data
            resp.release_conn()
        except Exception as exc:
            if getattr(exc, "status", None) == 409:
                return  # AlreadyExists: an earlier attempt of this very Event got through
            err = translate(
                exc, verb="create", resource="events", scope=f"namespace {event.pod.namespace!r}"
            )
            if isinstance(err, KubeForbidden):
                raise err from exc
            if not _is_retryable(exc):
                # The API refused this one event (404 namespace gone, 422 invalid): give up on
                # it instead of retrying forever.
                raise _EventRejected(str(err)) from exc
            if isinstance(err, KubeError):
                raise err from exc
            raise KubeError(str(err)) from exc

    def event_body(self, event: PodEvent) -> dict[str, Any]:
        """The core/v1 Event JSON for ``event`` (kubelet-like name ``<pod>.<hex nanos>.<seq>``)."""
        wall = self._clock.wall()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
        message = event.message
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{event.pod.name[:200]}.{int(wall * 1e9):x}.{next(self._seq):x}",
                "namespace": event.pod.namespace,
            },
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": event.pod.namespace,
                "name": event.pod.name,
                "uid": event.pod.uid,
            },
            "reason": str(event.reason),
            "message": message,
            "type": event.type,
            "source": {"component": EVENT_COMPONENT, "host": self._node},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": self._node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "action": str(event.reason),
        }


class _EventRejected(GpuguardError):
    """The API server refused one event for good (not retried)."""


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, k8s.ApiException):
        status = int(getattr(exc, "status", 0) or 0)
        return status == 0 or status in (401, 408, 429) or status >= 500
    return True
