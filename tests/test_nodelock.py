"""The node lock against the real kernel: ``flock(2)`` on a real file, held by this process or
by a real child process that is SIGKILLed (docs/reliability.md R3)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.nodelock import FlockNodeLock
from rigs.cli_run import run_gpuguard
from rigs.nvml_stub import SCENARIO_ENV, Scenario
from tests.helpers.environment import environ_without_gpuguard_settings
from tests.nvml_stub.fixtures import stub_lib_fixture  # noqa: F401 (a fixture)

POD_FILE = Path(__file__).parent / "fixtures" / "pods" / "capped.yaml"

HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
print("locked", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A real process that holds an flock on ``enforcer.lock`` (as another enforcer would)."""
    path = tmp_path / "enforcer.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        yield proc, path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_the_first_holds_and_the_second_is_told_the_first_ones_pid(tmp_path: Path) -> None:
    path = tmp_path / "enforcer.lock"
    first, second = FlockNodeLock(path, pid=4242), FlockNodeLock(path, pid=4343)
    try:
        assert first.hold().held
        waiting = second.hold()
        assert not waiting.held
        assert waiting.holder_pid == 4242
        assert waiting.problem is None
        assert waiting.detail == f"{path} is held by PID 4242"
        assert first.hold().held, "a holder keeps it"
        assert path.read_text() == "4242\n"
    finally:
        first.release()
        second.release()


def test_a_released_lock_is_taken_by_the_next_try(tmp_path: Path) -> None:
    path = tmp_path / "enforcer.lock"
    first, second = FlockNodeLock(path, pid=1), FlockNodeLock(path, pid=2)
    assert first.hold().held
    assert not second.hold().held
    first.release()
    first.release()  # idempotent
    assert second.hold().held
    assert path.exists(), "the file is never deleted: a waiter would lock an orphan"
    second.release()


def test_the_lock_is_free_as_soon_as_its_holder_is_sigkilled(
    holder: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, path = holder
    lock = FlockNodeLock(path)
    try:
        waiting = lock.hold()
        assert (waiting.held, waiting.holder_pid) == (False, proc.pid)
        proc.kill()  # SIGKILL to our own child, by its PID
        proc.wait()
        assert lock.hold().held  # the kernel dropped the lock with the holder's last fd
        assert path.read_text() == f"{os.getpid()}\n"
    finally:
        lock.release()


def test_a_deleted_lock_file_is_locked_again_and_only_one_process_holds_it(
    tmp_path: Path,
) -> None:
    """Someone deletes the holder's file: a waiter creates and locks a new one; the old holder
    notices at its next re-check and stands by instead of acting beside it."""
    path = tmp_path / "enforcer.lock"
    first, second = FlockNodeLock(path, pid=1), FlockNodeLock(path, pid=2)
    try:
        assert first.hold().held
        path.unlink()
        assert second.hold().held
        lost = first.hold()
        assert (lost.held, lost.holder_pid) == (False, 2)
    finally:
        first.release()
        second.release()


def test_a_missing_directory_is_created(tmp_path: Path) -> None:
    path = tmp_path / "run" / "gpuguard" / "enforcer.lock"
    lock = FlockNodeLock(path)
    try:
        assert lock.hold().held
        assert path.parent.is_dir()
    finally:
        lock.release()


def test_a_lock_file_that_cannot_be_opened_is_a_problem_naming_the_path(tmp_path: Path) -> None:
    """Not a crash and not "held": the caller decides (``enforce`` stops at start, with the
    fix). A regular file where the directory should be fails even for root."""
    (tmp_path / "run").write_text("not a directory")
    path = tmp_path / "run" / "gpuguard" / "enforcer.lock"
    state = FlockNodeLock(path).hold()
    assert not state.held
    assert state.problem == "cannot open it (Not a directory)"
    assert state.detail == f"{path}: cannot open it (Not a directory)"


def test_a_symlink_at_the_lock_path_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    path = tmp_path / "enforcer.lock"
    path.symlink_to(target)
    state = FlockNodeLock(path).hold()
    assert not state.held
    assert state.problem is not None
    assert "Too many levels of symbolic links" in state.problem
    assert not target.exists()


@pytest.mark.nvml_stub
def test_enforce_stops_at_start_naming_the_lock_file_and_the_fix(
    stub_lib: Path, tmp_path: Path
) -> None:
    """Running unlocked would let two enforcers on one node both act: a lock file that cannot
    be opened stops ``gpuguard enforce`` at once (exit 1), with the path and what to change."""
    (tmp_path / "run").write_text("not a directory")
    lock_file = tmp_path / "run" / "enforcer.lock"
    scenario = Scenario(tmp_path / "scenario.json")
    scenario.write({"devices": []})
    env = environ_without_gpuguard_settings() | {
        SCENARIO_ENV: str(scenario.path),
        "GPUGUARD_NVML_LIBRARY_PATH": str(stub_lib),
        "GPUGUARD_ENFORCEMENT_LOCK_FILE": str(lock_file),
    }
    argv = ["enforce", "--node-name", "n", "--pods-file", str(POD_FILE)]
    argv += ["--metrics-address", "127.0.0.1:0", "--log-level", "error"]
    done = run_gpuguard(*argv, timeout=60, memory_bytes=None, env=env)
    assert done.returncode == 1, done.stderr
    assert f"enforcement.lock_file {lock_file}: cannot open it (Not a directory)" in done.stderr
    assert "GPUGUARD_ENFORCEMENT_LOCK_FILE" in done.stderr
    assert "Traceback" not in done.stderr
