"""The sharing agent's start-up check that its admission fence is in force (docs/design.md,
Sharing config: the admission fence): ``KubeFenceProbe`` (``ports.FenceProbe``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kubernetes import client as k8s

from gpuguard.adapters.kube.agent import FIELD_MANAGER, MERGE_PATCH
from gpuguard.adapters.kube.errors import translate_error
from gpuguard.errors import FenceMissing, GpuguardError

FENCE_PROBE_LABEL = "gpuguard.io/fence-check"
"""The label the agent's start-up check asks to set (dry run): one the fence never allows."""


class KubeFenceProbe:
    """``ports.FenceProbe``: a dry-run merge patch (nothing is stored) of ``FENCE_PROBE_LABEL``
    on the agent's own Node, as the agent writes (field manager gpuguard). The admission fence
    refuses it (403 from a ValidatingAdmissionPolicy); if the API server allows it, the fence
    is not in force and a stolen token could write anything RBAC grants: Helm creates the
    DaemonSets before the policy, and a policy takes a moment to become active."""

    def __init__(
        self, api: k8s.ApiClient, *, node_name: str, request_timeout_seconds: float = 10.0
    ) -> None:
        self._core: Any = k8s.CoreV1Api(api)
        self._node = node_name
        self._timeout = request_timeout_seconds

    def check_fence(self) -> None:
        # A fresh value: a patch that changes nothing is one the fence allows.
        body = {"metadata": {"labels": {FENCE_PROBE_LABEL: uuid.uuid4().hex}}}
        try:
            resp = self._core.patch_node(
                self._node,
                body,
                dry_run="All",
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
                _preload_content=False,
                _request_timeout=self._timeout,
            )
            _ = resp.data
            resp.release_conn()
        except Exception as exc:
            if (
                isinstance(exc, k8s.ApiException)
                and exc.status == 403
                and "ValidatingAdmissionPolicy" in _status_message(exc)
            ):
                return  # the fence refused it: in force
            err = translate_error(
                exc, verb="patch (dry run)", resource="nodes", scope="cluster scope"
            )
            if not isinstance(err, GpuguardError):
                err = GpuguardError(f"patch (dry run) nodes (cluster scope): {exc!r}")
            raise err from exc
        raise FenceMissing(
            f"a dry-run patch of the label {FENCE_PROBE_LABEL} on Node {self._node} was allowed: "
            "the admission fence (the chart's ValidatingAdmissionPolicy <release>-agent-node-"
            "fence and its binding) is not in force, so the agent writes nothing yet; install "
            "or upgrade the chart (or apply manifests/agent-admission-policy.yaml) on "
            "Kubernetes >= 1.30"
        )


def _status_message(exc: k8s.ApiException) -> str:
    try:
        message = json.loads(exc.body or b"{}").get("message")
    except (ValueError, TypeError, AttributeError):
        return ""
    return message if isinstance(message, str) else ""
