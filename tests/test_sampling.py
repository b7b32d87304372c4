"""Change-driven sampling: the listing rule (``core.sampling``, tables) and the
sampler over the real nvidia-ml-py and the C stand-in (``runtime.sampling`` with
``NvmlGpuSource``): a device is listed again only when its memory moved by more than the step,
its listing reached the poll interval, its read failed, or ``decide()`` asked for it from a given
time or under pressure (``ListingDue``); every other
device's listing is carried over with its own seq and time, never refreshed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.core.model import DeviceKey, DeviceMemory, GpuSample, Listing, ListingDue
from gpuguard.core.sampling import LastListings, due_for_listing
from gpuguard.runtime.sampling import ChangeDrivenSampler
from rigs.nvml_stub import Scenario
from tests.fakes import gpu as model_gpu
from tests.nvml_stub.fixtures import (
    GiB,
    StepClock,
    by_device,
    gpu,
    make_source_fixture,  # noqa: F401 (a fixture)
    mig_gpu,
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
    uuid,
)

MiB = 2**20
STEP = 64 * MiB

# ---------------------------------------------------------------------------------------------
# The rule, as a table

D0, D1 = model_gpu(0), model_gpu(1)
K0, K1 = D0.key, D1.key


def _last(listed: dict[DeviceKey, float], *, skipped: bool = False) -> LastListings:
    return LastListings.of(_sample(listed, skipped=skipped))


def _sample(listed: dict[DeviceKey, float], *, skipped: bool = False) -> GpuSample:
    from gpuguard.core.model import DeviceSkip

    return GpuSample(
        seq=9,
        taken_at=max(listed.values()),
        devices=(D0, D1),
        processes=(),
        skipped=(DeviceSkip(uuid=None, index=2, reason="GPU_IS_LOST"),) if skipped else (),
        listings={k: Listing(seq=int(at), taken_at=at) for k, at in listed.items()},
    )


def _mem(used: int) -> DeviceMemory:
    return DeviceMemory(total_bytes=80 * GiB, used_bytes=used, free_bytes=80 * GiB - used)


BASE = 10 * GiB
LAST = _last({K0: 100.0, K1: 100.0})


@pytest.mark.parametrize(
    ("last", "memory", "urgent", "now", "due"),
    [
        pytest.param(None, {}, {}, 100.0, None, id="nothing listed yet: everything"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)}, {}, 100.05, frozenset(),
                     id="unchanged, fresh: nothing"),
        pytest.param(LAST, {K0: _mem(BASE + STEP), K1: _mem(BASE)}, {}, 100.05,
                     frozenset(), id="moved by exactly the step: nothing"),
        pytest.param(LAST, {K0: _mem(BASE + STEP + 1), K1: _mem(BASE)}, {}, 100.05,
                     frozenset({K0}), id="grew past the step: that device"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE - 2 * GiB)}, {}, 100.05,
                     frozenset({K1}), id="freed past the step: that device"),
        pytest.param(LAST, {K0: _mem(BASE)}, {}, 100.05, frozenset({K1}),
                     id="read failed: that device"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)}, {K1: ListingDue(at=100.05)},
                     100.05, frozenset({K1}), id="a violation due to move on: that device"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)}, {K1: ListingDue(at=99.0)},
                     100.05, frozenset({K1}), id="a violation overdue: that device"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)}, {K1: ListingDue(at=100.06)},
                     100.05, frozenset(), id="a violation not yet due: nothing"),
        # _mem(BASE) leaves 70 GiB free: a pressure bound above that is pressure.
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)},
                     {K1: ListingDue(at=110.0, free_below_bytes=71 * GiB)}, 100.05,
                     frozenset({K1}), id="a violation pressure can confirm, device pressed"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE)},
                     {K1: ListingDue(at=110.0, free_below_bytes=70 * GiB)}, 100.05,
                     frozenset(), id="a violation pressure can confirm, free at the bound"),
        pytest.param(LAST, {K0: _mem(BASE + STEP), K1: _mem(BASE)},
                     {K1: ListingDue(at=110.0, free_below_bytes=70 * GiB)}, 100.05,
                     frozenset(), id="less free on another device: nothing"),
        pytest.param(_last({K0: 100.0, K1: 100.2}), {K0: _mem(BASE), K1: _mem(BASE)}, {},
                     100.23, frozenset({K0}),
                     id="listing would pass the poll interval before the next read"),
        pytest.param(_last({K0: 100.0, K1: 100.0}), {K0: _mem(BASE), K1: _mem(BASE)}, {},
                     100.2, frozenset(), id="listing younger than the interval"),
        pytest.param(_last({K0: 100.0, K1: 100.0}, skipped=True),
                     {K0: _mem(BASE), K1: _mem(BASE)}, {}, 100.24, None,
                     id="a GPU that could not be listed: everything at the interval"),
        pytest.param(_last({K0: 100.0, K1: 100.0}, skipped=True),
                     {K0: _mem(BASE), K1: _mem(BASE)}, {}, 100.1, frozenset(),
                     id="a GPU that could not be listed: not before the interval"),
        pytest.param(LAST, {K0: _mem(BASE), K1: _mem(BASE), model_gpu(2).key: _mem(0)}, {},
                     100.05, None, id="a device appeared: everything"),
    ],
)  # fmt: skip
def test_which_devices_are_listed_again(
    last: LastListings | None,
    memory: dict[DeviceKey, DeviceMemory],
    urgent: dict[DeviceKey, ListingDue],
    now: float,
    due: frozenset[DeviceKey] | None,
) -> None:
    got = due_for_listing(
        last=last,
        memory=memory,
        used_at_listing={K0: BASE, K1: BASE},
        urgent=urgent,
        now=now,
        step_bytes=STEP,
        max_age_seconds=0.25,
        tick_seconds=0.05,
    )
    assert got == due


# ---------------------------------------------------------------------------------------------
# The sampler over the stand-in


def _calls(lib: Path) -> int:
    fn = ctypes.CDLL(str(lib)).gpuguardStubCallCount
    fn.restype = ctypes.c_int
    return int(fn())


def _sampler(source: NvmlGpuSource, clock: StepClock, **kw: float) -> ChangeDrivenSampler:
    return ChangeDrivenSampler(
        source,
        clock=clock,
        step_bytes=int(kw.get("step", STEP)),
        max_age_seconds=kw.get("max_age", 0.25),
        tick_seconds=kw.get("tick", 0.05),
    )


def _two_gpus(used0: int, used1: int) -> dict[str, object]:
    return {
        "devices": [
            gpu(0, procs=[{"pid": 4242, "used_bytes": used0}]),
            gpu(1, procs=[{"pid": 4343, "used_bytes": used1}]),
        ]
    }


def test_only_the_device_whose_memory_moved_is_listed_again(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource], stub_lib: Path
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock)
    scenario.write(_two_gpus(2 * GiB, 3 * GiB))
    first = sampler.tick()
    assert first is not None
    assert by_device(first) == {
        DeviceKey(uuid=uuid(0)): {4242: 2 * GiB},
        DeviceKey(uuid=uuid(1)): {4343: 3 * GiB},
    }
    assert first.memory[DeviceKey(uuid=uuid(1))].used_bytes == 3 * GiB

    # Nothing moved: a tick is two memory reads and no listing.
    clock.now += 0.05
    before = _calls(stub_lib)
    assert sampler.tick() is None
    assert _calls(stub_lib) - before == 3  # the GPU count and two memory reads

    # GPU 1 grows past the step: only GPU 1 is listed; GPU 0's listing is carried, not renewed.
    clock.now += 0.05
    scenario.write(_two_gpus(2 * GiB, 3 * GiB + STEP + MiB))
    second = sampler.tick()
    assert second is not None
    k0, k1 = DeviceKey(uuid=uuid(0)), DeviceKey(uuid=uuid(1))
    assert second.listing(k1) == Listing(seq=second.seq, taken_at=clock.now)
    assert second.listing(k0) == first.listing(k0)
    assert by_device(second)[k1] == {4343: 3 * GiB + STEP + MiB}
    assert by_device(second)[k0] == {4242: 2 * GiB}

    # A move within the step lists nothing, even though the process list changed.
    clock.now += 0.05
    scenario.write(_two_gpus(2 * GiB + STEP, 3 * GiB + STEP + MiB))
    assert sampler.tick() is None

    # GPU 0's listing reaches the poll interval: listed again, and the small move is seen.
    clock.now += 0.1
    third = sampler.tick()
    assert third is not None
    assert third.listing(k0).seq == third.seq
    assert third.listing(k1) == second.listing(k1)
    assert by_device(third)[k0] == {4242: 2 * GiB + STEP}


def test_a_device_with_a_violation_due_is_listed_at_every_tick_from_its_time_on(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock, max_age=10.0)
    scenario.write(_two_gpus(2 * GiB, 3 * GiB))
    assert sampler.tick() is not None
    k1 = DeviceKey(uuid=uuid(1))
    due = {k1: ListingDue(at=clock.now + 0.12)}
    # Before its time nothing is listed (a listing then moves nothing on).
    for _ in range(2):
        clock.now += 0.05
        assert sampler.tick(due) is None
    seqs = []
    for _ in range(3):
        clock.now += 0.05
        got = sampler.tick(due)
        assert got is not None
        seqs.append(got.listing(k1).seq)
        assert got.listing(DeviceKey(uuid=uuid(0))).seq == 1
    assert seqs == sorted(set(seqs))


def test_device_pressure_data_comes_from_the_memory_read(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock)
    total = 100 * GiB
    scenario.write({"devices": [gpu(0, total=total, used_bytes=97 * GiB)]})
    got = sampler.tick()
    assert got is not None
    assert got.memory[DeviceKey(uuid=uuid(0))] == DeviceMemory(
        total_bytes=total, used_bytes=97 * GiB, free_bytes=3 * GiB
    )


def test_a_failed_memory_read_lists_that_device_and_the_listing_reports_it(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock)
    doc = _two_gpus(2 * GiB, 3 * GiB)
    scenario.write(doc)
    assert sampler.tick() is not None
    clock.now += 0.05
    scenario.write(
        {
            **doc,
            "errors": [
                {"call": "nvmlDeviceGetMemoryInfo", "device": 1, "code": "UNKNOWN", "times": 1}
            ],
        }
    )
    got = sampler.tick()
    assert got is not None
    k0, k1 = DeviceKey(uuid=uuid(0)), DeviceKey(uuid=uuid(1))
    assert got.listing(k1).seq == got.seq
    assert got.listing(k0).seq != got.seq


def test_a_mig_gpu_is_read_per_instance_and_listed_as_a_whole(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock)

    def doc(used_gi2: int) -> dict[str, object]:
        return {
            "devices": [
                mig_gpu(
                    0,
                    [
                        {"slot": 0, "uuid": "MIG-a", "gi": 1, "ci": 0, "total_bytes": 70 * GiB,
                         "processes": [{"pid": 4242, "used_bytes": 1 * GiB}]},
                        {"slot": 1, "uuid": "MIG-b", "gi": 2, "ci": 0, "total_bytes": 70 * GiB,
                         "processes": [{"pid": 4343, "used_bytes": used_gi2}]},
                    ],
                ),
                gpu(1, procs=[{"pid": 4444, "used_bytes": 1 * GiB}]),
            ]
        }  # fmt: skip

    scenario.write(doc(1 * GiB))
    first = sampler.tick()
    assert first is not None
    gi1, gi2 = (
        DeviceKey(uuid=uuid(0), gpu_instance_id=1),
        DeviceKey(uuid=uuid(0), gpu_instance_id=2),
    )
    assert first.memory[gi2].total_bytes == 70 * GiB
    clock.now += 0.05
    scenario.write(doc(5 * GiB))
    got = sampler.tick()
    assert got is not None
    # Instances are enumerated per GPU: GPU 0 is listed whole, GPU 1 is carried.
    assert got.listing(gi1).seq == got.listing(gi2).seq == got.seq
    assert got.listing(DeviceKey(uuid=uuid(1))).seq == first.seq
    assert by_device(got)[gi2] == {4343: 5 * GiB}


def test_a_change_in_the_gpu_count_lists_everything(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    clock = StepClock()
    sampler = _sampler(make_source(clock=clock), clock)
    scenario.write(_two_gpus(2 * GiB, 3 * GiB))
    assert sampler.tick() is not None
    clock.now += 0.05
    doc = _two_gpus(2 * GiB, 3 * GiB)
    doc["devices"] = [*doc["devices"], gpu(2)]  # type: ignore[misc]
    scenario.write(doc)
    got = sampler.tick()
    assert got is not None
    assert [d.index for d in got.devices] == [0, 1, 2]
    assert {got.listing(d.key).seq for d in got.devices} == {got.seq}
