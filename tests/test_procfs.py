"""ProcfsProcessResolver against fixture ``/proc`` trees (layouts this kernel cannot host), a tree
that changes under it (PID reuse), and the real ``/proc``."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gpuguard.adapters import procfs
from gpuguard.adapters.procfs import (
    BLOCKED_REASON,
    GHOST_REASON,
    REUSED_REASON,
    ProcfsProcessResolver,
    read_cgroup_text,
    read_identity,
    read_process_name,
    read_start_ticks,
)
from gpuguard.core.cgroup import REASON_CONMON, REASON_NO_KUBEPODS
from gpuguard.core.model import ContainerCgroup, ProcessIdentity, Runtime

FIXTURES = Path(__file__).parent / "fixtures" / "proc"
UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
HASH = "6a1a0f3c2b9e4d8f9a7b6c5d4e3f2a1b"
C = "a" * 60 + "c0de"
U_ = UID.replace("-", "_")


def stat_line(pid: int, comm: str, start_ticks: int) -> str:
    """A ``/proc/<pid>/stat`` line with ``starttime`` (field 22) = ``start_ticks``."""
    rest = ["S", "1", str(pid), str(pid), "0", "-1", "4194560", *["0"] * 8, "20", "0", "1", "0"]
    return f"{pid} ({comm}) {' '.join([*rest, str(start_ticks), *['0'] * 30])}\n"


def write_proc(root: Path, pid: int, start_ticks: int, cgroup: str | None, comm: str = "x") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, comm, start_ticks))
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)


@pytest.mark.parametrize(
    ("pid", "uid", "runtime", "cgroup"),
    [
        pytest.param(
            1001,
            UID,
            Runtime.CRIO,
            ContainerCgroup(
                version=2,
                hierarchy="",
                path="/kubepods.slice/kubepods-burstable.slice/"
                f"kubepods-burstable-pod{U_}.slice/crio-{C}.scope",
            ),
            id="crio-crun-container-subgroup",
        ),
        pytest.param(
            1002,
            UID,
            Runtime.CONTAINERD,
            ContainerCgroup(
                version=2,
                hierarchy="",
                path=f"/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice/"
                f"cri-containerd-{C}.scope",
            ),
            id="private-cgroupns-relative",
        ),
        pytest.param(
            1003,
            UID,
            Runtime.CONTAINERD,
            ContainerCgroup(
                version=2,
                hierarchy="",
                path="/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
                f"kubelet-kubepods-besteffort-pod{U_}.slice/cri-containerd-{C}.scope",
            ),
            id="kind",
        ),
        pytest.param(
            1004,
            HASH,
            Runtime.CONTAINERD,
            ContainerCgroup(
                version=2,
                hierarchy="",
                path="/kubepods.slice/kubepods-burstable.slice/"
                f"kubepods-burstable-pod{HASH}.slice/cri-containerd-{C}.scope",
            ),
            id="static-pod",
        ),
        pytest.param(
            1005,
            UID,
            None,
            ContainerCgroup(version=1, hierarchy="pids", path=f"/kubepods/burstable/pod{UID}/{C}"),
            id="v1-cgroupfs-comm-with-parens",
        ),
    ],
)
def test_fixture_pods_are_attributed_with_their_identity(
    pid: int, uid: str, runtime: Runtime | None, cgroup: ContainerCgroup
) -> None:
    got = ProcfsProcessResolver(FIXTURES).attribute(pid)
    assert got.identity == ProcessIdentity(pid=pid, start_ticks=88000 + pid - 1000)
    assert got.is_pod
    assert got.pod_uid == uid
    assert got.container_id == C
    assert got.runtime == runtime
    assert got.cgroup == cgroup
    assert got.cgroup_version == cgroup.version
    assert got.reason is None


def test_comm_with_spaces_and_parens_does_not_shift_the_starttime_field() -> None:
    assert read_start_ticks(FIXTURES, 1005) == 88005
    assert read_identity(FIXTURES, 1005) == ProcessIdentity(pid=1005, start_ticks=88005)


def test_crio_conmon_is_not_a_pod_process() -> None:
    got = ProcfsProcessResolver(FIXTURES).attribute(1006)
    assert not got.is_pod
    assert got.identity is not None
    assert got.reason == REASON_CONMON


def test_a_host_service_is_not_a_pod_process() -> None:
    got = ProcfsProcessResolver(FIXTURES).attribute(1007)
    assert not got.is_pod
    assert got.container_id is None
    assert got.reason == REASON_NO_KUBEPODS
    assert got.cgroup_version == 1


def test_a_pid_that_exits_between_stat_and_cgroup_is_a_ghost() -> None:
    got = ProcfsProcessResolver(FIXTURES).attribute(1008)
    assert got.identity is None
    assert not got.is_pod
    assert got.reason == GHOST_REASON


def test_a_pid_not_in_proc_is_a_ghost_and_does_not_raise() -> None:
    got = ProcfsProcessResolver(FIXTURES).attribute(4_000_000)
    assert got.identity is None
    assert got.reason == GHOST_REASON
    assert read_cgroup_text(FIXTURES, 4_000_000) is None


def test_a_reused_pid_with_a_new_starttime_gets_a_fresh_attribution(tmp_path: Path) -> None:
    pod_line = f"0::/kubepods/besteffort/pod{UID}/{C}\n"
    write_proc(tmp_path, 500, 1000, pod_line)
    resolver = ProcfsProcessResolver(tmp_path)
    first = resolver.attribute(500)
    assert first.pod_uid == UID

    # The pod process exits and a host process gets the same PID.
    write_proc(tmp_path, 500, 2000, "0::/system.slice/sshd.service\n")
    second = resolver.attribute(500)
    assert second.identity == ProcessIdentity(pid=500, start_ticks=2000)
    assert not second.is_pod
    assert second.reason == REASON_NO_KUBEPODS


def test_the_cache_is_keyed_by_identity_so_the_same_process_is_not_reread(
    tmp_path: Path,
) -> None:
    write_proc(tmp_path, 500, 1000, f"0::/kubepods/pod{UID}/{C}\n")
    resolver = ProcfsProcessResolver(tmp_path)
    first = resolver.attribute(500)
    # Same identity: the cgroup file is not read again (a container's cgroup does not change).
    (tmp_path / "500" / "cgroup").unlink()
    assert resolver.attribute(500) == first


def test_the_cache_is_bounded_and_keeps_the_most_recent(tmp_path: Path) -> None:
    for pid in range(600, 610):
        write_proc(tmp_path, pid, pid * 10, f"0::/kubepods/pod{UID}/{C}\n")
    resolver = ProcfsProcessResolver(tmp_path, cache_size=3)
    for pid in range(600, 610):
        resolver.attribute(pid)
    for pid in range(600, 610):
        (tmp_path / str(pid) / "cgroup").unlink()

    # Remembered: answered without the cgroup file. Forgotten: read again, and it is gone.
    remembered = [pid for pid in range(600, 610) if resolver.attribute(pid).pod_uid == UID]

    assert remembered == [607, 608, 609]


def test_ghosts_and_failures_are_not_cached(tmp_path: Path) -> None:
    resolver = ProcfsProcessResolver(tmp_path)
    assert resolver.attribute(700).reason == GHOST_REASON
    write_proc(tmp_path, 700, 1, f"0::/kubepods/pod{UID}/{C}\n")
    assert resolver.attribute(700).pod_uid == UID


# ---------------------------------------------------------------------------------------------
# A /proc whose stat changes between reads, as when a PID is reused while it is being read. The
# files are real (tmp_path); only the order of stat contents is scripted, by a Path subclass.


@dataclass
class _Script:
    """Scripted ``<pid>/stat`` contents: the kernel changing the file between two reads, a race
    a test cannot force on the real /proc. Every other file is read for real."""

    stats: list[bytes]
    reads: int = 0


@pytest.fixture
def scripted_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    script = _Script(stats=[])
    real_read_at = procfs._read_at

    def read_at(dir_fd: int, name: str) -> bytes | None:
        if name == "stat" and script.stats:
            script.reads += 1
            return script.stats.pop(0)
        return real_read_at(dir_fd, name)

    monkeypatch.setattr(procfs, "_read_at", read_at)

    def make(pid: int, starts: list[int], cgroup: str) -> tuple[Path, _Script]:
        write_proc(tmp_path, pid, starts[-1], cgroup)
        script.stats[:] = [stat_line(pid, "x", s).encode() for s in starts]
        return tmp_path, script

    return make


def test_a_pid_reused_while_reading_is_retried_with_the_new_identity(scripted_proc: Any) -> None:
    root, script = scripted_proc(800, [1000, 2000, 2000, 2000], f"0::/kubepods/pod{UID}/{C}\n")
    got = ProcfsProcessResolver(root).attribute(800)
    assert got.identity == ProcessIdentity(pid=800, start_ticks=2000)
    assert got.pod_uid == UID
    assert script.reads == 4  # before, after (changed), before, after (same)


def test_a_pid_that_keeps_changing_while_reading_is_not_attributed(scripted_proc: Any) -> None:
    root, script = scripted_proc(801, [1000, 2000, 3000, 4000], f"0::/kubepods/pod{UID}/{C}\n")
    resolver = ProcfsProcessResolver(root)
    got = resolver.attribute(801)
    assert got.identity is None
    assert not got.is_pod
    assert got.reason == REUSED_REASON
    # Nothing was remembered: each identity seen is read again (its cgroup file now gone).
    (root / "801" / "cgroup").unlink()
    for start in (1000, 2000, 3000, 4000):
        script.stats[:] = [stat_line(801, "x", start).encode()]
        assert resolver.attribute(801).reason == GHOST_REASON


def test_an_unreadable_cgroup_file_is_a_reason_not_an_exception(tmp_path: Path) -> None:
    write_proc(tmp_path, 900, 5, None)
    (tmp_path / "900" / "cgroup").mkdir()  # EISDIR on read
    got = ProcfsProcessResolver(tmp_path).attribute(900)
    assert got.identity is None
    assert got.reason is not None
    assert "cannot read" in got.reason


# ---------------------------------------------------------------------------------------------
# S7: nothing but stat and cgroup (and, when asked, the names of fd links) is ever opened.


_opened: list[str] | None = None
LISTED_BY_DESCRIPTOR = "listed by descriptor"


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is None:
        return
    if event == "open" and isinstance(args[2], int) and args[2] & os.O_PATH:
        # <proc_root>/<pid> opened O_PATH, for openat without following a symlink: no content
        # can be read through such a descriptor. Recorded by its path's last name, the PID.
        _opened.append(f"O_PATH:{Path(str(args[0])).name}")
    elif event in ("os.listdir", "os.scandir") and isinstance(args[0], int):
        _opened.append(LISTED_BY_DESCRIPTOR)  # a directory opened (and recorded) just before
    elif event in ("open", "os.listdir", "os.scandir"):
        _opened.append(str(args[0]))


sys.addaudithook(_audit)


def test_attribution_opens_only_stat_and_cgroup(tmp_path: Path) -> None:
    global _opened
    for pid in (1001, 1006, 1008):
        shutil.copytree(FIXTURES / str(pid), tmp_path / str(pid))
    for pid in (1001, 1006):
        for forbidden in ("root", "cwd", "environ", "cmdline", "maps"):
            (tmp_path / str(pid) / forbidden).write_text("secret")
    resolver = ProcfsProcessResolver(tmp_path)
    _opened = []
    try:
        for pid in (1001, 1006, 1008, 1234):
            resolver.attribute(pid)
        seen = list(_opened)
    finally:
        _opened = None
    assert seen, "the audit hook saw nothing: the test would prove nothing"
    names = {Path(p).name for p in seen}
    allowed = {"stat", "cgroup", *(f"O_PATH:{pid}" for pid in (1001, 1006, 1008, 1234))}
    assert names <= allowed, seen


def test_the_real_proc_attributes_this_test_process() -> None:
    proc = Path("/proc")
    got = ProcfsProcessResolver(proc).attribute(os.getpid())
    assert got.identity == read_identity(proc, os.getpid())
    assert got.identity is not None
    assert got.cgroup_version in (1, 2)
    if not got.is_pod:
        assert got.reason is not None


def test_the_real_proc_reports_an_exited_child_as_a_ghost() -> None:
    # The reaped child's PID may go to another process before the check. Then the resolver must
    # see someone else (another start time), and a fresh child is tried: ten reuses in a row do
    # not happen by chance, so the test never needs to skip.
    proc = Path("/proc")
    for _ in range(10):
        child = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
        identity = read_identity(proc, child.pid)
        child.communicate()  # EOF on stdin: cat exits, and is reaped
        assert identity is not None
        got = ProcfsProcessResolver(proc).attribute(child.pid)
        if got.identity is None:
            break
        assert got.identity != identity, f"the reaped child was attributed as alive: {got}"
    else:
        pytest.fail("the child's PID was taken by another process before the check, ten times")
    assert got.reason == GHOST_REASON


def test_gpu_fd_check_sees_a_process_without_gpu_files_as_not_holding_one() -> None:
    resolver = ProcfsProcessResolver(Path("/proc"), check_gpu_fds=True)
    got = resolver.attribute(os.getpid())
    # This test process has no /dev/nvidia* open (and root can read its own fds).
    assert got.holds_gpu is False


def test_gpu_fd_check_recognises_a_gpu_device_link(tmp_path: Path) -> None:
    write_proc(tmp_path, 42, 7, f"0::/kubepods/pod{UID}/{C}\n")
    fd = tmp_path / "42" / "fd"
    fd.mkdir()
    (fd / "0").symlink_to("/dev/null")
    (fd / "3").symlink_to("/dev/nvidiactl")
    resolver = ProcfsProcessResolver(tmp_path, check_gpu_fds=True)
    assert resolver.attribute(42).holds_gpu is False
    (fd / "4").symlink_to("/dev/nvidia0")
    assert resolver.attribute(42).holds_gpu is True  # not cached: read on every call


def test_gpu_fd_check_recognises_a_device_path_as_seen_inside_a_container(
    tmp_path: Path,
) -> None:
    # From the host, readlink of a container's fd shows the path within the container's mount
    # (e.g. "/nvidia0" for a bind-mounted /dev/nvidia0), not the host's /dev path.
    write_proc(tmp_path, 43, 7, f"0::/kubepods/pod{UID}/{C}\n")
    fd = tmp_path / "43" / "fd"
    fd.mkdir()
    (fd / "5").symlink_to("/nvidia3")
    assert ProcfsProcessResolver(tmp_path, check_gpu_fds=True).attribute(43).holds_gpu is True


def test_gpu_fd_check_lists_fds_but_opens_nothing_else(tmp_path: Path) -> None:
    global _opened
    write_proc(tmp_path, 44, 7, f"0::/kubepods/pod{UID}/{C}\n")
    fd = tmp_path / "44" / "fd"
    fd.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("x")
    (fd / "0").symlink_to(secret)
    resolver = ProcfsProcessResolver(tmp_path, check_gpu_fds=True)
    _opened = []
    try:
        resolver.attribute(44)
        seen = list(_opened)
    finally:
        _opened = None
    # fd/ and task/ are listed through the descriptors opened for them, never followed.
    allowed = {"stat", "cgroup", "fd", "task", "O_PATH:44", LISTED_BY_DESCRIPTOR}
    assert {Path(p).name for p in seen} <= allowed, seen


# ---------------------------------------------------------------------------------------------
# A hostile or broken tree (``explain --proc-root`` on a directory someone else can write, a
# misconfigured ``node.proc_root``): nothing blocks, nothing outside the tree is read, and a file
# is read whole or reported unreadable, never cut short.

POD_LINE = f"0::/kubepods/besteffort/pod{UID}/{C}\n"
BOUND = 1 << 20
"""``procfs.READ_LIMIT_BYTES``: the largest file read whole."""


def _attribute_or_fail(resolver: ProcfsProcessResolver, pid: int, unblock: list[Path]) -> Any:
    """``attribute(pid)`` in a thread: a read that blocks (a FIFO without a writer) fails the
    test instead of hanging it. On failure each FIFO in ``unblock`` gets a writer, so the
    blocked ``open`` returns and the thread ends."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(resolver.attribute(pid)), daemon=True)
    worker.start()
    worker.join(5.0)
    if worker.is_alive():
        for fifo in unblock:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5.0)
        pytest.fail(f"attribute({pid}) blocked on a FIFO in the proc root")
    return result[0]


