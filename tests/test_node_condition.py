"""The ``GPUMemoryEnforced`` Node condition (docs/design.md, Node condition): what each cycle's
facts make it (a pure table over ``core.node_condition``), and that the enforcer hands it to its
writer after every cycle, with whether it stands by."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gpuguard.core.model import Mode, RefusalReason
from gpuguard.core.node_condition import (
    MAX_MESSAGE_CHARS,
    ConditionReason,
    NodeCondition,
    node_condition,
    stopped_condition,
)
from gpuguard.core.policy import Decision, EnforcerState, Refusal
from gpuguard.errors import GpuSourceLost
from tests.enforcer_world import POLICY, World
from tests.fakes import FakeNodeConditionWriter, FakeNodeLock

STANDBY = Refusal(reason=RefusalReason.LOCK_HELD, detail="/run/gpuguard/enforcer.lock (pid 7)")
NO_KILL = Refusal(reason=RefusalReason.CANNOT_SIGNAL, detail="CAP_KILL missing")
ACTIVE = Decision(state=EnforcerState(), enforcement_active=True)


def _inactive(reason: RefusalReason) -> Decision:
    return Decision(state=EnforcerState(), inactive_reason=reason)


# (decision, mode, standby, blocked) → (status, reason)
TABLE = {
    "active in enforce mode": (ACTIVE, Mode.ENFORCE, None, None, True, "Enforcing"),
    "active in audit mode": (ACTIVE, Mode.AUDIT, None, None, False, "AuditMode"),
    "another enforcer holds the lock": (
        _inactive(RefusalReason.LOCK_HELD), Mode.ENFORCE, STANDBY, None, False,
        "LockHeldElsewhere",
    ),
    "standby comes first, even before stale data": (
        _inactive(RefusalReason.DATA_STALE), Mode.ENFORCE, STANDBY, NO_KILL, False,
        "LockHeldElsewhere",
    ),
    "no fresh GPU sample": (
        _inactive(RefusalReason.DATA_STALE), Mode.ENFORCE, None, None, False, "NvmlUnavailable",
    ),
    "no fresh GPU sample in audit mode": (
        _inactive(RefusalReason.DATA_STALE), Mode.AUDIT, None, None, False, "NvmlUnavailable",
    ),
    "NVML before a missing CAP_KILL": (
        _inactive(RefusalReason.DATA_STALE), Mode.ENFORCE, None, NO_KILL, False,
        "NvmlUnavailable",
    ),
    "pod cache not synced": (
        _inactive(RefusalReason.POD_CACHE_UNSYNCED), Mode.ENFORCE, None, None, False, "NotReady",
    ),
    "pod cache stale": (
        _inactive(RefusalReason.POD_CACHE_STALE), Mode.AUDIT, None, None, False, "NotReady",
    ),
    "cannot signal": (ACTIVE, Mode.ENFORCE, None, NO_KILL, False, "NotReady"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(TABLE))
def test_each_cycles_facts_give_one_condition(case: str) -> None:
    decision, mode, standby, blocked, status, reason = TABLE[case]
    got = node_condition(decision, mode=mode, standby=standby, blocked=blocked)
    assert (got.status, got.reason.value) == (status, reason)
    assert got.message
    assert len(got.message) <= MAX_MESSAGE_CHARS


def test_true_only_with_enforcing_and_the_reasons_are_the_five_of_the_contract() -> None:
    assert {r.value for r in ConditionReason} == {
        "Enforcing", "AuditMode", "NotReady", "NvmlUnavailable", "LockHeldElsewhere",
    }  # fmt: skip
    for decision, mode, standby, blocked, *_ in TABLE.values():
        got = node_condition(decision, mode=mode, standby=standby, blocked=blocked)
        assert got.status == (got.reason is ConditionReason.ENFORCING)
    stopped = stopped_condition()
    assert (stopped.status, stopped.reason, stopped.message) == (
        False,
        ConditionReason.NOT_READY,
        "enforcer stopped",
    )


def test_a_long_detail_is_cut_to_the_bound() -> None:
    standby = Refusal(reason=RefusalReason.LOCK_HELD, detail="x" * 1000)
    got = node_condition(ACTIVE, mode=Mode.ENFORCE, standby=standby)
    assert len(got.message) == MAX_MESSAGE_CHARS
    assert got.message.endswith("…")


# -- the enforcer hands it over ----------------------------------------------------------------


def _last(writer: FakeNodeConditionWriter) -> tuple[NodeCondition, bool]:
    assert writer.given, "no condition was handed over"
    return writer.given[-1]


def test_the_enforcer_hands_over_enforcing_in_enforce_mode_and_audit_mode_in_audit() -> None:
    for mode, reason in ((Mode.ENFORCE, "Enforcing"), (Mode.AUDIT, "AuditMode")):
        writer = FakeNodeConditionWriter()
        world = World(policy=dataclasses.replace(POLICY, mode=mode), condition=writer)
        asyncio.run(world.run(2))
        assert len(writer.given) == 2  # every cycle: the writer sends only changes
        got, standby = _last(writer)
        assert (got.reason.value, standby) == (reason, False)


def test_a_lost_gpu_source_makes_it_nvml_unavailable_and_a_sample_ends_that() -> None:
    writer = FakeNodeConditionWriter()
    world = World(condition=writer)
    asyncio.run(world.run(1))
    assert _last(writer)[0].reason is ConditionReason.ENFORCING
    world.gpu.error = GpuSourceLost("every NVML call failed: unknown")
    asyncio.run(world.run(1))
    assert _last(writer)[0].reason is ConditionReason.NVML_UNAVAILABLE
    world.gpu.error = None
    asyncio.run(world.run(1))
    assert _last(writer)[0].reason is ConditionReason.ENFORCING


def test_an_unsynced_pod_cache_makes_it_not_ready() -> None:
    writer = FakeNodeConditionWriter()
    world = World(condition=writer)
    world.pods.synced = False
    asyncio.run(world.run(1))
    got, _ = _last(writer)
    assert (got.status, got.reason) == (False, ConditionReason.NOT_READY)
    assert "pod_cache_unsynced" in got.message


def test_a_standby_enforcer_hands_over_lock_held_elsewhere_as_standby() -> None:
    writer = FakeNodeConditionWriter()
    world = World(condition=writer, lock=FakeNodeLock(holder_pid=4242))
    asyncio.run(world.run(1))
    got, standby = _last(writer)
    assert (got.reason, standby) == (ConditionReason.LOCK_HELD_ELSEWHERE, True)


def test_an_enforcer_that_cannot_signal_is_not_ready() -> None:
    writer = FakeNodeConditionWriter()
    world = World(condition=writer, blocked=NO_KILL)
    asyncio.run(world.run(1))
    got, _ = _last(writer)
    assert (got.status, got.reason) == (False, ConditionReason.NOT_READY)
    assert "cannot_signal" in got.message
