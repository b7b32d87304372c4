"""The GPU check (``ProcfsProcessResolver(check_gpu_fds=True)``) against tenants' processes
that hide their GPU files, hold files whose file system never answers, sit in an ``exec`` that
never ends, or hold tens of thousands of files: real processes, the real ``/proc``, a real
FUSE mount whose daemon is stopped (``tests/kernel/fuse_stall.py``). Each answer must be right
or unknown, come within a bound, and leave every other PID's answer right.

A GPU file is simulated as the other kernel tests do: a ``c 195 0`` node made with ``mknod``
and opened ``O_PATH`` (no driver is opened) looks like ``/dev/nvidia0`` through ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters.procfs import (
    BLOCKED_PROBES_LIMIT,
    BLOCKED_REASON,
    GPU_CHECK_FD_LIMIT,
    ProcfsProcessResolver,
    read_identity,
)
from rigs.cgroups import CgroupTree, fake_container_id, node_container
from rigs.kill_targets import POD_A, POD_B
from rigs.prereq import require
from tests.kernel.fuse_stall import fuse_mount
from tests.kernel.stuck import EXEC_AFTER_GO, FAT, HOLD, blocks, stuck_in_exec

pytestmark = pytest.mark.kernel

PROC = Path("/proc")
BOUND_SECONDS = 10.0
"""How long a test waits for an answer before calling it blocked: generous (the resolver's
own bound is ``PROBE_DEADLINE_SECONDS``, 0.25 s); a check that blocks never answers at all."""
T = TypeVar("T")

UNSHARED = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
opened = threading.Event()

def hide():
    if libc.unshare(0x400) != 0:  # CLONE_FILES: this thread's own copy of the file table
        raise OSError(ctypes.get_errno(), "unshare(CLONE_FILES)")
    os.open(sys.argv[1], os.O_PATH)  # the GPU file, in this thread's table only
    opened.set()
    threading.Event().wait()

threading.Thread(target=hide, daemon=True).start()
opened.wait()
print("ready", flush=True)
threading.Event().wait()
"""

THREADS = r"""
import os, sys, threading
for _ in range(int(sys.argv[2])):
    os.open("/dev/null", os.O_RDONLY)
for _ in range(int(sys.argv[1])):
    threading.Thread(target=threading.Event().wait, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture(name="nvidia_node")
def nvidia_node_fixture(tmp_path: Path) -> Path:
    require(os.geteuid() == 0, "needs root to mknod a char 195:0 device node")
    node = tmp_path / "nvidia0"
    os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(195, 0))
    return node


@pytest.fixture(name="spawn")
def spawn_fixture() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``python -c SCRIPT ARGS`` and wait for its ``ready``; killed after the test."""
    started: list[subprocess.Popen[str]] = []

    def spawn(script: str, *args: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", f"{script[:40]!r} did not start"
        return proc

    yield spawn
    for proc in started:
        proc.kill()
    for proc in started:
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _within(seconds: float, call: Callable[[], T], what: str) -> T:
    """``call()``'s result, or the test fails if it has not returned in ``seconds`` (it is
    left in a daemon thread; the fixtures' teardown unblocks it)."""
    result: list[T] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"{what} did not return within {seconds} s: blocked")
    assert result, f"{what} raised (see the thread's traceback above)"
    return result[0]


def _leader_links(pid: int) -> set[str]:
    links = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{name}"))
        except FileNotFoundError:
            continue
    return links


