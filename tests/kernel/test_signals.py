"""PidfdKiller against the real kernel: real processes in kubepods-like cgroups (v1 and v2).

Every test process records the signals it catches (``<pid> SIGTERM``) in a per-test file via a
handler; SIGKILL cannot be caught, so it is seen in the exit status (``waitpid``) or, for
processes that are not our children, through a pidfd the test holds. The oracle is always
"exactly these processes received exactly these signals; bystanders received nothing".
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpuguard.adapters.killer import CONTAINER_PID, Observation, PidfdKiller, boot_ticks
from gpuguard.adapters.procfs import read_identity
from gpuguard.adapters.readiness import readable
from gpuguard.core.model import (
    ContainerCgroup,
    ProcessIdentity,
    RefusalReason,
    SignalReport,
    StopSignal,
)
from gpuguard.core.stopping import describe_delivery
from rigs.cgroups import (
    CGROUP_MOUNT,
    CgroupTree,
    Driver,
    cgroup_dir,
    fake_container_id,
    node_container,
    require,
    require_kernel,
)
from rigs.cli_run import run_python_json
from rigs.kill_targets import POD_A, POD_B, observed, target_for

pytestmark = pytest.mark.kernel

# A test process: records every SIGTERM it catches as "<pid> SIGTERM" in the record file.
# Modes: exits_on_term (records, exits 0), ignores_term (records, keeps running),
# forks_orphan (forks a child in ignores_term mode, records "<parent> child <cpid>", exits 0),
# leader_with_workers (forks N workers that die with it via PR_SET_PDEATHSIG, exits on TERM).
PROBE = r"""
import ctypes, os, signal, sys
rec, mode = sys.argv[1], sys.argv[2]
def record(text):
    fd = os.open(rec, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{os.getpid()} {text}\n".encode())
    os.close(fd)
def handler(exits):
    def on_term(signum, frame):
        record("SIGTERM")
        if exits:
            os._exit(0)
    return on_term
signal.signal(signal.SIGTERM, handler(mode in ("exits_on_term", "leader_with_workers")))
if mode == "forks_orphan":
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, handler(False))
        record("ready")
        while True:
            signal.pause()
    record(f"child {pid}")
    os._exit(0)
if mode == "leader_with_workers":
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(int(sys.argv[3])):
        pid = os.fork()
        if pid == 0:
            libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: die with the leader
            signal.signal(signal.SIGTERM, handler(False))
            record("ready")
            while True:
                signal.pause()
        record(f"child {pid}")
record("ready")
while True:
    signal.pause()
