"""The fast path's native quiet gate (gpuguard/adapters/nvml/_gate.c) over the real nvidia-ml-py
and the C stand-in: it keeps reading memory without waking Python and returns exactly when
Python's next fast read could list something (a move past the step, a failed read, a changed
GPU count, a listing falling due) or when it is woken; it never holds up a MIG release; its
inputs are bounded; and the sampler skips only ticks that would have listed nothing.

``make test`` builds the gate (``pip install -e .``); a missing gate fails here, it is not
skipped.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.adapters.nvml.gate import native_gate_built
from gpuguard.core.model import DeviceKey, ListingDue
from gpuguard.ports import QuietGate
from gpuguard.runtime.sampling import ChangeDrivenSampler
from rigs.nvml_stub import Scenario
from tests.fakes import GiB
from tests.nvml_stub.fixtures import (
    gpu,
    make_source_fixture,  # noqa: F401 (a fixture)
    scenario_fixture,  # noqa: F401 (a fixture)
    stub_lib_fixture,  # noqa: F401 (a fixture)
)

pytestmark = pytest.mark.nvml_stub

MiB = 2**20
STEP = 64 * MiB
TICK = 0.05


def _devices(*used: int, total: int = 80 * GiB) -> dict[str, Any]:
    return {
        "devices": [
            gpu(i, procs=[{"pid": 100 + i, "used_bytes": u}], total=total)
            for i, u in enumerate(used)
        ]
    }


class Waiting:
    """One ``gate.wait`` in a thread of its own; ``why`` and when it returned."""

    def __init__(self, gate: QuietGate, baseline: dict[DeviceKey, int], *, until_in: float):
        now = time.monotonic()
        self.started = now
        self.why: str | None = None
        self.returned_at: float | None = None

        def run() -> None:
            self.why = gate.wait(
                baseline=baseline,
                step_bytes=STEP,
                interval_seconds=TICK,
                first=now + TICK,
                until=now + until_in,
            )
            self.returned_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return self.returned_at is not None

    def result(self, timeout: float = 10.0) -> tuple[str | None, float]:
        self.thread.join(timeout)
        assert self.returned_at is not None, "the gate did not return"
        return self.why, self.returned_at - self.started


def took_since(waiting: Waiting, since: float) -> float:
    assert waiting.returned_at is not None
    return waiting.returned_at - since


@pytest.fixture(name="listed")
def listed_fixture(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> Iterator[tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]]]:
    """A source over two GPUs (1 and 2 GiB used) that has listed them, its gate, and the
    baseline its fast read gives."""
    scenario.write(_devices(1 * GiB, 2 * GiB))
    source = make_source()
    source.sample()
    gate = source.quiet_gate()
    assert gate is not None
    baseline = {key: m.used_bytes for key, m in source.read_memory().items()}
    yield source, gate, baseline
    gate.close()


def test_the_native_gate_is_built_and_can_be_switched_off(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    assert native_gate_built(), "gpuguard/adapters/nvml/_gate.c is not built: pip install -e ."
    assert make_source().quiet_gate() is not None
    assert make_source(native_gate=False).quiet_gate() is None


def test_a_move_past_the_step_ends_the_wait_and_a_smaller_one_does_not(
    scenario: Scenario, listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]]
) -> None:
    _source, gate, baseline = listed
    waiting = Waiting(gate, baseline, until_in=30)
    scenario.write(_devices(1 * GiB + STEP, 2 * GiB - STEP))  # exactly the step: not past it
    time.sleep(0.4)
    assert not waiting.done(), "returned on a move of exactly the step"
    moved_at = time.monotonic()
    scenario.write(_devices(1 * GiB, 2 * GiB - STEP - MiB))  # the second GPU, past the step
    why, _ = waiting.result()
    assert why == "moved"
    assert took_since(waiting, moved_at) < 0.5  # the next read (50 ms), with room for load


def test_the_wait_ends_at_the_first_read_at_or_after_the_listing_falls_due(
    listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]],
) -> None:
    _source, gate, baseline = listed
    why, took = Waiting(gate, baseline, until_in=0.42).result()
    assert why == "due"
    assert 0.42 <= took < 0.8  # the grid instant at 0.45 s, not a read earlier


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda sc: sc.write(_devices(1 * GiB, 2 * GiB, 3 * GiB)), id="a GPU added"),
        pytest.param(
            lambda sc: sc.write(
                {**_devices(1 * GiB, 2 * GiB),
                 "errors": [{"call": "nvmlDeviceGetMemoryInfo", "device": 1, "code": "UNKNOWN",
                             "times": -1}]}
            ),
            id="a memory read fails",
        ),
    ],
)  # fmt: skip
def test_a_failed_read_or_a_changed_count_ends_the_wait(
    scenario: Scenario,
    listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]],
    change: Callable[[Scenario], None],
) -> None:
    _source, gate, baseline = listed
    waiting = Waiting(gate, baseline, until_in=30)
    time.sleep(0.2)
    change(scenario)
    why, took = waiting.result()
    assert why == "failed"
    assert took < 1.5


def test_wake_and_close_end_the_wait_and_close_ends_every_later_one(
    listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]],
) -> None:
    _source, gate, baseline = listed
    waiting = Waiting(gate, baseline, until_in=30)
    time.sleep(0.2)
    gate.wake()
    assert waiting.result()[0] == "woken"
    gate.rearm()
    waiting = Waiting(gate, baseline, until_in=30)
    time.sleep(0.2)
    assert not waiting.done(), "rearm() did not clear the wake"
    gate.close()
    assert waiting.result()[0] == "woken"
    assert Waiting(gate, baseline, until_in=30).result()[1] < 0.2


def test_a_release_for_mig_is_not_held_up_by_a_wait(
    listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]],
) -> None:
    """The wait holds the NVML call guard; release() (deadline 5 s) must not wait it out."""
    source, gate, baseline = listed
    waiting = Waiting(gate, baseline, until_in=30)
    time.sleep(0.2)
    started = time.monotonic()
    source.release()
    assert time.monotonic() - started < 1.0
    assert waiting.result()[0] == "woken"
    assert gate.wait(baseline=baseline, step_bytes=STEP, interval_seconds=TICK,
                     first=time.monotonic(), until=time.monotonic() + 5) is None  # fmt: skip
    source.acquire()
    source.sample()
    again = {key: m.used_bytes for key, m in source.read_memory().items()}
    assert Waiting(gate, again, until_in=0.2).result()[0] == "due"


def test_a_baseline_of_other_units_is_refused_not_waited_on(
    listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]],
) -> None:
    _source, gate, baseline = listed
    fewer = dict(list(baseline.items())[:1])
    now = time.monotonic()
    assert gate.wait(baseline=fewer, step_bytes=STEP, interval_seconds=TICK, first=now,
                     until=now + 5) is None  # fmt: skip


def test_an_nvml_call_hung_in_the_gate_shows_to_the_watchdog(
    scenario: Scenario, listed: tuple[NvmlGpuSource, QuietGate, dict[DeviceKey, int]]
) -> None:
    _source, gate, baseline = listed
    scenario.write(
        {**_devices(1 * GiB, 2 * GiB),
         "delays": [{"call": "nvmlDeviceGetMemoryInfo", "ms": 1500, "times": 1}]}
    )  # fmt: skip
    waiting = Waiting(gate, baseline, until_in=30)
    time.sleep(0.9)
    hung = gate.call_seconds()
    assert hung is not None
    assert hung > 0.5
    waiting.thread.join(5)
    assert gate.call_seconds() is None or gate.call_seconds() < 0.5  # type: ignore[operator]
    gate.close()
    assert waiting.result()[0] == "woken"


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"handles": []}, id="no handle"),
        pytest.param({"handles": [1] * 257, "baseline": [0] * 257}, id="257 handles"),
        pytest.param({"handles": [0]}, id="a NULL handle"),
        pytest.param({"baseline": [0, 0]}, id="a baseline per handle"),
        pytest.param({"baseline": [-1]}, id="a negative baseline"),
        pytest.param({"interval": 0.0}, id="interval 0"),
        pytest.param({"interval": 61.0}, id="interval over 60 s"),
        pytest.param({"first": float("nan")}, id="first NaN"),
        pytest.param({"count_fn": 0}, id="a NULL function"),
        pytest.param({"flags": (ctypes.c_int64 * 3)()}, id="3 flag words"),
        pytest.param({"flags": bytes(32)}, id="read-only flags"),
    ],
)
def test_the_native_call_refuses_inputs_out_of_bounds(bad: dict[str, Any]) -> None:
    from gpuguard.adapters.nvml import _gate  # type: ignore[attr-defined]

    args: dict[str, Any] = {
        "count_fn": 1, "memory_fn": 1, "handles": [1], "count": 1, "baseline": [0],
        "step": STEP, "interval": TICK, "first": 0.0, "until": 0.0,
        "flags": (ctypes.c_int64 * 4)(),
    }  # fmt: skip
    args.update(bad)
    with pytest.raises((ValueError, TypeError, OverflowError)):
        _gate.wait(*args.values())


class CountingSource:
    """The real source, counting the fast reads Python makes (a wrapper above the port)."""

    def __init__(self, source: NvmlGpuSource) -> None:
        self.source = source
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def read_memory(self) -> Any:
        self.reads += 1
        return self.source.read_memory()


def _gated(
    real: NvmlGpuSource, *, max_age_seconds: float
) -> tuple[CountingSource, ChangeDrivenSampler]:
    """A sampler over ``real`` (its reads counted) that pauses in its native gate."""
    source = CountingSource(real)
    sampler = ChangeDrivenSampler(
        source,
        clock=time.monotonic,
        step_bytes=STEP,
        max_age_seconds=max_age_seconds,
        tick_seconds=TICK,
        gate=source.quiet_gate(),
    )
    return source, sampler


def _ticking(
    sampler: ChangeDrivenSampler, urgent: dict[DeviceKey, ListingDue], seconds: float
) -> list[float]:
    """Tick and pause for ``seconds``: when each tick listed something."""
    listed: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if sampler.tick(urgent) is not None:
            listed.append(time.monotonic())
        sampler.pause(TICK, lambda: urgent)
    return listed


def test_the_sampler_skips_only_ticks_that_list_nothing(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(_devices(1 * GiB))
    source, sampler = _gated(make_source(), max_age_seconds=0.5)
    listed = _ticking(sampler, {}, 2.0)
    # Idle: a listing every poll interval (0.5 s), and Python reads only then, not 40 times.
    assert 3 <= len(listed) <= 6, listed
    assert source.reads <= len(listed) + 2, source.reads
    # A move past the step: listed at the next tick, as with a sleep.
    done = threading.Event()

    def move() -> None:
        time.sleep(0.23)
        scenario.write(_devices(2 * GiB))
        done.set()

    threading.Thread(target=move, daemon=True).start()
    started = time.monotonic()
    listed = _ticking(sampler, {}, 0.6)
    assert done.is_set()
    first_after_move = [t - started for t in listed if t - started > 0.23]
    assert first_after_move, listed
    assert first_after_move[0] < 0.23 + 0.2


def test_an_urgent_violation_is_read_every_tick_and_a_wake_ends_the_pause(
    scenario: Scenario, make_source: Callable[..., NvmlGpuSource]
) -> None:
    scenario.write(_devices(1 * GiB))
    source, sampler = _gated(make_source(), max_age_seconds=30)
    assert sampler.tick({}) is not None
    key = next(iter(source.read_memory()))
    urgent: dict[DeviceKey, ListingDue] = {key: ListingDue(at=time.monotonic() + 60)}
    before = source.reads
    _ticking(sampler, urgent, 0.5)
    assert source.reads - before >= 6, "an urgent violation's device was not read every tick"
    # No violation: the pause lasts (the listing is due in 30 s) until a decision wakes it.
    quiet: dict[DeviceKey, ListingDue] = {}
    woke_at: list[float] = []

    def decide_later() -> None:
        time.sleep(0.3)
        quiet[key] = urgent[key]
        woke_at.append(time.monotonic())
        sampler.wake()

    threading.Thread(target=decide_later, daemon=True).start()
    started = time.monotonic()
    sampler.pause(TICK, lambda: quiet)
    assert woke_at, "the pause ended before the decision"
    assert time.monotonic() - woke_at[0] < 0.3
    assert time.monotonic() - started < 1.0
