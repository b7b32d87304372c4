"""``gpuguard enforce`` keeps its Node's ``GPUMemoryEnforced`` condition (docs/design.md, Node
condition): the real process, as its ServiceAccount (manifests/rbac.yaml's patch of
nodes/status really enforced), against the real kube-apiserver. It says ``Enforcing`` once it
enforces; a second enforcer on the node stands by without overwriting that; SIGTERM writes
"enforcer stopped", and the standby then takes the lock and says ``Enforcing`` again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from rigs.controlplane import wait_until
from rigs.node import Rig

pytestmark = [pytest.mark.apiserver, pytest.mark.kernel, pytest.mark.nvml_stub]


def _condition(rig: Rig) -> dict[str, Any] | None:
    node = rig.cluster.admin_request("GET", f"/api/v1/nodes/{rig.node}")
    for c in node.get("status", {}).get("conditions", []):
        if c["type"] == "GPUMemoryEnforced":
            return dict(c)
    return None


def _says(rig: Rig, status: str, reason: str, message: str | None = None) -> bool:
    c = _condition(rig)
    return (
        c is not None
        and (c["status"], c["reason"]) == (status, reason)
        and (message is None or c["message"] == message)
    )


def test_the_enforcer_says_it_enforces_its_standby_keeps_quiet_and_a_stop_says_so(
    rig: Rig,
) -> None:
    first = rig.start_enforcer()
    wait_until(lambda: _says(rig, "True", "Enforcing"), timeout=30, what="Enforcing")
    enforcing = _condition(rig)
    second = rig.start_enforcer()
    second.wait_for("enforcement_standby", timeout=30)
    wait_until(lambda: second.ready()[0] is False, timeout=10, what="the standby's readiness")
    time.sleep(1.1)  # its cycles hand LockHeldElsewhere to its writer; timestamps are seconds
    assert _condition(rig) == enforcing, "a standby never overwrites the holder's True"

    assert first.stop() == 0
    # The first's last word (False), then the second takes the lock (tried every poll) and
    # enforces: True again, with a later transition than the first's True.
    wait_until(lambda: _says(rig, "True", "Enforcing"), timeout=30, what="the standby's takeover")
    assert enforcing is not None
    assert _condition(rig)["lastTransitionTime"] > enforcing["lastTransitionTime"]  # type: ignore[index]
    assert second.stop() == 0
    assert _says(rig, "False", "NotReady", "enforcer stopped")
