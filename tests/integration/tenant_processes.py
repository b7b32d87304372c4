"""A tenant's process in a pod of the integration rig, listed by the NVML stand-in: for the tests
of tenants that make reading their ``/proc`` files slow or endless (scripts in
``tests/kernel/stuck.py``).

Owns ``spawn_tenant``. Must not: signal or kill a process (the rig's cgroup tree does, at its
end; the test closes the pipes).
"""

from __future__ import annotations

import subprocess
import sys

from rigs.node import GIB, PodInfo, Rig, Worker


def spawn_tenant(
    rig: Rig, tenants: list[Worker], pod: PodInfo, name: str, script: str, *args: object
) -> Worker:
    """A tenant's process running ``script`` in ``pod``'s container cgroup, listed by NVML
    with 1 GiB, once it said ``ready``; added to ``tenants`` (whose pipes the test closes)."""
    cgroup = rig.tree.container(
        version=2,
        driver="systemd",
        qos="burstable",
        pod_uid=pod.uid,
        runtime="containerd",
        container_id=pod.container_id,
    )
    proc = rig.tree.spawn(
        [sys.executable, "-c", script, *map(str, args)],
        cgroups=[cgroup],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    worker = Worker(name=name, proc=proc, record=rig.dir / f"{name}.signals", used_bytes=GIB)
    tenants.append(worker)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready", f"tenant {name} did not start"
    rig.workers.append(worker)
    rig.write_scenario()
    return worker
