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
    assert _open_fds() == before + 3
    resolver.close()
    assert _open_fds() == before


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
