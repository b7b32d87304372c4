"""scripts/gpu_e2e.py's workers live in a session of their own: an interrupt or a ``timeout``
sent to the script's process group must not reach them (a signal to a neighbour or host process
there is counted as a wrong kill; benchmarks/reaction.py showed it on 2026-12-06)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.apiserver import wait_until
from tests.kernel.cgroups import CgroupTree, cgroup_dir, kernel_problem
from tests.prereq import require
from tests.scripts_loader import load_script

REPO = Path(__file__).resolve().parent.parent


def test_a_worker_started_in_a_pod_cgroup_is_out_of_the_scripts_process_group() -> None:
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    tree = CgroupTree()
    try:
        pod = cgroup_dir(tree.make(2, "pod-a/ctr"))
        proc = load_script("gpu_e2e").spawn_in(pod, ["sleep", "30"])
        try:
            assert os.getsid(proc.pid) == proc.pid, "not a session of its own"
            assert os.getpgid(proc.pid) != os.getpgid(0)
            procs = pod / "cgroup.procs"
            wait_until(lambda: str(proc.pid) in procs.read_text().split(), timeout=10)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
    finally:
        tree.close()
