"""A stand-in kubelet for the pod-resources reader's tests, ``benchmarks/podresources_kubelet.py``
and ``scripts/gpu_e2e.py``: a real gRPC server serving the generated ``v1.PodResourcesLister``
servicer on a unix socket, and builders of its answers.

``KubeletServer`` answers ``List`` with whatever ``answer`` holds now; ``hang`` makes ``List``
wait (until the server stops) as a stuck kubelet would; ``serve_lister=False`` serves no v1
service at all, as a kubelet that knows only v1alpha1 does. ``socket_path()``: where to serve.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc

from gpuguard.adapters.podresources.v1 import api_pb2, api_pb2_grpc


def container(
    name: str,
    devices: Sequence[tuple[str, Sequence[str]]] = (),
    dynamic: Sequence[tuple[str, str, Sequence[tuple[str, str, str]]]] = (),
) -> api_pb2.ContainerResources:
    """A container: ``devices`` as (resource, IDs), ``dynamic`` as (claim namespace, claim
    name, [(driver, pool, device)])."""
    return api_pb2.ContainerResources(
        name=name,
        devices=[
            api_pb2.ContainerDevices(resource_name=r, device_ids=list(ids)) for r, ids in devices
        ],
        dynamic_resources=[
            api_pb2.DynamicResource(
                claim_namespace=ns,
                claim_name=claim,
                claim_resources=[
                    api_pb2.ClaimResource(driver_name=d, pool_name=p, device_name=dev)
                    for d, p, dev in resources
                ],
            )
            for ns, claim, resources in dynamic
        ],
    )


def pod(
    namespace: str, name: str, containers: Sequence[api_pb2.ContainerResources] = ()
) -> api_pb2.PodResources:
    return api_pb2.PodResources(namespace=namespace, name=name, containers=list(containers))


def answer(*pods: api_pb2.PodResources) -> api_pb2.ListPodResourcesResponse:
    return api_pb2.ListPodResourcesResponse(pod_resources=list(pods))


class _Lister(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, server: KubeletServer) -> None:
        self._server = server

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        self._server.calls += 1
        if self._server.hang:
            self._server.stopping.wait(30)
        return self._server.answer

    def Get(
        self, request: api_pb2.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.GetPodResourcesResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the reader calls only List")

    def GetAllocatableResources(
        self, request: api_pb2.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.AllocatableResourcesResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the reader calls only List")


class KubeletServer:
    """A gRPC server on ``socket`` (started by ``start()``, stopped by ``stop()``)."""

    def __init__(self, socket: Path, *, serve_lister: bool = True) -> None:
        self.socket = socket
        self.answer = api_pb2.ListPodResourcesResponse()
        self.hang = False
        self.calls = 0
        self.stopping = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if serve_lister:
            api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Lister(self), self._server)
        port = self._server.add_insecure_port(f"unix://{socket}")
        assert port != 0 or socket.exists(), f"cannot bind {socket}"

    def start(self) -> KubeletServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._server.stop(grace=None).wait(10)


@contextmanager
def socket_path() -> Iterator[Path]:
    """A socket path in a fresh directory under /tmp, short enough for ``sun_path`` (108
    bytes), unlike pytest's ``tmp_path``; the directory is removed on the way out."""
    directory = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))
    try:
        yield directory / "kubelet.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def kubelet(socket: Path, **kwargs: bool) -> Iterator[KubeletServer]:
    """A started ``KubeletServer``, stopped on the way out."""
    server = KubeletServer(socket, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()
