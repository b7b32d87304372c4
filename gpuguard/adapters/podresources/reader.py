"""``PodResourcesReader``: one bounded ``List`` on the kubelet's pod-resources socket per read.

Owns the channel (made again when the socket file is another one, after a kubelet restart, and
after any failed call, so no channel waits out a reconnect backoff) and the translation of
``ListPodResourcesResponse`` into ``NodeAllocations`` within ``core.allocation``'s bounds. Says
once when reads turn unknown (a warning with the reason) and once when they recover (info).
Must not raise from ``read()`` and must not decide what an allocation explains.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import structlog

from gpuguard.adapters.podresources.v1 import api_pb2, api_pb2_grpc
from gpuguard.core.allocation import (
    MAX_CONTAINERS,
    MAX_DEVICES,
    MAX_NAME,
    MAX_PODS,
    ContainerDevices,
    DynamicDevice,
    NodeAllocations,
    PodAllocation,
)
from gpuguard.ports import AllocationSource, Clock

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""The largest ``List`` answer read (gRPC's default is 4 MiB). A pod with a few containers and
devices takes well under 1 KiB, so 16 MiB holds ``MAX_PODS`` busy pods; a larger answer is
``unknown``, never partly read."""
DEFAULT_TIMEOUT_SECONDS = 2.0
"""The deadline of one ``List`` (connecting included): the kubelet answers from memory in
milliseconds; one that hangs makes the read ``unknown`` after this, never longer."""
_DETAILS = 200
"""Characters of gRPC's own error text kept in a reason."""

_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", 1024 * 1024),
    # A channel of its own subchannels: a channel made again after a failure must not inherit
    # the global pool's subchannel and its reconnect backoff (then it would fail at once again).
    ("grpc.use_local_subchannel_pool", 1),
    # Short reconnect backoff for the channel while it lives (kept anyway only until a failure).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
    ("grpc.enable_http_proxy", 0),
)

_FIX = (
    "mount the host's kubelet pod-resources directory into the enforcer (the chart's value "
    "kubelet.podResourcesDir), or set node.pod_resources_socket to the kubelet's socket "
    '("" turns the reads off)'
)


