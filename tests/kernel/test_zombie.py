"""A zombie parent whose forked child holds the GPU is still the pod's (H200 finding).

NVML keeps listing a parent that exited while a forked child holds its CUDA context; until the
parent is reaped its ``/proc/<pid>/fd`` is empty. ``holds_gpu`` must then be unknown, not
False, or ``decide()`` would refuse the PID as reused and the memory would never be reclaimed.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpuguard.adapters.procfs import ProcfsProcessResolver, read_state
from gpuguard.core.model import EnforcementPolicy, NodeFacts
from gpuguard.core.policy import EnforcerState, decide
from rigs.prereq import require
from tests.fakes import GiB, gpu, pod, proc, sample, snapshot

pytestmark = pytest.mark.kernel

PARENT = r"""
import os, sys, time
fd = os.open(sys.argv[1], os.O_PATH)          # like a CUDA context: chr 195:0 in /proc/<pid>/fd
child = os.fork()
if child == 0:
    time.sleep(60)                            # inherits the fd and keeps it
    os._exit(0)
print(child, flush=True)
os._exit(0)                                   # the parent exits; nobody reaps it yet
"""


@pytest.fixture
def nvidia_node(tmp_path: Path) -> Path:
    require(os.geteuid() == 0, "needs root to mknod a char 195:0 device node")
    node = tmp_path / "nvidia0"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 0))
    return node


def test_a_zombie_parent_keeps_unknown_not_false_gpu_holding(nvidia_node: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(nvidia_node)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 10
        while read_state(Path("/proc"), parent.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_state(Path("/proc"), parent.pid) == "Z"
        resolver = ProcfsProcessResolver(Path("/proc"), check_gpu_fds=True)
        zombie = resolver.attribute(parent.pid)
        assert zombie.identity is not None
        assert zombie.holds_gpu is None  # not False: its memory may be its child's now
        assert resolver.attribute(child).holds_gpu is True

        # And decide() keeps charging it to its pod, so the container can still be stopped.
        g = gpu(0)
        p1 = pod(1, limit=4 * GiB)
        a = replace(zombie, pod_uid=p1.uid, container_id=next(iter(p1.containers)))
        now = time.monotonic()  # the resolver's clock: the zombie started before this listing
        d = decide(
            sample=sample(1, now, [g], [proc(parent.pid, g, 12 * GiB)]),
            attributions={parent.pid: a},
            pods=snapshot([p1], contact=now),
            node=NodeFacts(name="n"),
            policy=EnforcementPolicy(),
            state=EnforcerState(),
            now=now,
        )
        assert d.unattributed_bytes[g.key] == 0
        assert d.usages[0].used_bytes == 12 * GiB
    finally:
        os.kill(child, 9)  # noqa: TID251 — a process this test started, by PID
        parent.wait(timeout=10)
        parent.stdout.close()