@pytest.mark.parametrize("name", ["stat", "cgroup"])
def test_a_fifo_in_the_tree_is_unreadable_and_never_blocks(tmp_path: Path, name: str) -> None:
    write_proc(tmp_path, 60, 7, POD_LINE)
    fifo = tmp_path / "60" / name
    fifo.unlink()
    os.mkfifo(fifo)
    got = _attribute_or_fail(ProcfsProcessResolver(tmp_path), 60, [fifo])
    assert got.identity is None
    assert not got.is_pod
    assert got.reason is not None
    assert "not a regular file" in got.reason


@pytest.mark.parametrize("name", ["stat", "cgroup"])
def test_a_symlinked_file_is_not_followed_out_of_the_tree(tmp_path: Path, name: str) -> None:
    outside, root = tmp_path / "outside", tmp_path / "proc"
    write_proc(outside, 61, 7, POD_LINE)
    write_proc(root, 61, 7, POD_LINE)
    (root / "61" / name).unlink()
    (root / "61" / name).symlink_to(outside / "61" / name)
    got = ProcfsProcessResolver(root).attribute(61)
    assert got.identity is None
    assert not got.is_pod
    assert got.reason is not None
    assert "symbolic link" in got.reason
    with pytest.raises(OSError, match="symbolic link"):
        procfs._read(root, 61, name)


