"""The NVML stand-in's scenario reload: cheap when nothing changed, never late when it did.

A stand-in call that finds its scenario unchanged must cost one read(2) of an inotify queue
and no stat(2) (else benchmarks of gpuguard's fast read measure the stand-in), while a
scenario replaced by rename, rewritten in place, deleted, moved to another directory or
re-pointed by ``NVML_STUB_SCENARIO`` is seen by the very next call that starts after the
change returned, from the same thread, another thread, or a forked child.

Calls go straight through ctypes (the library is loaded by path, so it is the same object
other tests load), or through the real pynvml in a subprocess where syscalls are counted.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rigs.nvml_stub import SCENARIO_ENV, Scenario
from rigs.prereq import require
from tests.nvml_stub.fixtures import (
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.nvml_stub

NVML_ERROR_UNKNOWN = 999


class Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class StubGpu:
    """Device 0 of the stand-in, initialised for the test's lifetime."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        assert self.lib.nvmlInit_v2() == 0
        self.handle = ctypes.c_void_p()
        assert self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)) == 0

    def used(self) -> int | str:
        """Device 0's used bytes from one nvmlDeviceGetMemoryInfo, or the error's number."""
        memory = Memory()
        code = self.lib.nvmlDeviceGetMemoryInfo(self.handle, ctypes.byref(memory))
        return int(memory.used) if code == 0 else f"error {code}"

    def close(self) -> None:
        assert self.lib.nvmlShutdown() == 0


def document(used: int) -> dict[str, object]:
    return {"devices": [{"uuid": "GPU-1", "total_bytes": 1 << 40, "used_bytes": used}]}


@pytest.fixture(name="stub")
def stub_fixture(scenario: Scenario, stub_lib: Path) -> Iterator[StubGpu]:
    scenario.write(document(1))
    gpu = StubGpu(stub_lib)
    yield gpu
    gpu.close()


def test_a_renamed_scenario_is_seen_by_the_next_call(scenario: Scenario, stub: StubGpu) -> None:
    for used in range(2, 202):
        scenario.write(document(used))
        assert stub.used() == used
        assert stub.used() == used


def test_an_in_place_rewrite_and_a_delete_are_seen_by_the_next_call(
    scenario: Scenario, stub: StubGpu
) -> None:
    assert stub.used() == 1
    for used in (22, 333, 4444):  # each a different size: what the stat comparison sees
        scenario.path.write_text(json.dumps(document(used)), encoding="utf-8")
        assert stub.used() == used
    scenario.path.unlink()
    assert stub.used() == f"error {NVML_ERROR_UNKNOWN}"
    scenario.write(document(5))
    assert stub.used() == 5


def test_a_rename_in_one_thread_is_seen_by_the_next_call_in_another(
    scenario: Scenario, stub: StubGpu
) -> None:
    assert stub.used() == 1
    written = threading.Semaphore(0)
    seen: list[int | str] = []

    def reader() -> None:
        for _ in range(2, 202):
            written.acquire()
            seen.append(stub.used())

    thread = threading.Thread(target=reader)
    thread.start()
    for used in range(2, 202):
        scenario.write(document(used))
        written.release()  # the reader's call starts after the rename returned
        while len(seen) < used - 1 and thread.is_alive():
            threading.Event().wait(0.0005)
    thread.join(timeout=30)
    assert seen == list(range(2, 202))


