"""Kubernetes Events on pods and on this node's Node: ``KubeEventSink``.

Owns posting core/v1 Events (``ports.EventSink``, ``ports.NodeEventSink``, ``ports.Lifecycle``):
a token bucket per involved object (each pod, and the Node), one bounded buffer, one sender
thread retrying through the one retry loop, and the count of every Event not posted
(``HealthRecorder.count_event_dropped``: ``rate_limit``, ``buffer_full``, ``api_error``).
Errors mean what ``errors`` says: a reported one gives up this Event (a 403 is also the sink's
``problem()``). Must never block ``post()`` or ``post_node()``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.kube.errors import Decision, decision, translate_error
from gpuguard.adapters.kube.retry import retrying
from gpuguard.core.model import PodEvent
from gpuguard.core.reconcile import NodeEvent
from gpuguard.errors import GpuguardError, KubeForbidden
from gpuguard.ports import Clock, HealthRecorder

log = structlog.get_logger(__name__)

EVENT_COMPONENT = "gpuguard"
MAX_MESSAGE_CHARS = 1024
MAX_BUCKETS = 4096
"""Objects with a token bucket before the idle ones (full again) are forgotten."""
NODE_EVENT_NAMESPACE = "default"
"""Where Events on a Node go (a Node has no namespace): the kubelet posts its own there, and
``kubectl describe node`` looks there."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EventSinkStats:
    """Where the posted Events are (counters since start); drops are counted by the
    ``HealthRecorder``."""

    posted: int
    sent: int
    pending: int
    """Buffered plus in flight."""
    in_flight: int
    """Being sent (or retried) right now: 0 or 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Outgoing:
    """One Event in the buffer, its body built when posted: the same name (and timestamps) for
    every attempt."""

    namespace: str
    body: Mapping[str, Any]


class _Bucket:
    __slots__ = ("tokens", "updated_at")

    def __init__(self, tokens: float, updated_at: float) -> None:
        self.tokens = tokens
        self.updated_at = updated_at


class KubeEventSink:
    """core/v1 Events on pods and on the Node ``node_name``, posted by a background thread.

    ``post()`` and ``post_node()`` never block: they rate-limit per involved object (a token
    bucket for each pod and one for the Node, ``per_pod_burst`` Events then one every
    ``per_pod_refill_seconds``), append to one bounded buffer (the oldest event is dropped when
    the API is down long enough to fill it) and wake the sender. The sender retries with the
    shared loop until the API is back.
    """

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        clock: Clock | None = None,
        health: HealthRecorder | None = None,
        buffer_size: int = 256,
        per_pod_burst: int = 5,
        per_pod_refill_seconds: float = 12.0,
        request_timeout_seconds: float = 10.0,
    ) -> None:
        # Any: the typed client declares model return types, but raw responses come back.
        self._core: Any = k8s.CoreV1Api(api)
        self._node = node_name
        self._clock: Clock = clock or SystemClock()
        self._health = health
        self._buffer: deque[_Outgoing] = deque()
        self._buffer_size = buffer_size
        self._burst = float(per_pod_burst)
        self._refill = per_pod_refill_seconds
        self._timeout = request_timeout_seconds
        self._buckets: dict[str, _Bucket] = {}
        """By pod UID, and the Node's by ``node/<name>`` (a UID has no slash)."""
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._problem: GpuguardError | None = None
        self._in_flight = 0
        self._seq = itertools.count(random.getrandbits(20))  # unique names within this process
        self._posted = self._sent = 0

    # -- ports.EventSink -----------------------------------------------------------------------

    def post(self, event: PodEvent) -> None:
        self._enqueue(event.pod.uid, lambda: self._outgoing_pod(event))

    # -- ports.NodeEventSink -------------------------------------------------------------------

    def post_node(self, event: NodeEvent) -> None:
        self._enqueue(f"node/{self._node}", lambda: self._outgoing_node(event))

    # -- ports.Lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KubeEventSink already started")
        self._thread = threading.Thread(target=self._run, name="gpuguard-kube-events", daemon=True)
        self._thread.start()

    def stop(self, *, flush_seconds: float = 2.0) -> None:
        """Give pending events up to ``flush_seconds`` to go out, then stop the sender."""
        self.wait_idle(flush_seconds)
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(1.0, self._timeout))

    def wait_synced(self, timeout_seconds: float) -> bool:
        """Nothing to read first: always ``True``."""
        return True

    def problem(self) -> GpuguardError | None:
        """``KubeForbidden`` while RBAC denies creating Events; cleared by the next success."""
        with self._cond:
            return self._problem

    # -- beyond the ports ----------------------------------------------------------------------

    def stats(self) -> EventSinkStats:
        with self._cond:
            return EventSinkStats(
                posted=self._posted,
                sent=self._sent,
                pending=len(self._buffer) + self._in_flight,
                in_flight=self._in_flight,
            )

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is pending (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                if not self._buffer and not self._in_flight:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def event_body(self, event: PodEvent) -> dict[str, Any]:
        """The core/v1 Event JSON for ``event`` (kubelet-like name ``<pod>.<hex nanos>.<seq>``)."""
        return self._body(
            namespace=event.pod.namespace,
            involved={
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": event.pod.namespace,
                "name": event.pod.name,
                "uid": event.pod.uid,
            },
            reason=str(event.reason),
            message=event.message,
            type_=event.type,
        )

    def node_event_body(self, event: NodeEvent) -> dict[str, Any]:
        """The core/v1 Event JSON for ``event`` on the Node, in ``default`` and with the node's
        name as its UID, as the kubelet posts its own (``kubectl describe node`` finds it so)."""
        return self._body(
            namespace=NODE_EVENT_NAMESPACE,
            involved={"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": self._node},
            reason=str(event.reason),
            message=event.message,
            type_="Warning" if event.warning else "Normal",
        )

    def _body(
        self, *, namespace: str, involved: Mapping[str, str], reason: str, message: str, type_: str
    ) -> dict[str, Any]:
        wall = self._clock.wall()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 1] + "…"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{involved['name'][:200]}.{int(wall * 1e9):x}.{next(self._seq):x}",
                "namespace": namespace,
            },
            "involvedObject": dict(involved),
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": EVENT_COMPONENT, "host": self._node},
            "reportingComponent": EVENT_COMPONENT,
            "reportingInstance": self._node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
            "action": reason,
        }

    # -- the sender ----------------------------------------------------------------------------

    def _dropped(self, reason: str) -> None:
        if self._health is not None:
            self._health.count_event_dropped(reason)

    def _outgoing_pod(self, event: PodEvent) -> _Outgoing:
        return _Outgoing(namespace=event.pod.namespace, body=self.event_body(event))

    def _outgoing_node(self, event: NodeEvent) -> _Outgoing:
        return _Outgoing(namespace=NODE_EVENT_NAMESPACE, body=self.node_event_body(event))

    def _enqueue(self, bucket: str, outgoing: Callable[[], _Outgoing]) -> None:
        """Rate-limit by ``bucket``; only an Event that gets a token is built (a name each)."""
        now = self._clock.monotonic()
        with self._cond:
            self._posted += 1
            if not self._take_token(bucket, now):
                self._dropped("rate_limit")
                return
            if len(self._buffer) >= self._buffer_size:
                self._buffer.popleft()
                self._dropped("buffer_full")
            self._buffer.append(outgoing())
            self._cond.notify()

    def _take_token(self, key: str, now: float) -> bool:  # caller holds the lock
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) > MAX_BUCKETS:
                horizon = self._refill * self._burst
                self._buckets = {
                    k: b for k, b in self._buckets.items() if now - b.updated_at < horizon
                }
            bucket = self._buckets[key] = _Bucket(self._burst, now)
        refill = (now - bucket.updated_at) / self._refill if self._refill > 0 else self._burst
        bucket.tokens = min(self._burst, bucket.tokens + refill)
        bucket.updated_at = now
        if bucket.tokens < 1.0:
            return False
        bucket.tokens -= 1.0
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._buffer and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                outgoing = self._buffer.popleft()
                self._in_flight = 1
            try:
                self._send_with_retry(outgoing)
            finally:
                with self._cond:
                    self._in_flight = 0

    def _send_with_retry(self, outgoing: _Outgoing) -> None:
        # One body, one name, for every attempt: when a response is lost after the API server
        # stored the Event (a dropped connection), the retry gets 409 instead of a duplicate.
        try:
            retrying(self._stop, what="event", persist=False)(
                self._send, outgoing.namespace, outgoing.body
            )
        except GpuguardError as exc:
            self._given_up(exc)
            return
        except Exception:  # a bug must not kill the sender: this Event is lost, not the next
            log.exception("kube_event_crashed")
            self._dropped("api_error")
            return
        with self._cond:
            self._sent += 1
            self._problem = None

    def _given_up(self, exc: GpuguardError) -> None:
        """The Event is dropped: refused for good (a reported error), or still failing at stop."""
        self._dropped("api_error")
        if isinstance(exc, KubeForbidden):
            with self._cond:
                self._problem = exc
            log.error("kube_event_forbidden", error=str(exc))
        elif decision(exc) is Decision.REPORT:
            log.warning("kube_event_rejected", error=str(exc))
        elif not self._stop.is_set():
            log.warning("kube_event_failed", error=str(exc))

    def _send(self, namespace: str, body: Mapping[str, Any]) -> None:
        try:
            resp = self._core.create_namespaced_event(
                namespace,
                body,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            # NB: read the body before the connection goes back to the pool, else the next
            # request on it reads this response's leftover bytes (BadStatusLine).
            _ = resp.data
            resp.release_conn()
        except Exception as exc:
            err = translate_error(
                exc, verb="create", resource="events", scope=f"namespace {namespace!r}"
            )
            if decision(err) is Decision.DONE:
                return  # AlreadyExists: an earlier attempt of this very Event got through
            if err is exc:
                raise
            raise err from exc