"""


@dataclass
class Scene:
    """A tree, its record file and every process started, by role."""

    tree: CgroupTree
    record: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pidfds: dict[int, int] = field(default_factory=dict)
    """pid → pidfd the test holds, to see exits of processes that are not our children."""

    def start(self, role: str, cg: ContainerCgroup, mode: str, *extra: str) -> int:
        proc = self.tree.spawn(
            [sys.executable, "-c", PROBE, str(self.record), mode, *extra], cgroups=[cg]
        )
        self.procs[role] = proc
        self.hold(proc.pid)
        return proc.pid

    def start_ready(self, role: str, cg: ContainerCgroup, mode: str) -> ProcessIdentity:
        """``start`` one process, wait until it is ready, and read its identity."""
        pid = self.start(role, cg, mode)
        self.wait_ready([pid])
        identity = read_identity(Path("/proc"), pid)
        assert identity is not None
        return identity

    def hold(self, pid: int) -> None:
        self.pidfds[pid] = os.pidfd_open(pid)

    def lines(self) -> list[tuple[int, str]]:
        if not self.record.exists():
            return []
        out = []
        for line in self.record.read_text().splitlines():
            pid, text = line.split(" ", 1)
            out.append((int(pid), text))
        return out

    def wait_ready(self, pids: list[int], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ready = {pid for pid, text in self.lines() if text == "ready"}
            if set(pids) <= ready:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready: {set(pids) - ready}")
            time.sleep(0.01)

    def children_of(self, pid: int) -> list[int]:
        return [int(t.split()[1]) for p, t in self.lines() if p == pid and t.startswith("child ")]

    def wait_children(self, pid: int, n: int, timeout: float = 10.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while len(kids := self.children_of(pid)) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pid} forked {kids}, expected {n}")
            time.sleep(0.01)
        return kids

    def caught(self) -> dict[int, list[str]]:
        got: dict[int, list[str]] = {}
        for pid, text in self.lines():
            if text.startswith("SIG"):
                got.setdefault(pid, []).append(text)
        return got

    def wait_caught(self, expected: dict[int, list[str]], timeout: float = 5.0) -> None:
        """Wait until the processes have recorded exactly the signals in ``expected``."""
        deadline = time.monotonic() + timeout
        while self.caught() != expected:
            assert time.monotonic() < deadline, self.caught()
            time.sleep(0.01)

    def exited(self, pid: int, timeout: float = 0.0) -> bool:
        """The process behind the held pidfd has terminated (zombie or reaped)."""
        ready = readable([self.pidfds[pid]], timeout)
        return bool(ready)

    def close(self) -> None:
        for fd in self.pidfds.values():
            os.close(fd)
        self.pidfds.clear()


@pytest.fixture
def scene(cgroup_tree: CgroupTree, tmp_path: Path) -> Iterator[Scene]:
    s = Scene(tree=cgroup_tree, record=tmp_path / "signals.log")
    try:
        yield s
    finally:
        s.close()


def v2_container(tree: CgroupTree, n: int) -> ContainerCgroup:
    """Pod A's container ``n`` in the benchmarks' node layout (``rigs.cgroups.node_container``:
    cgroup v2, systemd driver, Burstable, containerd)."""
    return node_container(tree, pod_uid=POD_A, container_id=fake_container_id(n))


def assert_refused_as_changed_and_untouched(scene: Scene, report: SignalReport) -> None:
    """The one member was refused as another process (``IDENTITY_CHANGED``), nothing was
    delivered, and no process recorded a signal a moment later."""
    assert [r.reason for r in report.refused] == [RefusalReason.IDENTITY_CHANGED]
    assert report.delivered == ()
    time.sleep(0.1)
    assert scene.caught() == {}


def killer(*, use_cgroup_kill: bool = False) -> PidfdKiller:
    return PidfdKiller(
        cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"), use_cgroup_kill=use_cgroup_kill
    )


LAYOUTS = [
    pytest.param(2, "systemd", "", id="v2-systemd-containerd"),
    pytest.param(1, "cgroupfs", "pids", id="v1-cgroupfs-pids"),
    pytest.param(1, "systemd", "name=systemd", id="v1-systemd-name=systemd"),
]


@pytest.mark.parametrize(("version", "driver", "hierarchy"), LAYOUTS)
def test_term_then_kill_reaches_exactly_the_container_and_never_a_bystander(
    scene: Scene, version: int, driver: Driver, hierarchy: str
) -> None:
    if hierarchy == "name=systemd":
        require_kernel(((1, "name=systemd"),))
    tree = scene.tree
    cid, sibling_cid, other_cid = (fake_container_id(n) for n in (1, 2, 3))

    def container(pod: str, c: str) -> ContainerCgroup:
        return tree.container(
            version=version,
            driver=driver,
            qos="burstable",
            pod_uid=pod,
            runtime="containerd",
            container_id=c,
            hierarchy=hierarchy or "pids",
        )

    target_cg = container(POD_A, cid)
    sub_cg = tree.child(target_cg, "container")  # crun's subgroup / nested runtime
    sibling_cg = container(POD_A, sibling_cid)
    other_pod_cg = container(POD_B, other_cid)
    pod_cg = ContainerCgroup(
        version=version, hierarchy=target_cg.hierarchy, path=target_cg.path.rsplit("/", 1)[0]
    )
    host_cg = tree.make(version, "system.slice/host.service", hierarchy or "pids")

    polite = scene.start("polite", target_cg, "exits_on_term")
    stubborn = scene.start("stubborn", target_cg, "ignores_term")
    nested = scene.start("nested", sub_cg, "exits_on_term")
    forker = scene.start("forker", target_cg, "forks_orphan")
    bystanders = {
        "sibling": scene.start("sibling", sibling_cg, "exits_on_term"),
        "pod_level": scene.start("pod_level", pod_cg, "exits_on_term"),
        "other_pod": scene.start("other_pod", other_pod_cg, "exits_on_term"),
        "host": scene.start("host", host_cg, "exits_on_term"),
    }
    [orphan] = scene.wait_children(forker, 1)
    scene.hold(orphan)
    assert scene.procs["forker"].wait(timeout=10) == 0  # the parent is gone, its child lives on
    scene.wait_ready([polite, stubborn, nested, orphan, *bystanders.values()])
    assert tree.is_member(orphan, target_cg)

    target = target_for(target_cg, cid)
    term = killer().signal_container(target, StopSignal.TERM, wait_seconds=2.0)

    assert {i.pid for i in term.delivered} == {polite, stubborn, nested, orphan}
    assert {i.pid for i in term.survivors} == {stubborn, orphan}
    assert term.refused == ()
    assert term.already_gone == ()
    assert scene.procs["polite"].wait(timeout=5) == 0
    assert scene.procs["nested"].wait(timeout=5) == 0

    kill = killer().signal_container(target, StopSignal.KILL, wait_seconds=5.0)

    assert {i.pid for i in kill.delivered} == {stubborn, orphan}
    assert kill.survivors == ()
    assert kill.refused == ()
    assert scene.procs["stubborn"].wait(timeout=5) == -9
    assert scene.exited(orphan, timeout=5)
    assert scene.caught() == {
        polite: ["SIGTERM"],
        stubborn: ["SIGTERM"],
        nested: ["SIGTERM"],
        orphan: ["SIGTERM"],
    }
    for role, pid in bystanders.items():
        assert scene.procs[role].poll() is None, f"bystander {role} died"
        assert not scene.exited(pid), role


def test_a_member_moved_out_between_enumeration_and_signal_is_refused(scene: Scene) -> None:
    tree = scene.tree
    target_cg = tree.container(
        version=2,
        driver="systemd",
        qos="besteffort",
        pod_uid=POD_A,
        runtime="containerd",
        container_id=fake_container_id(1),
    )
    elsewhere = tree.make(2, "system.slice/elsewhere.service")
    victim = scene.start("victim", target_cg, "exits_on_term")
    scene.wait_ready([victim])
    k = killer()
    directory = k.container_dir(target_cg)
    assert isinstance(directory, Path)
    assert k.members(directory) == (victim,)  # enumeration
    identity = read_identity(Path("/proc"), victim)
    assert identity is not None

    tree.move(victim, elsewhere)  # ... it leaves the container before the signal
    report = k.signal_members([observed(identity)], target_for(target_cg), StopSignal.KILL)

    assert report.delivered == ()
    [refusal] = report.refused
    assert refusal.pid == victim
    assert refusal.reason is RefusalReason.IDENTITY_CHANGED
    assert "elsewhere.service" in refusal.detail
    time.sleep(0.1)
    assert scene.procs["victim"].poll() is None
    assert scene.caught() == {}


def test_a_cgroup_whose_name_merely_starts_with_the_containers_is_not_the_container(
    scene: Scene,
) -> None:
    target_cg = scene.tree.make(2, "kubepods/poda/" + fake_container_id(1))
    lookalike = scene.tree.make(2, "kubepods/poda/" + fake_container_id(1) + "-evil")
    identity = scene.start_ready("p", lookalike, "exits_on_term")

    report = killer().signal_members([observed(identity)], target_for(target_cg), StopSignal.TERM)

    assert_refused_as_changed_and_untouched(scene, report)


def test_a_member_whose_starttime_changed_is_refused(scene: Scene) -> None:
    cg = scene.tree.make(2, "kubepods/podx/ctr")
    identity = scene.start_ready("p", cg, "exits_on_term")
    stale = ProcessIdentity(pid=identity.pid, start_ticks=identity.start_ticks - 1)

    report = killer().signal_members([observed(stale)], target_for(cg), StopSignal.TERM)

    assert_refused_as_changed_and_untouched(scene, report)


def test_a_process_that_exits_mid_kill_is_already_gone_not_an_error(scene: Scene) -> None:
    """The leader exits on SIGTERM and the kernel kills its workers with it (PDEATHSIG), so
    workers enumerated after the leader may be gone before their turn; a TERM-ignoring sibling
    holds. Whatever the interleaving, every member is accounted for exactly once."""
    cg = scene.tree.container(
        version=2,
        driver="cgroupfs",
        qos="guaranteed",
        pod_uid=POD_A,
        runtime="containerd",
        container_id=fake_container_id(7),
    )
    holder = scene.start("holder", cg, "ignores_term")
    leader = scene.start("leader", cg, "leader_with_workers", "6")
    workers = scene.wait_children(leader, 6)
    for w in workers:
        scene.hold(w)
    scene.wait_ready([holder, leader, *workers])

    report = killer().signal_container(target_for(cg), StopSignal.TERM, wait_seconds=2.0)

    accounted = [i.pid for i in report.delivered] + list(report.already_gone)
    assert sorted(accounted) == sorted([holder, leader, *workers])
    assert report.refused == ()
    assert [i.pid for i in report.survivors] == [holder]
    assert scene.procs["leader"].wait(timeout=5) == 0
    for w in workers:
        assert scene.exited(w, timeout=5)
    caught = scene.caught()
    assert caught[holder] == ["SIGTERM"]
    assert caught[leader] == ["SIGTERM"]
    # A worker caught SIGTERM only if it was delivered one (it was alive at its turn).
    delivered = {i.pid for i in report.delivered}
    assert {p for p in caught if p in workers} <= delivered


def test_an_identity_observed_in_its_first_clock_tick_is_refused_as_ambiguous(
    scene: Scene,
) -> None:
    cg = scene.tree.make(2, "kubepods/podt/ctr")
    identity = scene.start_ready("p", cg, "ignores_term")
    pid = identity.pid
    k = killer()

    same_tick = k.signal_members(
        [Observation(identity=identity, observed_at_ticks=identity.start_ticks)],
        target_for(cg),
        StopSignal.TERM,
    )
    later = k.signal_members([observed(identity)], target_for(cg), StopSignal.TERM)

    assert [r.reason for r in same_tick.refused] == [RefusalReason.IDENTITY_CHANGED]
    assert "clock tick" in same_tick.refused[0].detail
    assert later.delivered == (identity,)
    scene.wait_caught({pid: ["SIGTERM"]})


def test_signal_container_refuses_a_member_whose_identity_it_reads_in_the_members_first_tick(
    scene: Scene,
) -> None:
    """The production path stamps every observation: a member whose identity is read in the
    clock tick it started in (here the tick source stays in that tick) could be a same-tick
    successor of the process that had its PID, so it is refused, never signalled; the other
    members still are."""
    cg = scene.tree.make(2, "kubepods/podu/ctr")
    older_identity = scene.start_ready("older", cg, "ignores_term")
    older = older_identity.pid
    while boot_ticks() <= older_identity.start_ticks:
        time.sleep(0.002)
    young_identity = scene.start_ready("young", cg, "ignores_term")
    young = young_identity.pid
    in_young_first_tick = young_identity.start_ticks
    k = PidfdKiller(
        cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"), ticks=lambda: in_young_first_tick
    )

    report = k.signal_container(target_for(cg), StopSignal.TERM)

    assert report.delivered == (older_identity,)
    [refusal] = report.refused
    assert (refusal.pid, refusal.reason) == (young, RefusalReason.IDENTITY_CHANGED)
    assert "clock tick" in refusal.detail
    scene.wait_caught({older: ["SIGTERM"]})
    time.sleep(0.1)
    assert scene.caught() == {older: ["SIGTERM"]}


def test_a_member_read_in_its_first_tick_is_read_again_after_it_and_signalled(
    scene: Scene,
) -> None:
    """A process forked a moment ago is a member like any other: its first reading falls in
    its start tick, the killer reads it again once that tick is over, and signals it."""
    cg = scene.tree.make(2, "kubepods/podv/ctr")
    identity = scene.start_ready("p", cg, "ignores_term")
    pid = identity.pid
    stamps = [identity.start_ticks]  # the first reading: in its start tick

    def ticks() -> int:
        return stamps.pop() if stamps else boot_ticks()

    k = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=Path("/proc"), ticks=ticks)

    report = k.signal_container(target_for(cg), StopSignal.TERM)

    assert report.delivered == (identity,)
    assert report.refused == ()
    assert stamps == []
    scene.wait_caught({pid: ["SIGTERM"]})


def test_gpuguard_never_signals_itself(scene: Scene) -> None:
    cg = scene.tree.make(2, "kubepods/pods/ctr")
    me = read_identity(Path("/proc"), os.getpid())
    assert me is not None

    report = killer().signal_members([observed(me)], target_for(cg), StopSignal.KILL)

    assert [r.reason for r in report.refused] == [RefusalReason.EXEMPT]
    assert report.delivered == ()


def test_an_exited_and_reaped_process_is_already_gone(scene: Scene) -> None:
    cg = scene.tree.make(2, "kubepods/pody/ctr")
    identity = scene.start_ready("p", cg, "exits_on_term")
    pid = identity.pid
    scene.procs["p"].kill()
    scene.procs["p"].wait(timeout=5)

    report = killer().signal_members([observed(identity)], target_for(cg), StopSignal.KILL)

    assert report.already_gone == (pid,)
    assert report.delivered == ()
    assert report.refused == ()


def test_cgroup_kill_stops_the_whole_v2_container_and_nothing_else(scene: Scene) -> None:
    tree = scene.tree
    cg = v2_container(tree, 1)
    sub = tree.child(cg, "container")
    sibling = v2_container(tree, 2)
    a = scene.start("a", cg, "ignores_term")
    b = scene.start("b", sub, "ignores_term")
    by = scene.start("bystander", sibling, "ignores_term")
    scene.wait_ready([a, b, by])

    report = killer(use_cgroup_kill=True).signal_container(
        target_for(cg), StopSignal.KILL, wait_seconds=5.0
    )

    assert {i.pid for i in report.delivered} == {a, b}
    assert report.survivors == ()
    assert report.refused == ()
    assert scene.procs["a"].wait(timeout=5) == -9
    assert scene.procs["b"].wait(timeout=5) == -9
    assert scene.procs["bystander"].poll() is None
    assert scene.caught() == {}


def test_a_gone_container_cgroup_is_an_empty_report(scene: Scene) -> None:
    cg = scene.tree.make(2, "kubepods/podz")
    gone = ContainerCgroup(version=2, hierarchy="", path=cg.path + "/" + "d" * 64)

    report = killer().signal_container(target_for(gone), StopSignal.KILL)

    assert report.delivered == ()
    assert report.survivors == ()
    assert report.refused == ()
    assert report.already_gone == ()


@pytest.mark.parametrize(
    ("cgroup", "says"),
    [
        pytest.param(
            ContainerCgroup(version=2, hierarchy="", path="/../../kubepods.slice/x.scope"),
            "'..'",
            id="relative-to-another-cgroupns",
        ),
        pytest.param(ContainerCgroup(version=2, hierarchy="", path="/"), "root", id="root"),
        pytest.param(ContainerCgroup(version=1, hierarchy="../pids", path="/a"), "hierarchy"),
        pytest.param(ContainerCgroup(version=1, hierarchy="nosuch", path="/a"), "cgroup_root"),
        pytest.param(ContainerCgroup(version=3, hierarchy="", path="/a"), "version"),
    ],
)
def test_unresolvable_container_cgroups_are_refused_with_a_reason(
    cgroup: ContainerCgroup, says: str
) -> None:
    report = killer().signal_container(target_for(cgroup), StopSignal.KILL)

    [refusal] = report.refused
    assert refusal.pid == CONTAINER_PID
    assert refusal.reason is RefusalReason.NO_CONTAINER
    assert says in refusal.detail
    assert report.delivered == ()


# Run as root *without capabilities* (CAP_KILL dropped from the bounding set before exec): it
# may pidfd_open any process but pidfd_send_signal to another uid's process is EPERM (matrix A9).
UNPRIVILEGED_SIGNALLER = r"""
import json, sys
from pathlib import Path
from gpuguard.adapters.killer import PidfdKiller
from gpuguard.core.model import ContainerCgroup, ProcessIdentity, StopSignal
from rigs.kill_targets import observed, target_for
pid, start, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
k = PidfdKiller(cgroup_root=Path("/sys/fs/cgroup"), proc_root=Path("/proc"))
cg = ContainerCgroup(version=2, hierarchy="", path=path)
me = observed(ProcessIdentity(pid=pid, start_ticks=start))
r = k.signal_members([me], target_for(cg), StopSignal.KILL)
print(json.dumps({"delivered": [i.pid for i in r.delivered],
                  "refused": [[x.pid, str(x.reason), x.detail] for x in r.refused]}))