def test_a_scenario_named_elsewhere_is_read_there(
    scenario: Scenario, stub: StubGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML_STUB_SCENARIO is read on every call: the watch follows it, and a file changed while
    it was not watched is still seen when the variable points back."""
    assert stub.used() == 1
    other = Scenario(tmp_path / "elsewhere" / "other.json")
    other.path.parent.mkdir()
    other.write(document(7))
    monkeypatch.setenv(SCENARIO_ENV, str(other.path))
    assert stub.used() == 7
    scenario.write(document(8))
    other.write(document(9))
    assert stub.used() == 9
    monkeypatch.setenv(SCENARIO_ENV, str(scenario.path))
    assert stub.used() == 8


def test_a_replaced_directory_is_watched_again(
    tmp_path: Path, stub_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "scenarios"
    directory.mkdir()
    scenario = Scenario(directory / "scenario.json")
    scenario.write(document(1))
    monkeypatch.setenv(SCENARIO_ENV, str(scenario.path))
    gpu = StubGpu(stub_lib)
    try:
        assert gpu.used() == 1
        directory.rename(tmp_path / "old-scenarios")
        directory.mkdir()
        scenario.write(document(2))
        assert gpu.used() == 2
        scenario.write(document(3))  # into the new directory: its watch must be live
        assert gpu.used() == 3
        shutil.rmtree(directory)
        assert gpu.used() == f"error {NVML_ERROR_UNKNOWN}"
        directory.mkdir()
        scenario.write(document(4))
        assert gpu.used() == 4
        scenario.write(document(5))
        assert gpu.used() == 5
    finally:
        gpu.close()


def test_a_symlinked_scenario_sees_its_target_change(
    tmp_path: Path, stub_lib: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch on the link's directory would miss the target's: such a scenario is stat'ed."""
    (tmp_path / "target").mkdir()
    target = Scenario(tmp_path / "target" / "scenario.json")
    target.write(document(1))
    link = tmp_path / "link.json"
    link.symlink_to(target.path)
    monkeypatch.setenv(SCENARIO_ENV, str(link))
    gpu = StubGpu(stub_lib)
    try:
        assert gpu.used() == 1
        target.write(document(2))
        assert gpu.used() == 2
    finally:
        gpu.close()


FORKED = """
import ctypes, json, os, sys

lib = ctypes.CDLL(sys.argv[1])
path = sys.argv[2]


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def write(used):
    with open(path + ".tmp", "w") as f:
        json.dump({"devices": [{"uuid": "GPU-1", "total_bytes": 1 << 40, "used_bytes": used}]}, f)
    os.replace(path + ".tmp", path)


def used():
    memory = Memory()
    code = lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
    return memory.used if code == 0 else -code


write(1)
assert lib.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == 0
assert used() == 1  # the parent's watch is armed before the fork
to_child, from_parent = os.pipe()[::-1]
to_parent, from_child = os.pipe()[::-1]
pid = os.fork()
me = "child" if pid == 0 else "parent"
inbox, outbox = (from_parent, to_parent) if pid == 0 else (from_child, to_child)
wrong = []
for value in range(2, 102):
    writer = "parent" if value % 2 == 0 else "child"
    if me == writer:
        write(value)
        got = used()
        os.write(outbox, b"w")  # the other side's next call starts after the rename returned
        os.read(inbox, 1)
    else:
        os.read(inbox, 1)
        got = used()
        os.write(outbox, b"r")
    if got != value:
        wrong.append((me, value, got))
os.write(1, f"{me} wrong: {wrong}\\n".encode())  # one write: the two lines do not interleave
if pid == 0:
    os._exit(1 if wrong else 0)
_, status = os.waitpid(pid, 0)
sys.exit(1 if wrong or status != 0 else 0)
"""


def test_parent_and_forked_child_each_see_every_rename(tmp_path: Path, stub_lib: Path) -> None:
    """A child inherits the parent's inotify descriptor; sharing it, each would swallow the
    events the other needs."""
    path = tmp_path / "scenario.json"
    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(stub_lib), str(path)],
        env={**os.environ, SCENARIO_ENV: str(path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("wrong: []") == 2, done.stdout


CALLS = 1000
COUNTED = """
import os, sys
import pynvml

pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 1
try:
    os.stat("/gpuguard-count-from-here")
except FileNotFoundError:
    pass
for _ in range(int(sys.argv[1])):
    pynvml.nvmlDeviceGetMemoryInfo(handle)
try:
    os.stat("/gpuguard-count-to-here")
except FileNotFoundError:
    pass
pynvml.nvmlShutdown()
"""


def syscalls_between_marks(trace: str) -> list[str]:
    """The traced calls between the script's two marker stat()s, one line each."""
    lines = trace.splitlines()
    begin = next(i for i, line in enumerate(lines) if "/gpuguard-count-from-here" in line)
    end = next(i for i, line in enumerate(lines) if "/gpuguard-count-to-here" in line)
    return [line for line in lines[begin + 1 : end] if "(" in line and "+++" not in line]


def test_an_unchanged_scenario_costs_one_read_and_no_stat_per_call(
    scenario: Scenario, stub_lib: Path, tmp_path: Path
) -> None:
    strace = shutil.which("strace")
    require(strace is not None, "needs strace (apt-get install strace)")
    assert strace is not None
    scenario.write(document(1))
    trace = tmp_path / "trace"
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub_lib.parent), SCENARIO_ENV: str(scenario.path)}
    done = subprocess.run(
        [strace, "-f", "-o", str(trace), sys.executable, "-c", COUNTED, str(CALLS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    calls = syscalls_between_marks(trace.read_text(encoding="utf-8"))
    on_scenario = [line for line in calls if str(scenario.path) in line]
    assert on_scenario == [], f"{len(on_scenario)} calls name the scenario: {on_scenario[:3]}"
    assert len(calls) <= CALLS * 1.05, f"{len(calls)} syscalls for {CALLS} calls: {calls[:5]}"
