"""NvmlGpuSource against the real nvidia-ml-py over the C stand-in libnvidia-ml.so.1.

The stand-in is built once per session by ``make -C tests/nvml_stub`` and loaded in-process
through ``library_path`` (pynvml keeps one library per process; the stand-in re-reads its
scenario whenever the file changes, so each test just points the environment variable at its
own file). Cases that need a process where no library was ever loaded run in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource, lib
from gpuguard.adapters.nvml.source import HANDLE_LOST_AFTER
from gpuguard.config import env_var
from gpuguard.core.model import DeviceKey
from gpuguard.errors import GpuSourceError, GpuSourceLost, GpuSourceUnavailable
from rigs.nvml_stub import Scenario
from rigs.prereq import require
from tests.fakes import FakeRecorder
from tests.nvml_stub.fixtures import (
    H200,
    GiB,
    StepClock,
    by_device,
    gpu,
    make_source_fixture,  # noqa: F401 (a fixture)
    mig_gpu,
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_handle_lost,
    stub_init_count,
    stub_lib_fixture,  # noqa: F401 (a fixture)
    uuid,
)

pytestmark = pytest.mark.nvml_stub

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def child() -> Iterator[int]:
    """A real live process whose PID the scenarios list."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def ghost_pid() -> int:
    """A PID that no process has: a reaped child's."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


# ---------------------------------------------------------------------------------------------
# Full GPUs


def test_lists_every_full_gpu_with_its_processes_and_memory(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], child: int
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(0, procs=[{"pid": child, "used_bytes": 3 * GiB}]),
                gpu(1, procs=[{"pid": child, "used_bytes": 1 * GiB}, {"pid": 77, "used_bytes": 5}]),
            ]
        }
    )
    clock = StepClock()
    sample = make_source(clock=clock).sample()

    assert [(d.index, d.uuid, d.total_bytes, d.gpu_instance_id) for d in sample.devices] == [
        (0, uuid(0), H200, None),
        (1, uuid(1), H200, None),
    ]
    assert by_device(sample) == {
        DeviceKey(uuid=uuid(0)): {child: 3 * GiB},
        DeviceKey(uuid=uuid(1)): {child: 1 * GiB, 77: 5},
    }
    assert sample.taken_at == clock.now
    assert sample.skipped == ()


def test_not_available_memory_is_unknown_never_zero(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], child: int
) -> None:
    scenario.write({"devices": [gpu(0, procs=[{"pid": child, "used_bytes": "NA"}])]})
    (proc,) = make_source().sample().processes
    assert proc.pid == child
    assert proc.used_bytes is None


def test_reports_a_pid_that_is_not_in_proc_as_listed(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], ghost_pid: int
) -> None:
    scenario.write({"devices": [gpu(0, procs=[{"pid": ghost_pid, "used_bytes": 2 * GiB}])]})
    (proc,) = make_source().sample().processes
    assert (proc.pid, proc.used_bytes) == (ghost_pid, 2 * GiB)


def test_memory_changes_between_samples_and_seq_strictly_increases(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], child: int
) -> None:
    src = make_source()
    seen: list[tuple[int, int | None]] = []
    for used in (1 * GiB, 5 * GiB, 9 * GiB):
        scenario.write({"devices": [gpu(0, procs=[{"pid": child, "used_bytes": used}])]})
        sample = src.sample()
        seen.append((sample.seq, sample.processes[0].used_bytes))
    assert [u for _, u in seen] == [1 * GiB, 5 * GiB, 9 * GiB]
    seqs = [s for s, _ in seen]
    assert seqs == sorted(set(seqs))


def test_a_process_in_several_lists_is_one_process_with_the_largest_known_value(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], child: int
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(
                    0,
                    procs=[{"pid": child, "used_bytes": "NA"}, {"pid": 50, "used_bytes": 4 * GiB}],
                    graphics_processes=[
                        {"pid": child, "used_bytes": 2 * GiB},
                        {"pid": 50, "used_bytes": 3 * GiB},
                    ],
                )
            ]
        }
    )
    sample = make_source().sample()
    assert sorted((p.pid, p.used_bytes) for p in sample.processes) == sorted(
        [(child, 2 * GiB), (50, 4 * GiB)]
    )


def test_values_above_the_device_total_are_untrusted_and_reported(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(0, total=16 * GiB, procs=[{"pid": 10, "used_bytes": 17 * 10**12}]),
                gpu(
                    1,
                    total=16 * GiB,
                    procs=[
                        {"pid": 11, "used_bytes": 10 * GiB},
                        {"pid": 12, "used_bytes": 10 * GiB},
                    ],
                ),
            ]
        }
    )
    src = make_source()
    sample = src.sample()
    assert {p.pid: p.used_bytes for p in sample.processes} == {10: None, 11: None, 12: None}
    assert sorted((i.reason, i.uuid) for i in sample.issues) == [
        ("memory_above_total", uuid(0)),
        ("memory_sum_above_total", uuid(1)),
    ]


# ---------------------------------------------------------------------------------------------
# MIG


def test_a_mig_gpu_is_split_into_its_gpu_instances_with_their_own_memory(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], child: int
) -> None:
    scenario.write(
        {
            "parent_aggregate_permission": False,
            "devices": [
                gpu(0, procs=[{"pid": 5, "used_bytes": 1}], mig_mode="disabled"),
                mig_gpu(
                    1,
                    [
                        {
                            "slot": 0,
                            "uuid": "MIG-a",
                            "gi": 3,
                            "ci": 0,
                            "total_bytes": 35 * GiB,
                            "processes": [{"pid": child, "used_bytes": 2 * GiB}],
                        },
                        {
                            "slot": 4,
                            "uuid": "MIG-b",
                            "gi": 9,
                            "ci": 1,
                            "total_bytes": 18 * GiB,
                            "processes": [{"pid": 6, "used_bytes": "NA"}],
                        },
                    ],
                ),
            ],
        }
    )
    sample = make_source().sample()

    assert [
        (d.index, d.uuid, d.gpu_instance_id, d.compute_instance_id, d.mig_uuid, d.total_bytes)
        for d in sample.devices
    ] == [
        (0, uuid(0), None, None, None, H200),
        (1, uuid(1), 3, 0, "MIG-a", 35 * GiB),
        (1, uuid(1), 9, 1, "MIG-b", 18 * GiB),
    ]
    assert by_device(sample) == {
        DeviceKey(uuid=uuid(0)): {5: 1},
        DeviceKey(uuid=uuid(1), gpu_instance_id=3): {child: 2 * GiB},
        DeviceKey(uuid=uuid(1), gpu_instance_id=9): {6: None},
    }


def test_compute_instances_of_one_gpu_instance_are_one_enforcement_unit(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    common = {"gi": 2, "total_bytes": 70 * GiB}
    scenario.write(
        {
            "devices": [
                mig_gpu(
                    0,
                    [
                        {
                            **common,
                            "slot": 0,
                            "uuid": "MIG-x",
                            "ci": 0,
                            "processes": [{"pid": 21, "used_bytes": 1 * GiB}],
                        },
                        {
                            **common,
                            "slot": 1,
                            "uuid": "MIG-y",
                            "ci": 1,
                            "processes": [{"pid": 22, "used_bytes": 2 * GiB}],
                        },
                    ],
                )
            ]
        }
    )
    sample = make_source().sample()
    (dev,) = sample.devices
    assert (dev.gpu_instance_id, dev.compute_instance_id, dev.total_bytes) == (2, None, 70 * GiB)
    assert by_device(sample) == {dev.key: {21: 1 * GiB, 22: 2 * GiB}}


def test_mig_instances_are_re_enumerated_after_a_reconfiguration(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    src = make_source()
    scenario.write({"devices": [mig_gpu(0, [{"slot": 0, "gi": 1, "total_bytes": 70 * GiB}])]})
    assert [d.gpu_instance_id for d in src.sample().devices] == [1]
    scenario.write(
        {
            "devices": [
                mig_gpu(
                    0,
                    [
                        {"slot": 0, "gi": 7, "total_bytes": 18 * GiB},
                        {"slot": 1, "gi": 8, "total_bytes": 18 * GiB},
                    ],
                )
            ]
        }
    )
    assert [d.gpu_instance_id for d in src.sample().devices] == [7, 8]
    scenario.write({"devices": [gpu(0, mig_mode="disabled")]})
    assert [(d.gpu_instance_id, d.total_bytes) for d in src.sample().devices] == [(None, H200)]


def test_each_mig_instance_carries_its_profile_and_placement_where_nvml_gives_them(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    """nvmlDeviceGetGpuInstanceById + nvmlGpuInstanceGetInfo: what a DRA share of a dynamic MIG
    device names its instance by. An instance NVML says nothing of (NOT_SUPPORTED: an older
    driver, an unprivileged caller) has none, and that is an answer, not an error; a failing
    call is counted."""
    placed = {"slot": 0, "gi": 3, "uuid": "MIG-a", "total_bytes": 40 * GiB,
              "profile_id": 9, "placement_start": 4, "placement_size": 4}  # fmt: skip
    silent = {"slot": 1, "gi": 5, "uuid": "MIG-b", "total_bytes": 10 * GiB}
    health = FakeRecorder()
    scenario.write({"devices": [mig_gpu(0, [placed, silent])]})
    sample = make_source(health=health).sample()
    assert [(d.gpu_instance_id, d.mig_placement) for d in sample.devices] == [
        (3, (9, 4)),
        (5, None),
    ]
    assert health.nvml_errors == []
    scenario.write(
        {
            "devices": [mig_gpu(0, [placed, silent])],
            "errors": [{"call": "nvmlGpuInstanceGetInfo", "code": "UNKNOWN", "times": -1}],
        }
    )
    again = make_source(health=health).sample()
    assert [d.mig_placement for d in again.devices] == [None, None]
    assert health.nvml_errors == ["nvmlGpuInstanceGetInfo"] * 2  # one per instance


# ---------------------------------------------------------------------------------------------
# MPS


def test_a_device_with_mps_clients_is_flagged_and_its_clients_reported(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(0, procs=[{"pid": 30, "used_bytes": 1 * GiB}]),
                gpu(1, mps_processes=[{"pid": 31, "used_bytes": 2 * GiB}]),
            ]
        }
    )
    sample = make_source().sample()
    assert [d.mps for d in sample.devices] == [False, True]
    assert by_device(sample)[DeviceKey(uuid=uuid(1))] == {31: 2 * GiB}
    assert {p.pid: p.mps_client for p in sample.processes} == {30: False, 31: True}


def test_graphics_and_mps_lists_can_be_left_out_to_save_driver_time(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [
                gpu(
                    0,
                    procs=[{"pid": 30, "used_bytes": 1 * GiB}],
                    graphics_processes=[{"pid": 32, "used_bytes": 1 * GiB}],
                    mps_processes=[{"pid": 31, "used_bytes": 2 * GiB}],
                )
            ]
        }
    )
    full = make_source().sample()
    lean = make_source(graphics_processes=False, mps_processes=False).sample()
    assert sorted(p.pid for p in full.processes) == [30, 31, 32]
    assert full.devices[0].mps
    assert [p.pid for p in lean.processes] == [30]
    assert not lean.devices[0].mps


def test_an_mps_daemon_detected_outside_nvml_flags_its_gpu(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"devices": [gpu(0), gpu(1)]})
    sample = make_source(mps_detector=lambda u: u == uuid(0)).sample()
    assert [d.mps for d in sample.devices] == [True, False]


# ---------------------------------------------------------------------------------------------
# Errors


def test_a_lost_gpu_is_skipped_and_the_others_still_sampled(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    devices = [
        gpu(0, procs=[{"pid": 40, "used_bytes": 1}]),
        gpu(1, procs=[{"pid": 41, "used_bytes": 2}]),
    ]
    scenario.write({"devices": devices})
    src = make_source()
    assert len(src.sample().devices) == 2

    devices[1]["lost"] = True
    scenario.write({"devices": devices})
    sample = src.sample()
    assert [d.index for d in sample.devices] == [0]
    assert [p.pid for p in sample.processes] == [40]
    (skip,) = sample.skipped
    assert (skip.index, skip.uuid) == (1, uuid(1))
    assert skip.reason.startswith("gpu_is_lost")

    devices[1]["lost"] = False
    scenario.write({"devices": devices})
    assert [d.index for d in src.sample().devices] == [0, 1]


def test_a_gpu_lost_before_it_was_ever_read_is_skipped_by_index(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"devices": [gpu(0, lost=True), gpu(1)]})
    sample = make_source().sample()
    assert [d.index for d in sample.devices] == [1]
    (skip,) = sample.skipped
    assert (skip.index, skip.uuid) == (0, None)
    assert skip.reason.startswith("gpu_is_lost")


def test_an_error_after_n_calls_skips_only_that_device_from_then_on(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    # pynvml makes two C calls per non-empty list (count, then fetch): the first sample passes.
    scenario.write(
        {
            "devices": [
                gpu(0, procs=[{"pid": 1, "used_bytes": 1}]),
                gpu(1, procs=[{"pid": 2, "used_bytes": 2}]),
            ],
            "errors": [
                {
                    "call": "nvmlDeviceGetComputeRunningProcesses_v3",
                    "device": 1,
                    "code": "UNKNOWN",
                    "after": 2,
                }
            ],
        }
    )
    src = make_source()
    assert [d.index for d in src.sample().devices] == [0, 1]
    for _ in range(2):
        sample = src.sample()
        assert [d.index for d in sample.devices] == [0]
        assert [(s.index, s.reason.split(":")[0]) for s in sample.skipped] == [(1, "unknown")]


def test_a_not_supported_device_is_skipped_with_its_reason(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0), gpu(1)],
            "errors": [{"call": "nvmlDeviceGetMemoryInfo", "device": 0, "code": "NOT_SUPPORTED"}],
        }
    )
    sample = make_source().sample()
    assert [d.index for d in sample.devices] == [1]
    assert [(s.index, s.reason.split(":")[0]) for s in sample.skipped] == [(0, "not_supported")]


def test_a_list_that_grows_between_count_and_fetch_is_retried_once(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0, procs=[{"pid": 60, "used_bytes": 1}])],
            "errors": [
                {
                    "call": "nvmlDeviceGetComputeRunningProcesses_v3",
                    "code": "INSUFFICIENT_SIZE",
                    "after": 1,
                    "times": 1,
                }
            ],
        }
    )
    src = make_source()
    sample = src.sample()
    assert [p.pid for p in sample.processes] == [60]
    assert [i.reason for i in sample.issues] == ["list_grew"]


def test_falls_back_to_v2_process_calls_when_the_driver_lacks_v3(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0, procs=[{"pid": 61, "used_bytes": 7}])],
            "errors": [
                {"call": "nvmlDeviceGetComputeRunningProcesses_v3", "code": "FUNCTION_NOT_FOUND"}
            ],
        }
    )
    src = make_source()
    for _ in range(2):
        assert [(p.pid, p.used_bytes) for p in src.sample().processes] == [(61, 7)]


def test_an_uninitialized_library_is_re_initialised_next_cycle(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path
) -> None:
    scenario.write(
        {
            "devices": [gpu(0)],
            "errors": [{"call": "nvmlDeviceGetCount_v2", "code": "UNINITIALIZED", "times": 1}],
        }
    )
    src = make_source()
    before = stub_init_count(stub_lib)
    src.acquire()
    with pytest.raises(GpuSourceError, match="uninitialized"):
        src.sample()
    assert stub_init_count(stub_lib) == before
    assert [d.index for d in src.sample().devices] == [0]
    assert stub_init_count(stub_lib) == before + 1


# ---------------------------------------------------------------------------------------------
# A lost handle (reliability N13): every call fails the same way until NVML is re-initialised

_TWO_GPUS = [
    gpu(0, procs=[{"pid": 50, "used_bytes": 1 * GiB}]),
    gpu(1, procs=[{"pid": 51, "used_bytes": 2 * GiB}]),
]
_LOST_WAYS = [
    pytest.param({}, id="every call fails"),
    pytest.param({"except": ["nvmlDeviceGetCount_v2"]}, id="every call on a GPU fails"),
]


def _healthy_source(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path, **kw: Any
) -> NvmlGpuSource:
    scenario.write({"devices": _TWO_GPUS})
    src = make_source(**kw)
    assert len(src.sample().devices) == 2
    # The stand-in restores its handle on a fresh nvmlInit only (NVML counts references).
    assert stub_init_count(stub_lib) == 1, "another NVML init is live in this process"
    return src


def _lose_handle(src: NvmlGpuSource) -> GpuSourceLost:
    """Samples until the source judges the handle lost: the ones before fail as samples do."""
    for _ in range(HANDLE_LOST_AFTER - 1):
        with pytest.raises(GpuSourceError) as failed:
            src.sample()
        assert not isinstance(failed.value, GpuSourceLost), "lost at the first failing sample"
    with pytest.raises(GpuSourceLost) as lost:
        src.sample()
    return lost.value


@pytest.mark.parametrize("way", _LOST_WAYS)
def test_a_handle_on_which_every_call_fails_is_re_initialised_and_sampling_resumes(
    scenario: Scenario,
    make_source: Callable[..., NvmlGpuSource],
    stub_lib: Path,
    way: dict[str, Any],
) -> None:
    """Container toolkit #48/#1227: after `systemctl daemon-reload` every call of a process
    that keeps NVML open answers NVML_ERROR_UNKNOWN. Three samples in a row with every call on
    every GPU failing the same way: the handle is lost, NVML shut down and initialised again at
    the next sample, which reads both GPUs again; no restart."""
    health = FakeRecorder()
    src = _healthy_source(scenario, make_source, stub_lib, clock=StepClock(), health=health)
    scenario.write({"devices": _TWO_GPUS, "handle_lost": {"after": 0, **way}})

    lost = _lose_handle(src)
    assert str(lost).startswith("NVML handle lost: every NVML call on the GPUs failed with unknown")
    assert "systemctl daemon-reload" in str(lost)
    assert "restart this pod" in str(lost)
    assert stub_init_count(stub_lib) == 0, "NVML not shut down"
    assert stub_handle_lost(stub_lib)
    # Each failed call was counted where its data was given up: the count, or one per GPU.
    per_sample = 1 if not way else 2
    assert len(health.nvml_errors) == per_sample * HANDLE_LOST_AFTER
    assert set(health.nvml_errors) <= {
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetHandleByIndex_v2",
    }

    counted = len(health.nvml_errors)
    sample = src.sample()  # the first re-initialisation is not delayed
    assert not stub_handle_lost(stub_lib)
    assert stub_init_count(stub_lib) == 1
    assert by_device(sample) == {
        DeviceKey(uuid=uuid(0)): {50: 1 * GiB},
        DeviceKey(uuid=uuid(1)): {51: 2 * GiB},
    }
    assert sample.skipped == ()
    assert len(src.read_memory()) == 2
    assert health.nvml_errors[counted:] == []


@pytest.mark.parametrize("way", _LOST_WAYS)
def test_fast_reads_on_a_lost_handle_find_it_lost_and_the_next_listing_reads_again(
    scenario: Scenario,
    make_source: Callable[..., NvmlGpuSource],
    stub_lib: Path,
    way: dict[str, Any],
) -> None:
    """The fast path reads memory 20 times a second: failing reads are the operations that
    count there. A read whose every GPU failed returns nothing (its devices get listed next),
    one whose GPU count failed raises, as before; the third makes the handle lost."""
    src = _healthy_source(scenario, make_source, stub_lib, clock=StepClock())
    assert len(src.read_memory()) == 2
    scenario.write({"devices": _TWO_GPUS, "handle_lost": {"after": 0, **way}})
    for _ in range(HANDLE_LOST_AFTER - 1):
        if way:
            assert src.read_memory() == {}
        else:
            with pytest.raises(GpuSourceError, match="nvmlDeviceGetCount_v2 failed: unknown"):
                src.read_memory()
    with pytest.raises(GpuSourceLost):
        src.read_memory()
    assert stub_init_count(stub_lib) == 0

    assert src.read_memory() == {}  # re-initialised: nothing listed yet, so nothing to read
    assert stub_init_count(stub_lib) == 1
    assert [d.index for d in src.sample().devices] == [0, 1]
    assert len(src.read_memory()) == 2


def test_one_gpu_failing_every_call_with_unknown_is_skipped_alone_never_a_lost_handle(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path
) -> None:
    """Reliability N2 stays as it was: the other GPU answers, so NVML's handle works; the
    failing GPU is skipped in every sample and absent from every fast read, and NVML is never
    shut down for it."""
    src = _healthy_source(scenario, make_source, stub_lib, clock=StepClock())
    scenario.write(
        {"devices": _TWO_GPUS, "errors": [{"call": "*", "device": 1, "code": "UNKNOWN"}]}
    )
    for _ in range(3 * HANDLE_LOST_AFTER):
        assert list(src.read_memory()) == [DeviceKey(uuid=uuid(0))]
        sample = src.sample_devices([DeviceKey(uuid=uuid(1))])  # the failing GPU alone
        assert [s.index for s in sample.skipped] == [1]
        sample = src.sample()
        assert [d.index for d in sample.devices] == [0]
        assert [(s.index, s.reason.split(":")[0]) for s in sample.skipped] == [(1, "unknown")]
    assert stub_init_count(stub_lib) == 1


@pytest.mark.parametrize(
    "why",
    ["nvmlInit fails", "the handle breaks again at once"],
)
def test_re_initialising_a_lost_handle_backs_off_exponentially_up_to_the_maximum(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path, why: str
) -> None:
    """While re-initialising does not bring NVML back (nvmlInit itself fails, as in a
    container that lost its device access; or it succeeds and every call fails again), each
    next try waits: at once, then 1, 2, 4, 4 s (init_retry_seconds doubling up to
    init_retry_max_seconds); nothing between tries calls NVML. Once it works, sampling resumes
    and the backoff starts over."""
    clock, health = StepClock(), FakeRecorder()
    src = _healthy_source(
        scenario,
        make_source,
        stub_lib,
        clock=clock,
        health=health,
        init_retry_seconds=1.0,
        init_retry_max_seconds=4.0,
    )
    again = {"after": 0}
    broken = {"devices": _TWO_GPUS, "handle_lost": {**again, "reinit_failures": 5}}
    if why != "nvmlInit fails":
        broken = {"devices": _TWO_GPUS, "handle_lost": again}
    scenario.write(broken)
    _lose_handle(src)
    # A try that fails counts nvmlInitWithFlags; one that succeeds into a broken handle fails
    # the driver version read at init (counted) and then the sample's calls.
    marker = "nvmlInitWithFlags" if why == "nvmlInit fails" else "nvmlSystemGetDriverVersion"
    lost_at, tries = clock.now, []
    while clock.now - lost_at < 15.0:
        if why != "nvmlInit fails":
            scenario.write(broken)  # re-armed: a fresh nvmlInit is followed by a new break
        before = health.nvml_errors.count(marker)
        with pytest.raises(GpuSourceLost):
            src.sample()
        if health.nvml_errors.count(marker) > before:
            tries.append(clock.now - lost_at)
        clock.now += 0.5
    assert tries == [0.0, 1.0, 3.0, 7.0, 11.0]
    assert stub_handle_lost(stub_lib)

    scenario.write({"devices": _TWO_GPUS})  # re-initialising works from now on
    assert [d.index for d in src.sample().devices] == [0, 1]  # 15 s: the next try
    assert not stub_handle_lost(stub_lib)
    assert stub_init_count(stub_lib) == 1

    # Over: a new loss is re-initialised at once again.
    scenario.write({"devices": _TWO_GPUS, "handle_lost": {"after": 0}})
    _lose_handle(src)
    assert [d.index for d in src.sample().devices] == [0, 1]


# ---------------------------------------------------------------------------------------------
# Init failure, release/acquire


def test_init_failure_raises_unavailable(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write({"init_error": "DRIVER_NOT_LOADED", "devices": [gpu(0)]})
    src = make_source()
    with pytest.raises(GpuSourceUnavailable, match="driver_not_loaded"):
        src.acquire()
    with pytest.raises(GpuSourceUnavailable, match="driver_not_loaded"):
        src.sample()  # inside the retry backoff: the same reason, nvmlInit not called again


def test_release_shuts_nvml_down_and_acquire_brings_it_back(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path
) -> None:
    scenario.write({"devices": [gpu(0)]})
    base = stub_init_count(stub_lib)
    src = make_source()
    src.sample()
    assert stub_init_count(stub_lib) == base + 1

    src.release()
    assert stub_init_count(stub_lib) == base
    assert src.released
    with pytest.raises(GpuSourceError, match="released"):
        src.sample()

    src.acquire()
    assert stub_init_count(stub_lib) == base + 1
    assert [d.index for d in src.sample().devices] == [0]


def test_an_explicit_library_path_that_does_not_exist_is_unavailable(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], tmp_path: Path
) -> None:
    src = make_source(library_path=tmp_path / "nope" / "libnvidia-ml.so.1")
    with pytest.raises(GpuSourceUnavailable, match="cannot load NVML library") as raised:
        src.acquire()
    # The message names the setting to fix, in the file's and the environment's spelling.
    assert "nvml.library_path" in str(raised.value)
    assert "GPUGUARD_NVML_LIBRARY_PATH" in str(raised.value)


SUBPROCESS_PROBE = """
import json, sys, time
from pathlib import Path
from gpuguard.adapters.nvml import NullGpuSource, NvmlGpuSource
from gpuguard.errors import GpuSourceUnavailable
lib = Path(sys.argv[2]) if sys.argv[2] else None
src = NvmlGpuSource(library_path=lib)
if sys.argv[1] == "lenient":
    src = NullGpuSource(src, clock=time.monotonic)