class PodResourcesReader:
    """``ports.AllocationSource`` on the kubelet's pod-resources socket.

    ``read()`` blocks at most ``timeout`` seconds (plus a ``stat``); one caller at a time (a lock
    serializes callers). ``read_at`` of an answer is ``clock.monotonic()`` when its ``List`` was
    sent."""

    def __init__(
        self, socket: Path, *, clock: Clock, timeout: float = DEFAULT_TIMEOUT_SECONDS
    ) -> None:
        self._socket = socket
        self._clock = clock
        self._timeout = timeout
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._identity: tuple[int, int, int] | None = None
        self._closed = False
        self._unknown_said = False
        """A warning was logged for the unknown reads in progress (reset when one answers)."""

    def read(self) -> NodeAllocations:
        with self._lock:
            answer = self._read()
            self._say(answer)
            return answer

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()

    # -- one read --------------------------------------------------------------------------

    def _read(self) -> NodeAllocations:
        if self._closed:
            return NodeAllocations(unknown="the pod-resources reader is closed")
        stub = self._connect()
        if isinstance(stub, str):
            return NodeAllocations(unknown=stub)
        read_at = self._clock.monotonic()
        try:
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as exc:
            self._drop()
            return NodeAllocations(unknown=self._rpc_reason(exc))
        except Exception as exc:  # noqa: BLE001 — read() never raises: the read turns unknown
            self._drop()
            why = f"List on the kubelet's pod-resources socket {self._socket} failed: {exc!r}"
            return NodeAllocations(unknown=why[: 2 * _DETAILS])
        return translate(response, read_at=read_at)

    def _connect(self) -> api_pb2_grpc.PodResourcesListerStub | str:
        """The stub on a channel to the socket file there now, or why there is none."""
        try:
            st = os.stat(self._socket)
        except FileNotFoundError:
            self._drop()
            return f"the kubelet's pod-resources socket {self._socket} does not exist: {_FIX}"
        except OSError as exc:
            self._drop()
            return (
                f"the kubelet's pod-resources socket {self._socket} cannot be read "
                f"({exc.strerror}): {_FIX}"
            )
        if not stat.S_ISSOCK(st.st_mode):
            self._drop()
            return f"{self._socket} is not a unix socket: {_FIX}"
        # The inode alone does not tell: ext4 gives a socket made again at once the inode of
        # the one just removed; its change time differs.
        identity = (st.st_dev, st.st_ino, st.st_ctime_ns)
        if self._stub is None or identity != self._identity:
            # A new socket file (the kubelet restarted): a new channel, not the old one's
            # connection attempts to a file that is gone.
            self._drop()
            # ``unix:<path>``: an absolute path, or one relative to the working directory.
            self._channel = grpc.insecure_channel(f"unix:{self._socket}", options=_CHANNEL_OPTIONS)
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            self._identity = identity
        assert self._stub is not None
        return self._stub

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None
        self._identity = None

    def _rpc_reason(self, exc: grpc.RpcError) -> str:
        code, details = _status(exc)
        where = f"the kubelet's pod-resources socket {self._socket}"
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"the kubelet did not answer List on {where} within {self._timeout:g} s"
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return (
                f"the kubelet on {where} does not serve v1 List (UNIMPLEMENTED: an old "
                "kubelet, before Kubernetes 1.20, serves only v1alpha1): upgrade the kubelet, "
                'or set node.pod_resources_socket = "" to turn the reads off'
            )
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return (
                f"the kubelet's List answer on {where} is larger than "
                f"{MAX_MESSAGE_BYTES // (1024 * 1024)} MiB ({details})"
            )
        if code is grpc.StatusCode.UNAVAILABLE:
            return (
                f"the kubelet does not answer on {where} (UNAVAILABLE: {details}): is the "
                "kubelet running? A restarting kubelet answers again within seconds"
            )
        name = code.name if code is not None else "unknown status"
        return f"List on {where} failed ({name}: {details})"

    def _say(self, answer: NodeAllocations) -> None:
        """A warning when reads turn unknown, an info line when they answer again; once each."""
        if answer.unknown is not None:
            if not self._unknown_said:
                log.warning(
                    "pod_resources_unknown", socket=str(self._socket), reason=answer.unknown
                )
                self._unknown_said = True
        elif self._unknown_said:
            log.info("pod_resources_recovered", socket=str(self._socket), pods=len(answer.pods))
            self._unknown_said = False


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """A failed call's status code and details (its error is also a ``grpc.Call``, which the
    type stubs cannot say)."""
    code = getattr(exc, "code", None)
    details = getattr(exc, "details", None)
    status = code() if callable(code) else None
    text = details() if callable(details) else None
    return (
        status if isinstance(status, grpc.StatusCode) else None,
        text[:_DETAILS] if isinstance(text, str) else "",
    )


# -- translation ---------------------------------------------------------------------------


def translate(response: api_pb2.ListPodResourcesResponse, *, read_at: float) -> NodeAllocations:
    """``response`` within ``core.allocation``'s bounds: past ``MAX_PODS`` pods the whole answer
    is unknown; a pod past another bound, or listed twice under one name, is unknown alone.

    Each pod is translated when it is first looked up (``_Pods``): the enforcer asks only about
    pods with GPU memory, so a read costs the gRPC call and a pass over the pods' names, not a
    translation of every container of the node."""
    if len(response.pod_resources) > MAX_PODS:
        return NodeAllocations(
            read_at=read_at,
            unknown=(f"the kubelet lists {len(response.pod_resources)} pods, more than {MAX_PODS}"),
        )
    return NodeAllocations(pods=_Pods(response.pod_resources), read_at=read_at, unknown=None)


