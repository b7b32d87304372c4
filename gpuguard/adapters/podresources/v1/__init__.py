"""Generated stubs of the kubelet's pod-resources API v1 (``v1.PodResourcesLister``).

``api.proto`` is a copy of ``pkg/apis/podresources/v1/api.proto`` of the Go module
``k8s.io/kubelet`` v0.37.2 (Kubernetes 1.37); ``api_pb2*.py`` and ``api_pb2*.pyi`` are generated
from it by ``python3 -m scripts.gen_podresources`` (grpcio-tools' protoc and mypy-protobuf, the
dependency group ``codegen``); ``--check`` tells whether they match a fresh generation, and
``--proto-from <k8s.io/kubelet module dir>`` takes a newer ``api.proto``. Never edit them by hand.
Only ``gpuguard.adapters.podresources`` imports them.
"""
