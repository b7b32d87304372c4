"""What the kernel tests hand ``PidfdKiller``: the pods' UIDs, a ``KillTarget`` over a real
cgroup, and an identity as observed now.

Shared by ``tests/kernel/test_signals.py``, ``rigs/pid_reuse.py``'s driver,
``tests/test_fault_rows.py`` and the scripts they run in a subprocess of their own (an
unprivileged signaller), which import it by name: a script that imported the test module
instead would run it as a library. Must not start processes or create cgroups
(``rigs/cgroups.py`` does).
"""

from __future__ import annotations

from gpuguard.adapters.killer import Observation, boot_ticks
from gpuguard.core.model import (
    ContainerCgroup,
    ContainerId,
    DeviceKey,
    GpuUuid,
    KillTarget,
    PodRef,
    PodUid,
    ProcessIdentity,
)

POD_A = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
POD_B = "9c2e8a11-0d3b-4c55-8e77-1a2b3c4d5e6f"


def target_for(
    cg: ContainerCgroup,
    container_id: str = "c" * 64,
    *,
    namespace: str = "team-a",
    name: str = "trainer",
) -> KillTarget:
    """Pod A's (``namespace/name``) container ``container_id`` in ``cg``, 2 GiB over its 1 GiB
    limit on GPU 0."""
    return KillTarget(
        pod=PodRef(uid=PodUid(POD_A), namespace=namespace, name=name),
        container_id=ContainerId(container_id),
        container_name="main",
        cgroup=cg,
        device=DeviceKey(uuid=GpuUuid("GPU-00000000-0000-0000-0000-000000000000")),
        gpu_index=0,
        used_bytes=2 << 30,
        limit_bytes=1 << 30,
    )


def observed(identity: ProcessIdentity) -> Observation:
    """``identity`` as observed now (stamped after a ready probe's first clock tick)."""
    return Observation(identity=identity, observed_at_ticks=boot_ticks())