try:
    s = src.sample()
except GpuSourceUnavailable as exc:
    print(json.dumps({"raised": str(exc)}))
else:
    print(json.dumps({"devices": [d.uuid for d in s.devices],
                      "skipped": [k.reason for k in s.skipped]}))
    src.close()
"""


def run_probe(mode: str, lib: Path | None, **env: str) -> dict[str, Any]:
    full_env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    full_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_PROBE, mode, str(lib or "")],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        check=False,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_a_missing_library_is_unavailable_or_a_null_source(
    scenario: Scenario, tmp_path: Path
) -> None:
    require(
        subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout.find(
            "libnvidia-ml.so.1"
        )
        < 0,
        "a real libnvidia-ml.so.1 is installed on this machine",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    strict = run_probe("strict", None, LD_LIBRARY_PATH=str(empty))
    assert "library_not_found" in strict["raised"]
    assert "set nvml.library_path (GPUGUARD_NVML_LIBRARY_PATH)" in strict["raised"]
    lenient = run_probe("lenient", None, LD_LIBRARY_PATH=str(empty))
    assert lenient["devices"] == []
    assert "library_not_found" in lenient["skipped"][0]


def test_the_stand_in_loads_through_ld_library_path_and_through_library_path(
    scenario: Scenario, stub_lib: Path
) -> None:
    scenario.write({"devices": [gpu(0)]})
    via_env = run_probe("strict", None, LD_LIBRARY_PATH=str(stub_lib.parent))
    via_path = run_probe("strict", stub_lib)
    assert via_env == via_path == {"devices": [uuid(0)], "skipped": []}


# ---------------------------------------------------------------------------------------------
# Hung calls


def test_a_sample_that_runs_past_its_deadline_is_discarded(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    """The late call is counted once under its C name (gpuguard_nvml_errors_total, see
    tests/test_nvml_health.py), its time is kept, and the next sample is whole."""
    scenario.write(
        {
            "devices": [gpu(0, procs=[{"pid": 70, "used_bytes": 1}])],
            "delays": [{"call": "nvmlDeviceGetComputeRunningProcesses_v3", "ms": 400, "times": 1}],
        }
    )
    health = FakeRecorder()
    src = make_source(deadline_seconds=0.1, health=health)
    with pytest.raises(GpuSourceError, match="deadline"):
        src.sample()
    assert health.nvml_errors == ["nvmlDeviceGetComputeRunningProcesses_v3"]
    timings = src.last_timings
    assert timings is not None
    assert timings.slowest_call == "nvmlDeviceGetComputeRunningProcesses_v3"
    assert timings.slowest_call_seconds >= 0.4
    assert [p.pid for p in src.sample().processes] == [70]
    assert health.nvml_errors == ["nvmlDeviceGetComputeRunningProcesses_v3"]  # counted once


def test_a_gpu_that_keeps_running_late_is_left_out_and_the_others_are_still_sampled(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    """Matrix N9 per device: every call on GPU 1 ran past the deadline, so every sample of the
    node was discarded and an offender on GPU 0 was never stopped (found by
    tests/integration/test_faults.py::test_d_...[hangs]). Late twice in a row, the GPU is left
    out (skipped, with the reason) and tried again after ``SLOW_GPU_RETRY_SECONDS``."""
    from gpuguard.adapters.nvml.source import SLOW_GPU_RETRY_SECONDS

    slow = {"call": "nvmlDeviceGetComputeRunningProcesses_v3", "device": 1, "ms": 300}
    devices = [
        gpu(0, procs=[{"pid": 40, "used_bytes": 1}]),
        gpu(1, procs=[{"pid": 41, "used_bytes": 2}]),
    ]
    scenario.write({"devices": devices, "delays": [slow]})
    clock = StepClock()
    src = make_source(deadline_seconds=0.1, clock=clock)

    def settle() -> None:  # the late call finishes in its thread before the next sample
        deadline = time.monotonic() + 5
        while src.in_flight_seconds is not None and time.monotonic() < deadline:
            time.sleep(0.01)

    for _ in range(2):
        with pytest.raises(GpuSourceError, match="deadline"):
            src.sample()
        settle()
    sample = src.sample()
    assert [p.pid for p in sample.processes] == [40]
    (skip,) = sample.skipped
    assert (skip.index, skip.uuid) == (1, uuid(1))
    assert "deadline" in skip.reason

    clock.now += SLOW_GPU_RETRY_SECONDS + 1  # tried again: still late, left out again at once
    with pytest.raises(GpuSourceError, match="deadline"):
        src.sample()
    settle()
    assert [p.pid for p in src.sample().processes] == [40]

    scenario.write({"devices": devices})  # fixed
    clock.now += SLOW_GPU_RETRY_SECONDS + 1
    assert sorted(p.pid for p in src.sample().processes) == [40, 41]


async def test_a_hung_call_does_not_block_the_loop_or_pile_up_threads(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(
        {
            "devices": [gpu(0, procs=[{"pid": 71, "used_bytes": 1}])],
            "delays": [{"call": "nvmlDeviceGetCount_v2", "ms": 1500, "times": 1}],
        }
    )
    health = FakeRecorder()
    src = make_source(deadline_seconds=0.3, health=health)
    src.acquire()
    hung = asyncio.create_task(asyncio.to_thread(src.sample))
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(hung), timeout=0.1)

        # While the first call is stuck, a new poll fails fast instead of queueing a thread.
        started = time.monotonic()
        with pytest.raises(GpuSourceError, match="still running"):
            await asyncio.to_thread(src.sample)
        assert time.monotonic() - started < 0.75
        # So does the fast memory read (one message for both: NvmlCalls._busy_error).
        with pytest.raises(GpuSourceError, match=r"cannot read memory: .* still running for"):
            await asyncio.to_thread(src.read_memory)
        running = src.in_flight_seconds
        assert running is not None
        assert running > 0

        # When the stuck call finally returns, its late data is discarded, not published.
        with pytest.raises(GpuSourceError, match="deadline"):
            await hung
    finally:
        with contextlib.suppress(GpuSourceError):
            await hung
    assert src.in_flight_seconds is None
    assert health.nvml_errors == ["nvmlDeviceGetCount_v2"]
    sample = await asyncio.to_thread(src.sample)
    assert [p.pid for p in sample.processes] == [71]


def test_the_library_path_setting_named_in_load_failures_is_the_configs_own() -> None:
    assert env_var("nvml", "library_path") == lib.LIBRARY_PATH_SETTING
