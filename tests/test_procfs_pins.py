"""``ProcfsProcessResolver(pin_processes=True)`` over real processes and the real ``/proc``: a
process asked for again is answered from its pin while it runs, a process that exits is read
afresh (a ghost), pins are bounded and closed, only final attributions are pinned, and a
``/proc`` of another PID namespace (or a tree someone wrote) is never pinned. The forced-reuse
proof is tests/kernel/test_pin_reuse.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters import procfs
from gpuguard.adapters.procfs import GHOST_REASON, ProcfsProcessResolver, same_pid_namespace


@pytest.fixture(name="sleepers")
def sleepers_fixture() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_running_process_is_answered_from_its_pin_and_an_exited_one_read_afresh(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    resolver = ProcfsProcessResolver(pin_processes=True)
    first = {p.pid: resolver.attribute(p.pid) for p in sleepers}
    assert resolver.pinned == len(sleepers)
    assert all(resolver.attribute(pid) is got for pid, got in first.items())
    gone = sleepers[0]
    gone.kill()
    gone.wait()
    after = resolver.attribute(gone.pid)
    assert after.identity is None
    assert after.reason == GHOST_REASON
    assert resolver.pinned == len(sleepers) - 1
    resolver.close()
    assert resolver.pinned == 0


def test_pins_are_bounded_and_closed(sleepers: list[subprocess.Popen[bytes]]) -> None:
    before = _open_fds()
    resolver = ProcfsProcessResolver(pin_processes=True, cache_size=3)
    for p in sleepers:
        resolver.attribute(p.pid)
    assert resolver.pinned == 3
    assert _open_fds() == before + 3 + 1, "a pidfd a pin, and the epoll watching them"
    resolver.close()
    assert _open_fds() == before


def test_an_exited_process_pin_is_closed_at_the_next_ask_for_any_pid(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    """Soak on b03e320: pins of exited processes stayed open until they were the least
    recently asked, so an enforcer under process churn held a pidfd per process started in
    the last 4096 (1 500 fds at minute 4 and climbing), not per process running."""
    before = _open_fds()
    resolver = ProcfsProcessResolver(pin_processes=True)
    for p in sleepers:
        resolver.attribute(p.pid)
    for gone in sleepers[:2]:
        gone.kill()
        gone.wait()
    resolver.attribute(sleepers[-1].pid)  # a running one, answered from its pin
    assert resolver.pinned == len(sleepers) - 2
    assert _open_fds() == before + len(sleepers) - 2 + 1
    resolver.close()


def test_a_full_pin_set_keeps_its_pins_asked_for_lately(
    sleepers: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """More processes listed than pins: closing the least recently asked pin for each new one
    made a scan in the same order as the last close and reopen a pidfd at every ask (worse than
    no pins). Pins asked for lately are kept and the rest go unpinned, read afresh."""
    opened: list[int] = []
    real_open = procfs._pidfd_open

    def counting_open(pid: int) -> int | None:
        opened.append(pid)
        return real_open(pid)

    monkeypatch.setattr(procfs, "_pidfd_open", counting_open)
    resolver = ProcfsProcessResolver(pin_processes=True, cache_size=3)
    pids = [p.pid for p in sleepers]
    for _scan in range(3):
        got = [resolver.attribute(pid) for pid in pids]
        assert [a.identity.pid if a.identity else None for a in got] == pids
    assert opened == pids[:3], "a pidfd opened for each of the first three only, once"
    assert resolver.pinned == 3
    monkeypatch.setattr(procfs, "PIN_KEPT_SECONDS", 0.0)  # now none was asked for lately
    resolver.attribute(pids[3])
    assert opened == [*pids[:3], pids[3]], "the least recently asked pin made room"
    assert resolver.pinned == 3
    resolver.close()


def test_only_a_process_seen_holding_the_gpu_is_pinned_when_the_gpu_is_checked(
    sleepers: list[subprocess.Popen[bytes]],
) -> None:
    """``holds_gpu`` False may turn True (the process opens the GPU later): read every time."""
    resolver = ProcfsProcessResolver(pin_processes=True, check_gpu_fds=True)
    got = resolver.attribute(sleepers[0].pid)
    assert got.holds_gpu is False
    assert resolver.pinned == 0


def test_no_pin_where_proc_root_is_not_this_pid_namespaces(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    assert same_pid_namespace(Path("/proc"))
    assert not same_pid_namespace(tmp_path)
    resolver = ProcfsProcessResolver(tmp_path, pin_processes=True)
    resolver.attribute(sleepers[0].pid)
    assert resolver.pinned == 0
