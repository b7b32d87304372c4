"""scripts/gpu_e2e.py's workers live in a session of their own: an interrupt or a ``timeout``
sent to the script's process group must not reach them (a signal to a neighbour or host process
there is counted as a wrong kill; benchmarks/reaction.py showed it on 2026-12-06). And the
``hidden-thread`` worker, the real ``scripts/gpu_e2e_worker.py`` over a CUDA-free ``torch``
whose ``cuda.init()`` opens a ``c 195 0`` node (and again from a thread it starts, as CUDA's own
threads do), started in a pod cgroup as the script starts it: from outside, ``/proc/<pid>/fd``
shows no GPU file while the thread's ``/proc/<pid>/task/<tid>/fd`` does, and the child it forks
in that thread keeps the file, stays in the pod's cgroup and records the SIGTERM a container-wide
stop sends it. Then the script's own ``run_trial`` for a ``hidden-thread`` trial, over an NVML
that lists the dead parent while its child lives (as the driver does) and plays gpuguard's
container-wide SIGTERM: the trial keeps the outside view of the file tables and the worker's
own, finds the child and its SIGTERM, and passes; a child nobody stopped is killed after the
trial and fails it. The CUDA side (the real driver, the real enforcer) runs only on a GPU
(docs/gpu-e2e.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rigs.cgroups import CgroupTree, cgroup_dir, kernel_problem
from rigs.controlplane import wait_until
from rigs.prereq import require
from tests.scripts_loader import load_script

REPO = Path(__file__).resolve().parent.parent

FAKE_TORCH = '''
"""A CUDA-free torch for scripts/gpu_e2e_worker.py: cuda.init() opens $FAKE_GPU_DEVICE, then
again from a thread it starts (CUDA starts threads of its own while it sets a context up)."""
import os
import threading
import time

uint8 = "uint8"
_files = []


def _hold():
    _files.append(os.open(os.environ["FAKE_GPU_DEVICE"], os.O_PATH))
    while True:
        time.sleep(3600)


class _Cuda:
    def init(self):
        _files.append(os.open(os.environ["FAKE_GPU_DEVICE"], os.O_PATH))
        threading.Thread(target=_hold, daemon=True).start()
        while len(_files) < 2:
            time.sleep(0.01)

    def synchronize(self):
        pass


cuda = _Cuda()


def empty(size, dtype=None, device=None):
    return bytearray(0)
'''


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


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_a_hidden_thread_worker_hides_its_gpu_files_from_the_leader_and_its_child_keeps_them(
    tmp_path: Path,
) -> None:
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    require(os.geteuid() == 0, "needs root to mknod a char 195:0 device node")
    e2e = load_script("gpu_e2e")
    device = tmp_path / "nvidia0"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(195, 0))
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    records = tmp_path / "records.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FAKE_GPU_DEVICE": str(device)}
    argv = e2e.worker_argv("hidden-thread", "hidden-0", records, 64)
    assert argv[argv.index("--linger") + 1] == "0.3"  # gone well within owner_settle_seconds
    tree = CgroupTree()
    try:
        cg = tree.make(2, "pod-hidden/ctr")
        pod = cgroup_dir(cg)
        proc = e2e.spawn_in(pod, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            e2e.wait_ready(proc, "hidden-0", timeout=30)
            leader, tasks = e2e.gpu_file_view(proc.pid)
            assert leader == [], "the leader's table shows the GPU file: nothing hidden"
            # The thread with the private table and the thread it started share that table.
            assert len(tasks) == 2, tasks
            assert all(files == [str(device), str(device)] for files in tasks.values())
            assert proc.pid not in tasks
            (files,) = [r for r in _records(records) if r["kind"] == "files"]
            assert files["leader"] == []
            assert files["thread"] == [str(device), str(device)]
            assert files["tid"] in tasks

            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            proc.wait(timeout=10)  # the parent exits 0.3 s after the fork
            assert proc.returncode == 0
            kinds = [r["kind"] for r in _records(records)]
            assert kinds[-1] == "parent_exit", kinds
            assert sorted(kinds[-3:-1]) == ["child", "forked"], kinds  # either may come first
            (child,) = [r["pid"] for r in _records(records) if r["kind"] == "child"]
            assert child in e2e.Cgroups.members(pod), "the child left the pod's cgroup"
            child_leader, _ = e2e.gpu_file_view(child)
            assert child_leader == [str(device), str(device)], "the child lost the GPU file"

            pidfd = os.pidfd_open(child)  # what a container-wide stop sends it
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            finally:
                os.close(pidfd)
            wait_until(lambda: child not in e2e.Cgroups.members(pod), timeout=10)
            signals = [r for r in _records(records) if r["kind"] == "signal"]
            assert [(r["pid"], r["role"]) for r in signals] == [(child, "forked-child")]
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            e2e.close_pipes(proc)
    finally:
        tree.close()  # kills whatever stayed in the pod's cgroup (the child, on a failure)


def test_the_hidden_thread_worker_is_started_like_the_forked_one() -> None:
    e2e = load_script("gpu_e2e")
    hidden = e2e.worker_argv("hidden-thread", "h", Path("/r"), 8192)
    forked = e2e.worker_argv("forked", "h", Path("/r"), 8192)
    assert hidden[hidden.index("--role") + 1] == "hidden-thread"
    assert hidden[hidden.index("--role") + 2 :] == forked[forked.index("--role") + 2 :]
    assert sys.executable == hidden[0]


class GhostNvml:
    """NVML for one hidden-thread trial: the worker's PID is listed with 9 GiB from its ``go``
    until the child it forked has exited (the driver keeps listing a dead parent whose child
    holds its files); with ``stop_after`` seconds, gpuguard's part played crudely: that long
    after the child recorded itself, SIGTERM to every member of the pod's cgroup. (Not sooner:
    Python drops a signal that reaches a child between ``fork`` and its after-fork reset.)"""

    def __init__(self, e2e: ModuleType, pod: Path, records: Path, stop_after: float | None):
        self.e2e, self.pod, self.records, self.stop_after = e2e, pod, records, stop_after
        self.t_child: float | None = None
        self.signalled: list[int] = []

    def usage(self, *, mps: bool = False) -> dict[int, int]:
        records = _records(self.records)
        (pid,) = [r["pid"] for r in records if r["kind"] == "ready"]
        if "go" not in [r["kind"] for r in records]:
            return {pid: 512 << 20}
        children = [r["pid"] for r in records if r["kind"] == "child"]
        members = self.e2e.Cgroups.members(self.pod)
        if children and children[0] not in members:
            return {}  # the last holder is gone: the memory is freed
        now = time.monotonic()
        if not children:
            return {pid: 9 << 30}
        self.t_child = self.t_child or now
        if self.stop_after is not None and now - self.t_child > self.stop_after:
            for member in members:
                if member not in self.signalled:
                    pidfd = os.pidfd_open(member)
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
                    finally:
                        os.close(pidfd)
                    self.signalled.append(member)
        return {pid: 9 << 30}


def _hidden_trial(tmp_path: Path, stop_after: float | None) -> tuple[Any, GhostNvml]:
    """``run_trial`` of one hidden-thread trial in a fresh pod cgroup (the real worker over the
    CUDA-free torch)."""
    problem = kernel_problem(((2, ""),))
    require(problem is None, problem or "")
    require(os.geteuid() == 0, "needs root to mknod a char 195:0 device node")
    e2e = load_script("gpu_e2e")
    device = tmp_path / "nvidia0"
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(195, 0))
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    records = tmp_path / "records.jsonl"
    tree = CgroupTree()
    try:
        cg = tree.make(2, "pod-hidden/ctr")
        pod = e2e.PodSpec(name="hidden-thread", limit_bytes=4 << 30)
        pod.cgroup_dir, pod.cgroup_path = cgroup_dir(cg), cg.path
        nvml = GhostNvml(e2e, pod.cgroup_dir, records, stop_after)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PYTHONPATH", str(tmp_path))
            mp.setenv("FAKE_GPU_DEVICE", str(device))
            trial = e2e.run_trial(
                kind="hidden-thread", label="hidden-0", pod=pod, nvml=nvml, records=records,
                limit_bytes=4 << 30, grow_to_mib=8192, timeout=5.0,
            )  # fmt: skip
        left = {
            pid: e2e.process_facts(pid)["cmdline"] for pid in e2e.Cgroups.members(pod.cgroup_dir)
        }
        assert left == {}, f"the trial left a process behind: {trial.problem} {_records(records)}"
    finally:
        tree.close()
    return trial, nvml


def test_a_hidden_thread_trial_stopped_through_its_pod_keeps_both_views_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trial, nvml = _hidden_trial(tmp_path, stop_after=0.3)
    assert trial.ok, trial.problem
    assert trial.leader_gpu_files == []
    assert len(trial.task_gpu_files) == 2
    assert trial.worker_file_tables["leader"] == []
    assert trial.worker_file_tables["tid"] in trial.task_gpu_files
    assert trial.child_pid in nvml.signalled
    assert trial.t_parent_exit is not None
    assert trial.cross_to_term_s is not None
    assert trial.cross_to_freed_s is not None
    assert trial.listed_after_parent_exit_s is not None  # the ghost was seen
    e2e = load_script("gpu_e2e")
    e2e.print_table(
        {
            "summary": e2e.summarise([trial], 1.3),
            "delisted_after_exit": e2e.summarise_delisting([trial]),
            "enforcer_cpu": {"polls": 1, "cpu_ms_per_poll": 1.0, "wall_ms_per_poll": 1.0},
            "wrong_kills": [],
            "trials": [dataclasses.asdict(trial)],
        }
    )
    printed = capsys.readouterr().out
    assert "hidden-thread hidden-0: at ready /proc/<pid>/fd showed 0 GPU file(s)" in printed
    assert f"child {trial.child_pid}" in printed
    assert "forked hidden-0: dead parent listed" in printed


def test_a_hidden_thread_child_nobody_stopped_is_killed_after_the_trial_and_fails_it(
    tmp_path: Path,
) -> None:
    trial, nvml = _hidden_trial(tmp_path, stop_after=None)
    assert not trial.ok
    assert nvml.signalled == []
    assert "no SIGTERM received" in trial.problem
    assert f"[{trial.child_pid}] still in the pod's cgroup after the trial" in trial.problem