def test_a_symlinked_pid_directory_is_not_followed_out_of_the_tree(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "proc"
    write_proc(outside, 62, 7, POD_LINE)
    root.mkdir()
    (root / "62").symlink_to(outside / "62")
    got = ProcfsProcessResolver(root).attribute(62)
    assert got.identity is None
    assert not got.is_pod
    assert got.reason is not None
    assert "symbolic link" in got.reason
    with pytest.raises(OSError, match="symbolic link"):
        read_cgroup_text(root, 62)


def _cgroup_of_size(size: int) -> str:
    """A hybrid-host cgroup text of exactly ``size`` bytes whose pod line is the last one."""
    head = "1:name=systemd:/"
    filler = "x" * (size - len(POD_LINE) - len(head) - 1)
    text = f"{head}{filler}\n{POD_LINE}"
    assert len(text.encode()) == size
    return text


@pytest.mark.parametrize("size", [65536 + 100, 300_000, BOUND])
def test_a_cgroup_file_over_64_kib_is_read_whole_so_its_last_pod_line_counts(
    tmp_path: Path, size: int
) -> None:
    write_proc(tmp_path, 63, 7, _cgroup_of_size(size))
    got = ProcfsProcessResolver(tmp_path).attribute(63)
    assert got.pod_uid == UID
    assert got.container_id == C
    text = read_cgroup_text(tmp_path, 63)
    assert text is not None
    assert len(text) == size


def test_a_cgroup_file_over_the_bound_is_unknown_never_truncated(tmp_path: Path) -> None:
    write_proc(tmp_path, 64, 7, _cgroup_of_size(BOUND + 1))
    got = ProcfsProcessResolver(tmp_path).attribute(64)
    assert got.identity is None  # unknown: no signal, never an attribution from a prefix
    assert not got.is_pod
    assert got.reason is not None
    assert "larger than" in got.reason
    with pytest.raises(OSError, match="larger than"):
        read_cgroup_text(tmp_path, 64)
    assert procfs.READ_LIMIT_BYTES == BOUND


@pytest.mark.parametrize(
    "stat_text",
    ["garbage\n", "", "65 (x) S 1 2 3\n", "65 (x) S" + " 0" * 18 + " notanumber 0 0\n"],
)
def test_an_unparsable_stat_is_reported_as_such_not_as_a_pid_not_in_proc(
    tmp_path: Path, stat_text: str
) -> None:
    write_proc(tmp_path, 65, 7, POD_LINE)
    (tmp_path / "65" / "stat").write_text(stat_text)
    got = ProcfsProcessResolver(tmp_path).attribute(65)
    assert got.identity is None
    assert not got.is_pod
    assert got.reason != GHOST_REASON
    assert got.reason == procfs.STAT_UNPARSABLE_REASON
    assert read_start_ticks(tmp_path, 65) is None  # the public reader's contract is unchanged


# ---------------------------------------------------------------------------------------------
# Process names (inspect's NAME column)


@pytest.mark.parametrize("comm", ["python3", "a b) (c", "pt_main_thread", "\x1b[31mred"])
def test_a_process_name_is_its_comm_even_with_spaces_and_parentheses(
    tmp_path: Path, comm: str
) -> None:
    write_proc(tmp_path, 42, 1000, None, comm=comm)

    assert read_process_name(tmp_path, ProcessIdentity(pid=42, start_ticks=1000)) == comm


def test_a_reused_pid_does_not_lend_its_new_process_name(tmp_path: Path) -> None:
    write_proc(tmp_path, 42, 2000, None, comm="innocent")

    assert read_process_name(tmp_path, ProcessIdentity(pid=42, start_ticks=1000)) is None


def test_a_gone_or_unreadable_process_has_no_name(tmp_path: Path) -> None:
    (tmp_path / "43").mkdir()
    os.mkfifo(tmp_path / "43" / "stat")

    assert read_process_name(tmp_path, ProcessIdentity(pid=42, start_ticks=1000)) is None
    assert read_process_name(tmp_path, ProcessIdentity(pid=43, start_ticks=1000)) is None


def test_the_real_process_name_is_what_the_kernel_shows_in_comm() -> None:
    me = read_identity(Path("/proc"), os.getpid())
    assert me is not None

    name = read_process_name(Path("/proc"), me)

    assert name == Path("/proc/self/comm").read_text().removesuffix("\n")


# ---------------------------------------------------------------------------------------------
# Bounds: each PID's reads under a deadline, the GPU check per PID and overall. A tenant's
# process can block a read (tests/kernel/test_hostile_fd_tables.py does it for real: an exec
# stuck on a stopped FUSE daemon); here a read is made to block on an Event instead.


@dataclass
class _BlockingReads:
    """Reads of ``stat`` of the PIDs in ``pids`` block until ``release`` is set, as an ``exec``
    stuck in a FUSE flush blocks them (its ``cgroup`` reads at once, Linux 6.18); ``files``
    names the files that block. ``asked`` counts reads by PID and file."""

    pids: set[int] = field(default_factory=set)
    files: frozenset[str] = frozenset({"stat"})
    release: threading.Event = field(default_factory=threading.Event)
    asked: dict[tuple[int, str], int] = field(default_factory=dict)


@pytest.fixture
def blocking_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[_BlockingReads]:
    """``_read_at`` that blocks, for the PIDs in ``.pids``, until ``.release`` is set."""
    reads = _BlockingReads()
    real_read_at = procfs._read_at

    def read_at(dir_fd: int, name: str) -> bytes | None:
        pid = int(Path(os.readlink(f"/proc/self/fd/{dir_fd}")).name)
        reads.asked[pid, name] = reads.asked.get((pid, name), 0) + 1
        if pid in reads.pids and name in reads.files:
            reads.release.wait(30)
        return real_read_at(dir_fd, name)

    monkeypatch.setattr(procfs, "_read_at", read_at)
    yield reads
    reads.release.set()


def _answer_within(resolver: ProcfsProcessResolver, pid: int, seconds: float = 5.0) -> Any:
    """``attribute(pid)``, failing the test if it takes longer than ``seconds``."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(resolver.attribute(pid)), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        pytest.fail(f"attribute({pid}) did not return within {seconds} s")
    return result[0]


def test_a_pid_whose_reads_block_is_unknown_in_time_and_blocks_no_other(
    tmp_path: Path, blocking_reads: _BlockingReads
) -> None:
    for pid in (901, 902):
        write_proc(tmp_path, pid, 7, POD_LINE)
    blocking_reads.pids = {901}
    resolver = ProcfsProcessResolver(tmp_path)

    with capture_logs() as logs:
        stuck = _answer_within(resolver, 901)
        other = _answer_within(resolver, 902)
        again = _answer_within(resolver, 901)
        blocking_reads.release.set()
        deadline = time.monotonic() + 5
        while resolver.attribute(901).reason == BLOCKED_REASON and time.monotonic() < deadline:
            time.sleep(0.01)
        after = resolver.attribute(901)

    assert stuck.identity is None
    assert stuck.reason == BLOCKED_REASON
    assert other.pod_uid == UID
    assert again.reason == BLOCKED_REASON
    assert after.pod_uid == UID
    events = [(e["event"], e["pid"]) for e in logs if e["event"].startswith("proc_read")]
    assert events == [("proc_read_blocked", 901), ("proc_read_unblocked", 901)]
    assert logs[0]["reading"] == "stat"
    resolver.close()


OTHER_UID = "0c9d5a5e-7d1e-4e8a-9a51-3f0b1c2d3e4f"
OTHER_POD_LINE = f"0::/kubepods/besteffort/pod{OTHER_UID}/{'b' * 64}\n"


def test_past_the_limit_of_blocked_reads_a_pod_with_one_blocked_is_not_read_again(
    tmp_path: Path, blocking_reads: _BlockingReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two blocked reads fill the limit (charged to no pod); past it the pod gets one more read,
    # which blocks too; its fourth process is answered unknown without a read of its stat.
    monkeypatch.setattr(procfs, "BLOCKED_PROBES_LIMIT", 2)
    for pid in (901, 902, 903, 904):
        write_proc(tmp_path, pid, 7, POD_LINE)
    blocking_reads.pids = {901, 902, 903, 904}
    resolver = ProcfsProcessResolver(tmp_path)

    with capture_logs() as logs:
        got = [_answer_within(resolver, pid) for pid in (901, 902, 903, 904)]

    assert [a.reason for a in got] == [BLOCKED_REASON] * 4
    assert (903, "cgroup") in blocking_reads.asked  # whose it is: read past the limit only
    assert (901, "cgroup") not in blocking_reads.asked
    assert (904, "stat") not in blocking_reads.asked  # no fourth helper thread left waiting
    blocked = [e["pid"] for e in logs if e["event"] == "proc_read_blocked"]
    assert blocked == [901, 902, 903]
    [full] = [e for e in logs if e["event"] == "proc_reads_blocked_limit"]
    assert full["blocked_pids"] == [901, 902, 903]
    resolver.close()


def test_past_the_limit_another_pods_new_process_is_still_attributed(
    tmp_path: Path, blocking_reads: _BlockingReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: once BLOCKED_PROBES_LIMIT reads were blocked, by one pod's stuck processes, every
    # new PID on the node was unknown without a read: every other pod's memory nobody's.
    monkeypatch.setattr(procfs, "BLOCKED_PROBES_LIMIT", 2)
    stuck = [901, 902, 903, 904]
    for pid in stuck:
        write_proc(tmp_path, pid, 7, POD_LINE)
    write_proc(tmp_path, 905, 7, OTHER_POD_LINE)
    write_proc(tmp_path, 906, 7, "0::/system.slice/host-daemon.service\n")
    blocking_reads.pids = set(stuck)
    resolver = ProcfsProcessResolver(tmp_path)

    for pid in stuck:
        assert _answer_within(resolver, pid).reason == BLOCKED_REASON
    other = _answer_within(resolver, 905)
    host = _answer_within(resolver, 906)

    assert other.pod_uid == OTHER_UID
    assert other.identity == ProcessIdentity(pid=905, start_ticks=7)
    assert host.identity == ProcessIdentity(pid=906, start_ticks=7)  # its cgroup is its owner
    assert _answer_within(resolver, 904).reason == BLOCKED_REASON  # still not read
    resolver.close()


def test_past_the_limit_a_pid_whose_cgroup_cannot_be_read_is_not_read_and_a_gone_one_is_a_ghost(
    tmp_path: Path, blocking_reads: _BlockingReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procfs, "BLOCKED_PROBES_LIMIT", 1)
    write_proc(tmp_path, 901, 7, POD_LINE)
    write_proc(tmp_path, 907, 7, None)
    (tmp_path / "907" / "cgroup").symlink_to("/etc/hostname")  # unreadable: never followed
    blocking_reads.pids = {901}
    resolver = ProcfsProcessResolver(tmp_path)

    assert _answer_within(resolver, 901).reason == BLOCKED_REASON
    unreadable = _answer_within(resolver, 907)
    ghost = _answer_within(resolver, 908)

    assert unreadable.reason == BLOCKED_REASON  # no owner to charge: not read
    assert (907, "stat") not in blocking_reads.asked
    assert ghost.reason == GHOST_REASON
    resolver.close()


def test_past_the_cap_nothing_new_is_read_for_any_pod(
    tmp_path: Path, blocking_reads: _BlockingReads, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procfs, "BLOCKED_PROBES_LIMIT", 1)
    monkeypatch.setattr(procfs, "BLOCKED_READS_CAP", 2)
    write_proc(tmp_path, 901, 7, POD_LINE)
    write_proc(tmp_path, 902, 7, OTHER_POD_LINE)
    write_proc(tmp_path, 903, 7, "0::/kubepods/besteffort/pod" + "1" * 32 + "/" + C + "\n")
    blocking_reads.pids = {901, 902, 903}
    resolver = ProcfsProcessResolver(tmp_path)

    with capture_logs() as logs:
        got = [_answer_within(resolver, pid) for pid in (901, 902, 903)]

    assert [a.reason for a in got] == [BLOCKED_REASON] * 3
    assert not any(pid == 903 for pid, _name in blocking_reads.asked)  # not even its cgroup
    [cap] = [e for e in logs if e["event"] == "proc_reads_blocked_cap"]
    assert (cap["cap"], cap["blocked_pids"]) == (2, [901, 902])
    resolver.close()


def _fd_links(root: Path, pid: int, targets: list[str], task: int | None = None) -> None:
    fd = root / str(pid) / ("fd" if task is None else f"task/{task}/fd")
    fd.mkdir(parents=True)
    for n, target in enumerate(targets):
        (fd / str(n)).symlink_to(target)


def test_a_gpu_file_in_another_tasks_table_is_seen_and_tasks_past_the_limit_are_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_proc(tmp_path, 45, 7, POD_LINE)
    _fd_links(tmp_path, 45, ["/dev/null"])
    _fd_links(tmp_path, 45, ["/dev/null"], task=45)
    _fd_links(tmp_path, 45, ["/dev/null", "pipe:[7]"], task=46)
    _fd_links(tmp_path, 45, ["socket:[8]", "/dev/nvidia1"], task=47)

    assert ProcfsProcessResolver(tmp_path, check_gpu_fds=True).attribute(45).holds_gpu is True

    monkeypatch.setattr(procfs, "GPU_CHECK_TASK_LIMIT", 1)
    with capture_logs() as logs:
        got = ProcfsProcessResolver(tmp_path, check_gpu_fds=True).attribute(45)
    assert got.holds_gpu is None
    [named] = [e for e in logs if e["event"] == "gpu_fd_check_incomplete"]
    assert (named["pid"], named["why"], named["pod_uid"]) == (45, "task_limit", UID)


def test_a_gpu_check_past_the_fd_limit_is_unknown_named_once_and_not_read_again_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procfs, "GPU_CHECK_FD_LIMIT", 3)
    write_proc(tmp_path, 46, 7, POD_LINE)
    _fd_links(tmp_path, 46, ["/dev/null"] * 4 + ["/dev/nvidia0"])
    write_proc(tmp_path, 47, 7, POD_LINE)
    _fd_links(tmp_path, 47, ["/dev/null"] * 3)
    resolver = ProcfsProcessResolver(tmp_path, check_gpu_fds=True)

    with capture_logs() as logs:
        first, second = resolver.attribute(46), resolver.attribute(46)
        small = resolver.attribute(47)

    assert first.holds_gpu is None
    assert second.holds_gpu is None
    assert first.pod_uid == UID
    assert small.holds_gpu is False
    named = [e for e in logs if e["event"] == "gpu_fd_check_incomplete"]
    assert [(e["pid"], e["why"], e["fds_read"]) for e in named] == [(46, "fd_limit", 4)]


def test_once_the_budget_is_spent_no_gpu_check_is_made_and_that_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procfs, "PROBE_BUDGET_SECONDS", 0.0)
    write_proc(tmp_path, 48, 7, POD_LINE)
    _fd_links(tmp_path, 48, ["/dev/nvidia0"])
    resolver = ProcfsProcessResolver(tmp_path, check_gpu_fds=True)

    with capture_logs() as logs:
        got = [resolver.attribute(48), resolver.attribute(48)]

    assert [a.holds_gpu for a in got] == [None, None]  # unknown: charged like an open file
    assert [a.pod_uid for a in got] == [UID, UID]
    assert [e["event"] for e in logs] == ["gpu_fd_check_budget_spent"]


def _helpers_started_since(before: set[threading.Thread]) -> set[threading.Thread]:
    """Attribution's helper threads started since ``before`` was taken: those of the resolver
    just made. Other tests' helpers are not counted: a dropped resolver's ends when it is
    collected, a blocked one when its read returns, each at its own time (counting every
    thread by name made this test fail now and then after other tests)."""
    return {t for t in threading.enumerate() if t.name == "gpuguard-proc-reads"} - before


def test_a_closed_or_dropped_resolver_leaves_no_helper_thread() -> None:
    before = set(threading.enumerate())
    closed = ProcfsProcessResolver(Path("/proc"), check_gpu_fds=True)
    closed.attribute(os.getpid())
    [closed_helper] = _helpers_started_since(before)
    closed.close()
    before = set(threading.enumerate())
    dropped = ProcfsProcessResolver(Path("/proc"), check_gpu_fds=True)
    dropped.attribute(os.getpid())
    [dropped_helper] = _helpers_started_since(before)
    del dropped

    for helper in (closed_helper, dropped_helper):
        helper.join(5)
        assert not helper.is_alive(), helper.name
