"""The enforcer's ``GPUMemoryEnforced`` condition on its own Node: ``KubeNodeConditionWriter``.

Owns writing the condition (``ports.NodeConditionWriter``, docs/design.md, Node condition): a
background thread reads the Node and sends one strategic merge patch of ``nodes/<node>/status``
(the conditions list merges by ``type``: the kubelet's conditions are left as they are), under
the Node's ``resourceVersion`` (a 409 reads again), with field manager ``gpuguard-enforcer``
(not the agent's ``gpuguard``: the agent's fence bounds that manager's entries to the Node
itself). It writes when the condition changes and again every ``heartbeat_seconds``; retries go
through the one retry loop; a failing episode is logged once and each failure counted
(``KubeWriteRecorder.count_kube_write_error``). A standby enforcer never overwrites the lock
holder's condition: a ``True`` one, or one refreshed within two heartbeats. Must never block
``set()``.
"""

from __future__ import annotations

import calendar
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import structlog
from kubernetes import client as k8s

from gpuguard.adapters.clock import SystemClock
from gpuguard.adapters.kube.errors import translate_error
from gpuguard.adapters.kube.retry import REPORTED_RETRY_SECONDS, retrying
from gpuguard.core.node_condition import CONDITION_TYPE, NodeCondition, stopped_condition
from gpuguard.errors import GpuguardError, WriteConflict
from gpuguard.ports import Clock, KubeWriteRecorder

log = structlog.get_logger(__name__)

FIELD_MANAGER = "gpuguard-enforcer"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
HEARTBEAT_SECONDS = 300.0
"""How often an unchanged condition is written again (its ``lastHeartbeatTime``): each write is
a GET and a PATCH of the Node, and every Node watcher in the cluster (the scheduler, every
controller) receives the new Node, so at thousands of nodes a write per node every few seconds
would cost the control plane more than the condition is worth; a change is written at once
anyway. Five minutes bounds how old the heartbeat of a live enforcer gets: an enforcer that died
without a word leaves an older one behind."""

_RESOURCE = "nodes/status"