class _Pods(Mapping[tuple[str, str], PodAllocation]):
    """The kubelet's pods by (namespace, name), each translated (``_pod``) on first lookup and
    kept. Made by the reader's thread, then only read (and filled) by whoever decides on it."""

    def __init__(self, listed: Sequence[api_pb2.PodResources]) -> None:
        self._listed: dict[tuple[str, str], api_pb2.PodResources | None] = {}
        for resources in listed:
            key = (resources.namespace, resources.name)
            # The API names no UID: an old pod still terminating and its successor of the same
            # name cannot be told apart (None: listed twice).
            self._listed[key] = None if key in self._listed else resources
        self._translated: dict[tuple[str, str], PodAllocation] = {}

    def __getitem__(self, key: tuple[str, str]) -> PodAllocation:
        found = self._translated.get(key)
        if found is not None:
            return found
        resources = self._listed[key]
        if resources is None:
            found = PodAllocation(
                namespace=key[0], name=key[1], unknown="the kubelet lists two pods of this name"
            )
        else:
            found = _pod(resources)
        self._translated[key] = found
        return found

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._listed)

    def __len__(self) -> int:
        return len(self._listed)


def _pod(resources: api_pb2.PodResources) -> PodAllocation:
    """One pod's answer, or why it is past a bound (then it is unknown).

    One pass over the message: each field of the generated message is read once (a read makes
    a Python object of it), the bounds checked on the way; what was built for a pod past a
    bound is dropped. The bounds are checked in this order: the containers, each container's
    devices (the first over names it), the longest name (the first of that length)."""
    namespace, name = resources.namespace, resources.name
    containers = resources.containers
    if len(containers) > MAX_CONTAINERS:
        why = f"the kubelet lists {len(containers)} containers, more than {MAX_CONTAINERS}"
        return PodAllocation(namespace=namespace, name=name, unknown=why)
    longest = namespace if len(namespace) >= len(name) else name
    names: list[str] = []
    devices: list[ContainerDevices] = []
    dynamic: list[DynamicDevice] = []
    over: str | None = None
    for container in containers:
        cname = container.name
        names.append(cname)
        longest = _longer(longest, cname)
        count = 0
        for d in container.devices:
            resource, ids = d.resource_name, tuple(d.device_ids)
            count += len(ids)
            longest = _longer(_longer(longest, resource), max(ids, key=len, default=""))
            devices.append(ContainerDevices(container=cname, resource=resource, device_ids=ids))
        for claim in container.dynamic_resources:
            claim_namespace, claim_name = claim.claim_namespace, claim.claim_name
            longest = _longer(_longer(longest, claim_namespace), claim_name)
            for r in claim.claim_resources:
                count += 1
                driver, pool, device = r.driver_name, r.pool_name, r.device_name
                longest = _longer(_longer(_longer(longest, driver), pool), device)
                dynamic.append(
                    DynamicDevice(
                        container=cname,
                        claim_namespace=claim_namespace,
                        claim_name=claim_name,
                        driver=driver,
                        pool=pool,
                        device=device,
                    )
                )
        if count > MAX_DEVICES and over is None:
            over = (
                f"the kubelet lists {count} devices for container "
                f"{cname[:MAX_NAME]!r}, more than {MAX_DEVICES}"
            )
    if over is None and len(longest) > MAX_NAME:
        over = (
            f"the kubelet's answer holds a name of {len(longest)} characters "
            f"({longest[:40]!r}…), longer than {MAX_NAME}"
        )
    if over is not None:
        return PodAllocation(namespace=namespace, name=name, unknown=over)
    return PodAllocation(
        namespace=namespace,
        name=name,
        containers=tuple(names),
        devices=tuple(devices),
        dynamic=tuple(dynamic),
    )


def _longer(longest: str, other: str) -> str:
    """``other`` when it is longer than ``longest`` (the first of a length is kept)."""
    return other if len(other) > len(longest) else longest


def build_allocation_source(socket: Path | None, *, clock: Clock) -> AllocationSource | None:
    """The reader of ``node.pod_resources_socket``; ``None`` when that is off (``None``)."""
    return None if socket is None else PodResourcesReader(socket, clock=clock)