def test_a_gpu_file_open_only_in_a_thread_with_its_own_file_table_is_seen(
    nvidia_node: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    worker = spawn(UNSHARED, nvidia_node)
    assert str(nvidia_node) not in _leader_links(worker.pid), "the test hides nothing"

    got = ProcfsProcessResolver(PROC, check_gpu_fds=True).attribute(worker.pid)

    assert got.holds_gpu is True  # was False: its memory went uncharged until it settled


def test_a_process_with_many_threads_and_no_gpu_file_is_still_read_as_holding_none(
    spawn: Callable[..., subprocess.Popen[str]],
) -> None:
    # 64 threads sharing one table of ~300 files: read once (kcmp), not 64 times over the
    # bound, so an honest process that holds no GPU file is still "no", not unknown.
    worker = spawn(THREADS, 64, 300)

    got = ProcfsProcessResolver(PROC, check_gpu_fds=True).attribute(worker.pid)

    assert got.holds_gpu is False


def test_a_file_on_a_stopped_fuse_daemon_blocks_neither_its_process_nor_another(
    tmp_path: Path, nvidia_node: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    with fuse_mount(tmp_path) as fuse:
        tenant = spawn(HOLD, fuse.file, nvidia_node)  # the FUSE file first, the GPU file after
        plain = spawn(HOLD, fuse.file)
        neighbour = spawn(HOLD, nvidia_node)
        fuse.stop()
        link = f"/proc/{tenant.pid}/fd/3"
        assert os.readlink(link) == str(fuse.file)
        # What the check did before: stat() of the link asks the stopped daemon, and waits.
        assert blocks(lambda: os.stat(link)), "the stopped daemon does not block a stat"

        resolver = ProcfsProcessResolver(PROC, check_gpu_fds=True)
        got = _within(
            BOUND_SECONDS,
            lambda: {p.pid: resolver.attribute(p.pid) for p in (tenant, plain, neighbour)},
            "the GPU check of a process holding a file on a stopped FUSE daemon",
        )

        assert got[tenant.pid].holds_gpu is True  # read past the FUSE file, from its cache
        assert got[plain.pid].holds_gpu is False
        assert got[neighbour.pid].holds_gpu is True


def test_a_process_stuck_in_exec_on_a_stopped_fuse_daemon_stalls_no_other_attribution(
    tmp_path: Path, nvidia_node: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    with fuse_mount(tmp_path) as fuse:
        tenant = spawn(EXEC_AFTER_GO, fuse.file)
        neighbour = spawn(HOLD, nvidia_node)
        stuck_in_exec(fuse, tenant)  # its stat, fd links and kcmp now block (Linux 6.18)

        resolver = ProcfsProcessResolver(PROC, check_gpu_fds=True, pin_processes=True)
        with capture_logs() as logs:
            first = _within(BOUND_SECONDS, lambda: resolver.attribute(tenant.pid), "a stuck PID")
            other = _within(BOUND_SECONDS, lambda: resolver.attribute(neighbour.pid), "another")
            again = _within(BOUND_SECONDS, lambda: resolver.attribute(tenant.pid), "again")

        assert first.identity is None
        assert first.reason == BLOCKED_REASON
        assert again.reason == BLOCKED_REASON  # answered at once: its read is still blocked
        assert other.identity is not None
        assert other.holds_gpu is True
        blocked = [e for e in logs if e["event"] == "proc_read_blocked"]
        assert [(e["pid"], e["reading"]) for e in blocked] == [(tenant.pid, "stat")]
        resolver.close()


def test_a_pod_with_more_processes_stuck_in_exec_than_the_limit_leaves_another_pods_attributed(
    cgroup_tree: CgroupTree, tmp_path: Path
) -> None:
    # Was: past BLOCKED_PROBES_LIMIT blocked reads, every PID not read yet was unknown without a
    # read, so one pod's processes stuck in exec left every other pod's new processes (and their
    # memory) unattributed. Now past the limit a PID is read if its pod has no read blocked past
    # it: the tenant's pod gets one more, the neighbour's new process is read as usual.
    tenant_pod = node_container(cgroup_tree, pod_uid=POD_A, container_id=fake_container_id(1))
    other_pod = node_container(cgroup_tree, pod_uid=POD_B, container_id=fake_container_id(2))
    count = BLOCKED_PROBES_LIMIT + 2
    tenants: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_close_pipes, tenants)
        fuse = cleanup.enter_context(fuse_mount(tmp_path))  # killed first: unblocks every read
        piped = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
        argv = [sys.executable, "-c", EXEC_AFTER_GO, str(fuse.file)]
        for _ in range(count):
            tenants.append(cgroup_tree.spawn(argv, cgroups=[tenant_pod], **piped))
            assert tenants[-1].stdout is not None
            assert tenants[-1].stdout.readline().strip() == b"ready"
        stuck_in_exec(fuse, *tenants)  # the cgroup of each is still read at once (Linux 6.18)
        resolver = ProcfsProcessResolver(PROC, check_gpu_fds=True, pin_processes=True)
        cleanup.callback(resolver.close)

        with capture_logs() as logs:
            stuck = _within(
                BOUND_SECONDS,
                lambda: [resolver.attribute(t.pid) for t in tenants],
                f"{count} PIDs stuck in exec",
            )
            neighbour = cgroup_tree.spawn(["sleep", "600"], cgroups=[other_pod])  # started now
            other = _within(BOUND_SECONDS, lambda: resolver.attribute(neighbour.pid), "another")

        assert [a.reason for a in stuck] == [BLOCKED_REASON] * count
        assert other.pod_uid == POD_B  # was None: "did not finish in time", never read
        assert other.identity == read_identity(PROC, neighbour.pid)
        blocked = [e for e in logs if e["event"] == "proc_read_blocked"]
        read = [e["pid"] for e in blocked if e["reading"] != "cgroup"]
        # The limit, charged to no pod, then one more read for the tenant's pod; its last
        # process is not read (no thread left waiting on it). Only the lookup of whom that last
        # one would be charged to reads anything (its ``cgroup``, which does not block): on a
        # loaded machine it may outlast the 20 ms floor and be logged late, never a ``stat``.
        assert read == [t.pid for t in tenants[: BLOCKED_PROBES_LIMIT + 1]]
        late_lookups = [e["pid"] for e in blocked if e["reading"] == "cgroup"]
        assert set(late_lookups) <= {tenants[-1].pid}, late_lookups
        [full] = [e for e in logs if e["event"] == "proc_reads_blocked_limit"]
        assert full["blocked_pids"] == sorted(read)


def _close_pipes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()


def test_a_process_holding_tens_of_thousands_of_files_is_unknown_named_and_others_are_read(
    nvidia_node: Path, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    # 50 000 where the hard RLIMIT_NOFILE allows (raising it needs CAP_SYS_RESOURCE), else as
    # many as it does: any count past the bound costs the same bounded check.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = 50_000 if hard == resource.RLIM_INFINITY else min(50_000, hard - 64)
    require(count > 4 * GPU_CHECK_FD_LIMIT, f"RLIMIT_NOFILE {hard} allows too few files")
    fat = spawn(FAT, count)
    neighbour = spawn(HOLD, nvidia_node)
    resolver = ProcfsProcessResolver(PROC, check_gpu_fds=True)

    with capture_logs() as logs:
        got = _within(
            BOUND_SECONDS,
            lambda: [resolver.attribute(p.pid) for p in (fat, neighbour, fat)],
            "attribution beside a process holding 50 000 files",
        )

    assert got[0].holds_gpu is None  # unknown: charged like an open GPU file
    assert got[1].holds_gpu is True
    assert got[2].holds_gpu is None
    incomplete = [e for e in logs if e["event"] == "gpu_fd_check_incomplete"]
    # Named once: the second ask is answered from what the first found, not read again.
    assert [e["pid"] for e in incomplete] == [fat.pid]
    # At the entry bound, or (on a machine too busy to read 4096 entries in 0.2 s) its time.
    assert (incomplete[0]["why"], incomplete[0]["fds_read"]) in (
        ("fd_limit", GPU_CHECK_FD_LIMIT + 1),
        ("deadline", incomplete[0]["fds_read"]),
    )
