"""The API client: one ``kubernetes.client.ApiClient`` from a kubeconfig file or in-cluster.

Owns loading the client's configuration (a kubeconfig, or the pod's service account and its
projected token) and turning a configuration that cannot be loaded into one ``ConfigError``.
Must not retry or talk to the API server: urllib3's own retries are turned off here because
``retry.retrying`` is the only retry loop of the project.
"""

from __future__ import annotations

import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpuguard.errors import ConfigError


def load_api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """An ``ApiClient`` from a kubeconfig file, or in-cluster (projected token, re-read on
    rotation by the client's refresh hook). urllib3's own retries are off: ``retrying`` is the
    only retry loop. Raises ``ConfigError`` naming the kubeconfig (or the in-cluster setup) and
    the fix when the client cannot be configured: a missing, unreadable or invalid file, or no
    service account outside a pod."""
    cfg = k8s.Configuration()
    try:
        if kubeconfig:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=cfg
            )
        else:
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=cfg
            )
    except (
        k8s_config.ConfigException,
        yaml.YAMLError,
        OSError,
        ValueError,
        TypeError,
        KeyError,
    ) as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        if kubeconfig:
            raise ConfigError(
                [f"kube.kubeconfig {kubeconfig!r}: not a usable kubeconfig ({detail})"]
            ) from None
        raise ConfigError(
            [
                f"no in-cluster Kubernetes config ({detail}): run in a pod with a service "
                "account, or pass --kubeconfig (kube.kubeconfig)"
            ]
        ) from None
    cfg.retries = False
    return k8s.ApiClient(configuration=cfg)
