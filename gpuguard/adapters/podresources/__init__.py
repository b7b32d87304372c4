"""The kubelet's pod-resources API (``v1.PodResourcesLister/List`` on a unix socket) as
``core.allocation.NodeAllocations``: what the device plugin and DRA allocated each container.

Owns the gRPC channel to the kubelet's socket, its bounds (a deadline per call, a largest answer,
the counts and name lengths of ``core.allocation``) and the translation of the answer; every
failure becomes an answer whose ``unknown`` says why and how to fix it, never an exception and
never "nothing allocated". Must not decide anything: which resources are GPUs and what an
allocation explains is ``core.allocation``'s. The only importer of ``grpc`` and of the generated
stubs (``v1``) in gpuguard (docs/design.md, Pod resources).
"""

from gpuguard.adapters.podresources.reader import (
    MAX_MESSAGE_BYTES,
    PodResourcesReader,
    build_allocation_source,
)

__all__ = ["MAX_MESSAGE_BYTES", "PodResourcesReader", "build_allocation_source"]
