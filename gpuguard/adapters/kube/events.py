"""Kubernetes Events on pods: ``KubeEventSink``.

Owns posting core/v1 Events (``ports.EventSink``, ``ports.Lifecycle``): a per-pod token bucket,
a bounded buffer, one sender thread retrying through the one retry loop, and the count of every
Event not posted (``HealthRecorder.count_event_dropped``: ``rate_limit``, ``buffer_full``,
``api_error``). Errors mean what ``errors`` says: a reported one gives up this Event (a 403 is
also the sink's ``problem()``). Must never block ``post()``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.kube.errors import Decision, decision, translate_error
from gpuguard.adapters.kube.retry import SystemClock, retrying
from gpuguard.core.model import PodEvent, PodUid
from gpuguard.errors import GpuguardError, KubeForbidden
from gpuguard.ports import Clock, HealthRecorder

log = structlog.get_logger(__name__)

EVENT_COMPONENT = "gpuguard"
MAX_MESSAGE_CHARS = 1024
MAX_BUCKETS = 4096
"""Pods with a token bucket before the idle ones (full again) are forgotten."""


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


class _Bucket:
    __slots__ = ("tokens", "updated_at")

    def __init__(self, tokens: float, updated_at: float) -> None:
        self.tokens = tokens
        self.updated_at = updated_at


class KubeEventSink:
    """core/v1 Events on pods, posted by a background thread.

    ``post()`` never blocks: it rate-limits per pod (token bucket), appends to a bounded buffer
    (the oldest event is dropped when the API is down long enough to fill it) and wakes the
    sender. The sender retries with the shared loop until the API is back.
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
        self._posted = self._sent = 0

    # -- ports.EventSink -----------------------------------------------------------------------

    def post(self, event: PodEvent) -> None:
        now = self._clock.monotonic()
        with self._cond:
            self._posted += 1
            if not self._take_token(event.pod.uid, now):
                self._dropped("rate_limit")
                return
            if len(self._buffer) >= self._buffer_size:
                self._buffer.popleft()
                self._dropped("buffer_full")
            self._buffer.append(event)
            self._cond.notify()

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

    # -- the sender ----------------------------------------------------------------------------

    def _dropped(self, reason: str) -> None:
        if self._health is not None:
            self._health.count_event_dropped(reason)

    def _take_token(self, uid: PodUid, now: float) -> bool:  # caller holds the lock
        bucket = self._buckets.get(uid)
        if bucket is None:
            if len(self._buckets) > MAX_BUCKETS:
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
            retrying(self._stop, what="event", persist=False)(self._send, event, body)
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
            err = translate_error(
                exc, verb="create", resource="events", scope=f"namespace {event.pod.namespace!r}"
            )
            if decision(err) is Decision.DONE:
                return  # AlreadyExists: an earlier attempt of this very Event got through
            if err is exc:
                raise
            raise err from exc