class KubeNodeConditionWriter:
    """``ports.NodeConditionWriter`` for the Node ``node_name``; ``start()`` starts the writer
    thread."""

    def __init__(
        self,
        api: k8s.ApiClient,
        *,
        node_name: str,
        clock: Clock | None = None,
        health: KubeWriteRecorder | None = None,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        request_timeout_seconds: float = 10.0,
        stop_seconds: float = 2.0,
    ) -> None:
        # Any: the typed client declares model return types, but raw responses come back.
        self._core: Any = k8s.CoreV1Api(api)
        self._node = node_name
        self._clock: Clock = clock or SystemClock()
        self._health = health
        self._heartbeat = heartbeat_seconds
        self._timeout = request_timeout_seconds
        self._stop_seconds = stop_seconds
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wanted: tuple[NodeCondition, bool] | None = None
        """The condition the Node should carry, with whether this enforcer stands by."""
        self._sent: tuple[NodeCondition, bool] | None = None
        self._sent_at = 0.0
        self._failing = False

    # -- ports.NodeConditionWriter -------------------------------------------------------------

    def set(self, condition: NodeCondition, *, standby: bool = False) -> None:
        wanted = (condition, standby)
        with self._cond:
            if wanted == self._wanted:
                return
            self._wanted = wanted
            self._cond.notify_all()

    def stop(self) -> None:
        """Write ``False``/``NotReady`` "enforcer stopped" within ``stop_seconds`` (best effort:
        an API server that does not answer in time leaves the last condition, whose heartbeat
        then ages), then stop the writer."""
        deadline = time.monotonic() + self._stop_seconds
        if self._thread is not None and not self._stop.is_set():
            with self._cond:
                standby = self._wanted[1] if self._wanted is not None else False
                self._wanted = (stopped_condition(), standby)
                self._cond.notify_all()
                while self._sent != self._wanted and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(max(0.1, deadline - time.monotonic()))

    # -- beyond the port -----------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("KubeNodeConditionWriter already started")
        self._thread = threading.Thread(
            target=self._run, name="gpuguard-node-condition", daemon=True
        )
        self._thread.start()

    def wait_synced(self, timeout_seconds: float) -> bool:
        """Nothing to read first: always ``True`` (``ports.Lifecycle``)."""
        return True

    def problem(self) -> GpuguardError | None:
        """``None``: a condition not written makes nothing else fail (it is logged and
        counted)."""
        return None

    def wait_written(self, timeout: float) -> bool:
        """Block until what ``set()`` was last given is written (for tests)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._sent != self._wanted or self._wanted is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- the writer thread ---------------------------------------------------------------------

    def _due(self) -> bool:  # caller holds the lock
        if self._wanted is None:
            return False
        return (
            self._wanted != self._sent or self._clock.monotonic() - self._sent_at >= self._heartbeat
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and not self._due():
                    wait = None
                    if self._wanted is not None:
                        wait = self._sent_at + self._heartbeat - self._clock.monotonic()
                    self._cond.wait(None if wait is None else max(0.05, wait))
                if self._stop.is_set():
                    return
            try:
                retrying(self._stop, what="node condition", persist=True, on_retry=self._failed)(
                    self._write_wanted
                )
            except GpuguardError as exc:  # stopping, or an error the table does not retry
                log.warning("node_condition_not_written", node=self._node, error=str(exc))
                self._stop.wait(REPORTED_RETRY_SECONDS)
            except Exception:  # a bug must not end the writer: try again at the next change
                log.exception("node_condition_crashed")
                with self._cond:
                    self._sent, self._sent_at = self._wanted, self._clock.monotonic()

    def _failed(self, exc: BaseException) -> None:
        if self._health is not None:
            self._health.count_kube_write_error(_RESOURCE)
        if not self._failing:
            self._failing = True
            log.warning("node_condition_write_failed", node=self._node, error=str(exc))

    def _write_wanted(self) -> None:
        """One attempt: read the Node, write the condition wanted now (unless standing by
        before the holder's ``True``)."""
        with self._cond:
            wanted = self._wanted
        if wanted is None:
            return
        condition, standby = wanted
        node = self._call("get", lambda: self._core.read_node(self._node, **self._opts()))
        current = _condition_of(node)
        if not (standby and current is not None and self._holders(current)):
            body = self._patch_body(condition, current, node)
            self._call(
                "patch",
                lambda: self._core.patch_node_status(
                    self._node,
                    body,
                    field_manager=FIELD_MANAGER,
                    _content_type=STRATEGIC_MERGE_PATCH,
                    **self._opts(),
                ),
            )
        with self._cond:
            self._sent, self._sent_at = wanted, self._clock.monotonic()
            self._cond.notify_all()
        if self._failing:
            self._failing = False
            log.info("node_condition_write_recovered", node=self._node)

    def _holders(self, current: Mapping[str, Any]) -> bool:
        """Whether ``current`` is the lock holder's, which a standby leaves alone: ``True`` (only
        a holder enforces), or refreshed within two heartbeats (a live enforcer writes it: in
        audit mode, or not ready). Without the second half two enforcers would overwrite each
        other at each heartbeat."""
        if current.get("status") == "True":
            return True
        try:
            beat = calendar.timegm(
                time.strptime(str(current.get("lastHeartbeatTime")), "%Y-%m-%dT%H:%M:%SZ")
            )
        except ValueError:
            return False
        return self._clock.wall() - beat < 2 * self._heartbeat

    def _patch_body(
        self,
        condition: NodeCondition,
        current: Mapping[str, Any] | None,
        node: Mapping[str, Any],
    ) -> dict[str, Any]:
        status = "True" if condition.status else "False"
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._clock.wall()))
        transition = now
        if current is not None and current.get("status") == status:
            transition = str(current.get("lastTransitionTime") or now)
        version = (node.get("metadata") or {}).get("resourceVersion")
        return {
            "metadata": {"resourceVersion": version},
            "status": {
                "conditions": [
                    {
                        "type": CONDITION_TYPE,
                        "status": status,
                        "reason": str(condition.reason),
                        "message": condition.message,
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": transition,
                    }
                ]
            },
        }

    def _opts(self) -> dict[str, Any]:
        return {"_preload_content": False, "_request_timeout": self._timeout}

    def _call(self, verb: str, send: Any) -> dict[str, Any]:
        try:
            resp = send()
            answer: dict[str, Any] = json.loads(resp.data)
            resp.release_conn()
        except Exception as exc:
            if isinstance(exc, k8s.ApiException) and exc.status == 409:
                raise WriteConflict(f"{verb} {_RESOURCE} {self._node}: the Node changed") from exc
            err = translate_error(exc, verb=verb, resource=_RESOURCE, scope="cluster scope")
            if err is exc:
                raise
            raise err from exc
        return answer


def _condition_of(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    conditions = (node.get("status") or {}).get("conditions") or []
    for c in conditions:
        if isinstance(c, Mapping) and c.get("type") == CONDITION_TYPE:
            return c
    return None