"""


def test_permission_denied_is_a_refusal_with_the_errno_text(scene: Scene) -> None:
    require(Path("/usr/bin/setpriv").exists(), "setpriv (util-linux) not installed")
    cg = scene.tree.make(2, "kubepods/podp/ctr")
    victim = scene.tree.spawn(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "sleep", "60"],
        cgroups=[cg],
    )
    deadline = time.monotonic() + 5
    while Path(f"/proc/{victim.pid}/status").read_text().find("Uid:\t1000") < 0:
        assert time.monotonic() < deadline, "victim never became uid 1000"
        time.sleep(0.01)
    identity = read_identity(Path("/proc"), victim.pid)
    assert identity is not None
    result = run_python_json(
        "-c",
        UNPRIVILEGED_SIGNALLER,
        str(victim.pid),
        str(identity.start_ticks),
        cg.path,
        wrapper=["setpriv", "--inh-caps=-all", "--bounding-set=-all"],
    )

    assert result["delivered"] == []
    [[rpid, reason, detail]] = result["refused"]
    assert (rpid, reason) == (victim.pid, "permission_denied")
    assert "Operation not permitted" in detail
    time.sleep(0.1)
    assert victim.poll() is None


def _deep_chain(base: Path, depth: int, name_len: int) -> list[str]:
    """Create ``depth`` nested cgroups below ``base`` with fd-relative mkdir (the full path is
    far past PATH_MAX, so no path-based call could). Returns the component names."""
    names = [f"{i:03d}" + "d" * (name_len - 3) for i in range(depth)]
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    fds = [fd]
    try:
        for name in names:
            os.mkdir(name, dir_fd=fds[-1])
            fds.append(os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fds[-1]))
    finally:
        for f in fds:
            os.close(f)
    return names


def _deep_fd(base: Path, names: list[str]) -> int:
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    for name in names:
        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    return fd


def _remove_deep_chain(base: Path, names: list[str]) -> None:
    for depth in range(len(names), 0, -1):
        parent = _deep_fd(base, names[: depth - 1])
        try:
            for _ in range(200):
                try:
                    os.rmdir(names[depth - 1], dir_fd=parent)
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the kernel finishes an exit
                    time.sleep(0.02)
        finally:
            os.close(parent)


def test_a_container_nested_deeper_than_path_max_is_still_stopped(scene: Scene) -> None:
    """The old defect: a process in a cgroup whose path exceeds PATH_MAX (4096) was out of
    reach: members() raised ENAMETOOLONG and nobody was signalled."""
    cg = v2_container(scene.tree, 7)
    base = cgroup_dir(cg)
    names = _deep_chain(base, depth=24, name_len=200)  # ~4.8 KB below the container
    try:
        shallow = scene.start("shallow", cg, "ignores_term")
        deep = scene.start("deep", cg, "ignores_term")
        dir_fd = _deep_fd(base, names)
        try:
            procs = os.open("cgroup.procs", os.O_WRONLY, dir_fd=dir_fd)
            try:
                os.write(procs, f"{deep}\n".encode())
            finally:
                os.close(procs)
        finally:
            os.close(dir_fd)
        scene.wait_ready([shallow, deep])
        assert not scene.tree.is_member(deep, cg)  # it lives ~4.8 KB below the container

        report = killer().signal_container(target_for(cg), StopSignal.KILL, wait_seconds=5.0)

        assert {i.pid for i in report.delivered} == {shallow, deep}
        assert report.refused == ()
        assert scene.procs["deep"].wait(timeout=5) == -9
    finally:
        for proc in scene.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)
        _remove_deep_chain(base, names)


def test_a_container_whose_members_cannot_be_listed_is_a_counted_refusal(scene: Scene) -> None:
    """Any failure to enumerate a container is a refusal with a reason (counted in metrics),
    never an exception that only reaches a log line."""
    cg = v2_container(scene.tree, 8)
    victim = scene.start("victim", cg, "ignores_term")
    scene.wait_ready([victim])
    base = cgroup_dir(cg)
    os.mkdir(base / "loop")
    try:
        # A real EMFILE mid-walk: this process's file descriptors are exhausted but for one.
        held: list[int] = []
        try:
            while True:
                try:
                    held.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            os.close(held.pop())  # room for the root directory only
            report = killer().signal_container(target_for(cg), StopSignal.TERM)
        finally:
            for fd in held:
                os.close(fd)
    finally:
        os.rmdir(base / "loop")

    assert report.delivered == ()
    [refusal] = report.refused
    assert refusal.pid == CONTAINER_PID
    assert refusal.reason is RefusalReason.SIGNAL_FAILED
    assert "cannot list the members" in refusal.detail


def test_a_member_whose_proc_entry_cannot_be_read_is_refused_and_the_rest_are_signalled(
    scene: Scene, tmp_path: Path
) -> None:
    """An unreadable ``/proc/<pid>`` entry (here a FIFO where ``stat`` should be, in a copied
    proc root) is a refusal for that member, never an exception that leaves the others
    unsignalled."""
    cg = v2_container(scene.tree, 9)
    readable = scene.start("readable", cg, "ignores_term")
    unreadable = scene.start("unreadable", cg, "ignores_term")
    scene.wait_ready([readable, unreadable])
    proc_root = tmp_path / "proc"
    for pid in (readable, unreadable):
        (proc_root / str(pid)).mkdir(parents=True)
        (proc_root / str(pid) / "cgroup").write_bytes(Path(f"/proc/{pid}/cgroup").read_bytes())
    (proc_root / str(readable) / "stat").write_bytes(Path(f"/proc/{readable}/stat").read_bytes())
    os.mkfifo(proc_root / str(unreadable) / "stat")

    k = PidfdKiller(cgroup_root=CGROUP_MOUNT, proc_root=proc_root)
    report = k.signal_container(target_for(cg), StopSignal.TERM, wait_seconds=0.0)

    assert [i.pid for i in report.delivered] == [readable]
    [refusal] = report.refused
    assert (refusal.pid, refusal.reason) == (unreadable, RefusalReason.SIGNAL_FAILED)
    deadline = time.monotonic() + 5
    while (readable, "SIGTERM") not in scene.lines():
        assert time.monotonic() < deadline, "the readable member never got SIGTERM"
        time.sleep(0.01)
    assert (unreadable, "SIGTERM") not in scene.lines()


# ---------------------------------------------------------------------------------------------
# Signals that land: a container's PID 1 is its PID namespace's init, and the kernel
# drops a SIGTERM it has no handler for, from the host too. Each process below runs as a
# container's does: PID 1 of a new PID namespace (``CgroupTree.spawn_init``), alone in the
# container's cgroup with what it forks. It records as "<role> <what>" (inside, every PID 1 is 1).

NS_PROBE = r"""
import os, signal, sys, time
rec, role, mode = sys.argv[1], sys.argv[2], sys.argv[3]
def record(text):
    fd = os.open(rec, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{role} {text}\n".encode())
    os.close(fd)
def on_term(signum, frame):
    record("SIGTERM")
    if mode == "catches_exits":
        os._exit(0)
if mode in ("catches", "catches_exits"):
    signal.signal(signal.SIGTERM, on_term)
elif mode == "ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif mode == "bare_with_child":
    if os.fork() == 0:
        role += "-child"  # no handler either: the default action ends it
record(f"ready {os.getpid()}")
while True:
    time.sleep(3600)
"""


def ns_lines(scene: Scene) -> list[tuple[str, str]]:
    if not scene.record.exists():
        return []
    return [
        (role, text)
        for role, _, text in (line.partition(" ") for line in scene.record.read_text().split("\n"))
        if role
    ]


def ns_wait(scene: Scene, want: tuple[str, str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(r == want[0] and t.startswith(want[1]) for r, t in ns_lines(scene)):
        assert time.monotonic() < deadline, f"no {want} in {ns_lines(scene)}"
        time.sleep(0.01)


def start_pid1(scene: Scene, cg: ContainerCgroup, argv: list[str]) -> int:
    """``argv`` as PID 1 of a new PID namespace in ``cg``; its host PID, held by a pidfd."""
    require(shutil.which("unshare") is not None, "unshare (util-linux) not installed")
    _launcher, init = scene.tree.spawn_init(argv, cgroups=[cg])
    scene.hold(init)
    status = Path(f"/proc/{init}/status").read_text()
    [nspid] = [line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")]
    assert nspid[-1] == "1", nspid  # PID 1 of its own namespace, as a container's entrypoint
    return init


def probe(scene: Scene, role: str, mode: str) -> list[str]:
    return [sys.executable, "-c", NS_PROBE, str(scene.record), role, mode]


def others(cg: ContainerCgroup, init: int) -> list[int]:
    return [p for p in CgroupTree.members(cg) if p != init]


@pytest.mark.parametrize(("version", "driver", "hierarchy"), LAYOUTS[:2])
def test_a_pid_1_without_a_sigterm_handler_gets_sigkill_at_the_sigterm_step(
    scene: Scene, version: int, driver: Driver, hierarchy: str
) -> None:
    """(a) ``python train.py`` as the container's PID 1 (no SIGTERM handler) and a worker it
    forked: SIGTERM would be dropped by the init and nothing in the container catches it, so
    the init gets SIGKILL at once (no termination timeout) and the worker SIGTERM, which ends
    it. Before the SIGTERM-step rule (``core.stopping``) both got SIGTERM and the init lived on
    until the SIGKILL step."""
    cg = scene.tree.container(
        version=version,
        driver=driver,
        qos="burstable",
        pod_uid=POD_A,
        runtime="containerd",
        container_id=fake_container_id(21),
        hierarchy=hierarchy or "pids",
    )
    init = start_pid1(scene, cg, probe(scene, "train", "bare_with_child"))
    ns_wait(scene, ("train", "ready"))
    ns_wait(scene, ("train-child", "ready"))
    [child] = others(cg, init)
    scene.hold(child)

    report = killer().signal_container(target_for(cg), StopSignal.TERM, wait_seconds=3.0)

    assert {i.pid for i in report.delivered} == {init, child}
    assert report.refused == ()
    assert report.survivors == ()  # nobody waits for a SIGKILL step
    assert report.signal_of(init) is StopSignal.KILL
    assert report.signal_of(child) is StopSignal.TERM
    [stop] = report.stops
    assert (stop.pid, stop.signal, stop.fate) == (init, StopSignal.KILL, "dropped_by_init")
    assert "PID 1 of its PID namespace with no SIGTERM handler" in stop.detail
    assert "no process of the container catches SIGTERM" in stop.detail
    assert scene.exited(init, timeout=3)
    assert scene.exited(child, timeout=3)
    said = describe_delivery(report)
    assert said.startswith(f"SIGKILL to PID {init} (PID 1 of its PID namespace")
    assert said.endswith(f"and SIGTERM to PID {child}")


def test_a_pid_1_with_a_sigterm_handler_gets_sigterm_and_sigkill_only_at_the_kill_step(
    scene: Scene,
) -> None:
    """(b) A PID 1 that installed a SIGTERM handler gets SIGTERM as before (it may save state
    within the termination timeout), and SIGKILL only at the SIGKILL step if still alive."""
    cg = v2_container(scene.tree, 22)
    init = start_pid1(scene, cg, probe(scene, "trainer", "catches"))
    ns_wait(scene, ("trainer", "ready"))

    term = killer().signal_container(target_for(cg), StopSignal.TERM, wait_seconds=0.5)

    assert [i.pid for i in term.delivered] == [init]
    assert term.stops == ()
    assert term.signal_of(init) is StopSignal.TERM
    assert [i.pid for i in term.survivors] == [init]  # caught it and lives on
    ns_wait(scene, ("trainer", "SIGTERM"))
    assert not scene.exited(init)
    assert describe_delivery(term) == f"SIGTERM to PID {init}"

    kill = killer().signal_container(target_for(cg), StopSignal.KILL, wait_seconds=3.0)

    assert [i.pid for i in kill.delivered] == [init]
    assert kill.stops == ()
    assert kill.survivors == ()
    assert scene.exited(init, timeout=3)


@pytest.mark.parametrize("worker_mode", ["catches_exits", "bare"])
def test_a_shell_pid_1_that_forwards_nothing_never_takes_a_catching_worker_down(
    scene: Scene, worker_mode: str
) -> None:
    """(c) ``sh -c 'python worker.py; …'``: the shell is PID 1, has no SIGTERM handler and
    forwards nothing. gpuguard signals the worker itself. When the worker catches SIGTERM, a
    SIGKILL to the shell would end the whole namespace, the worker without its SIGTERM: so the
    shell gets SIGTERM too (dropped, and said so) and the worker saves and exits; the shell,
    its script over, exits with it. When the worker does not catch it either, nothing would use
    the timeout: the shell gets SIGKILL at once, the worker SIGTERM.

    In "bare" mode the shell's script then blocks (``read`` from a FIFO nobody writes, in the
    shell itself): had it ended, the shell could exit when the worker's SIGTERM ended the
    worker, before its own SIGKILL went out (the killer re-checks every member right before its
    send), and the test skipped its point in about a third of the runs."""
    cg = v2_container(scene.tree, 23)
    worker_argv = " ".join(shlex.quote(a) for a in probe(scene, "worker", worker_mode))
    script = f"{worker_argv}; echo 'sh after-worker' >> {shlex.quote(str(scene.record))}"
    if worker_mode == "bare":
        never_written = scene.record.with_name("sh-blocks.fifo")
        os.mkfifo(never_written)
        script += f"; read _ < {shlex.quote(str(never_written))}"
    init = start_pid1(scene, cg, ["sh", "-c", script])
    ns_wait(scene, ("worker", "ready"))
    [worker] = others(cg, init)
    scene.hold(worker)

    report = killer().signal_container(target_for(cg), StopSignal.TERM, wait_seconds=3.0)

    assert {i.pid for i in report.delivered} == {init, worker}
    assert report.survivors == ()
    assert report.signal_of(worker) is StopSignal.TERM
    [stop] = report.stops
    assert (stop.pid, stop.fate) == (init, "dropped_by_init")
    if worker_mode == "catches_exits":
        assert stop.signal is StopSignal.TERM
        assert f"as PID {worker} catches SIGTERM" in stop.detail
        assert "would end every process of its PID namespace" in stop.detail
        ns_wait(scene, ("worker", "SIGTERM"))
        ns_wait(scene, ("sh", "after-worker"))  # the shell ran on: never SIGKILLed
    else:
        assert stop.signal is StopSignal.KILL
        assert "no process of the container catches SIGTERM" in stop.detail
        assert report.signal_of(init) is StopSignal.KILL
    assert scene.exited(init, timeout=3)
    assert scene.exited(worker, timeout=3)


@pytest.mark.parametrize("beside", [None, "catches"])
def test_a_process_that_ignores_sigterm_gets_sigkill_at_once_unless_another_member_catches_it(
    scene: Scene, beside: str | None
) -> None:
    """(d) Not a PID 1 (no namespace of its own), SIGTERM set to SIG_IGN: the kernel discards
    it. Alone, nothing would use the timeout: SIGKILL at once. Beside a member that catches
    SIGTERM (a supervisor coordinating its workers' shutdown), it waits like the rest and its
    SIGKILL comes at the SIGKILL step."""
    cg = v2_container(scene.tree, 24)
    ignorer = scene.tree.spawn(probe(scene, "ignorer", "ignores"), cgroups=[cg]).pid
    scene.hold(ignorer)
    ns_wait(scene, ("ignorer", "ready"))
    members = {ignorer}
    if beside is not None:
        catcher = scene.tree.spawn(probe(scene, "catcher", beside), cgroups=[cg]).pid
        scene.hold(catcher)
        ns_wait(scene, ("catcher", "ready"))
        members.add(catcher)

    term = killer().signal_container(target_for(cg), StopSignal.TERM, wait_seconds=0.5)

    assert {i.pid for i in term.delivered} == members
    [stop] = term.stops
    assert (stop.pid, stop.fate) == (ignorer, "ignored")
    assert "it ignores SIGTERM" in stop.detail
    if beside is None:
        assert stop.signal is StopSignal.KILL
        assert term.survivors == ()
        assert scene.exited(ignorer, timeout=3)
        return
    assert stop.signal is StopSignal.TERM
    assert f"as PID {catcher} catches SIGTERM" in stop.detail
    assert {i.pid for i in term.survivors} == members
    ns_wait(scene, ("catcher", "SIGTERM"))
    assert not scene.exited(ignorer)

    kill = killer().signal_container(target_for(cg), StopSignal.KILL, wait_seconds=3.0)

    assert {i.pid for i in kill.delivered} == members
    assert kill.survivors == ()
