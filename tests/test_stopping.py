"""``core.stopping``: the signal rule of the SIGTERM step, as pure tables.

Covers: parsing ``/proc/<pid>/status`` (real texts; anything not in the kernel's form is
unknown, never a guess); what a SIGTERM does to each kind of process, in the kernel's order;
the container plan (hypothesis: SIGKILL at the SIGTERM step only to a member on which SIGTERM
would be lost, and only when no member could use the termination timeout; nothing changes at
the SIGKILL step); and the words that name each PID's signal. The real processes are in
``tests/kernel/test_signals.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuguard.core.model import MemberStop, ProcessIdentity, SignalReport, SigtermFate, StopSignal
from gpuguard.core.stopping import (
    CAN_WAIT,
    LOST,
    SignalState,
    describe_delivery,
    parse_signal_state,
    plan_stop,
    sigterm_fate,
)

PYTHON_AS_PID_1 = """Name:\tpython3
Umask:\t0022
State:\tS (sleeping)
Tgid:\t30420
NStgid:\t30420\t1
Pid:\t30420
PPid:\t30419
NSpid:\t30420\t1
NSpgid:\t30419\t0
SigQ:\t0/96369
SigPnd:\t0000000000000000
ShdPnd:\t0000000000000000
SigBlk:\t0000000000000000
SigIgn:\t0000000001001000
SigCgt:\t0000000000000002
CapEff:\t000001ffffffffff
"""
"""``python -c 'import time; time.sleep(30)'`` as PID 1 of ``unshare --pid --fork``, as read
from the host: SIGINT caught (bit 1), SIGPIPE and SIGXFSZ ignored, no SIGTERM bit."""


def status(*, nspid: str = "4242", cgt: str = "0", ign: str = "0", blk: str = "0") -> str:
    return (
        f"Name:\tx\nNSpid:\t{nspid}\nSigBlk:\t{blk:0>16}\nSigIgn:\t{ign:0>16}\n"
        f"SigCgt:\t{cgt:0>16}\n"
    )


def test_a_real_status_of_python_as_pid_1_parses_and_drops_sigterm() -> None:
    state = parse_signal_state(PYTHON_AS_PID_1)
    assert state == SignalState(nspid=(30420, 1), caught=0x2, ignored=0x1001000, blocked=0)
    assert sigterm_fate(state) is SigtermFate.DROPPED_BY_INIT


@pytest.mark.parametrize(
    ("text", "fate"),
    [
        pytest.param(status(nspid="4242\t1", cgt="4002"), SigtermFate.CAUGHT, id="init-handler"),
        pytest.param(status(nspid="4242\t1"), SigtermFate.DROPPED_BY_INIT, id="init-bare"),
        pytest.param(status(nspid="4242\t9\t1"), SigtermFate.DROPPED_BY_INIT, id="nested-init"),
        pytest.param(status(nspid="4242\t1", blk="4000"), SigtermFate.BLOCKED, id="init-blocks"),
        pytest.param(status(nspid="4242\t1", ign="4000"), SigtermFate.IGNORED, id="init-ignores"),
        pytest.param(status(nspid="4242\t7"), SigtermFate.TERMINATES, id="child-of-init"),
        pytest.param(status(), SigtermFate.TERMINATES, id="host-namespace"),
        pytest.param(status(ign="4000"), SigtermFate.IGNORED, id="ignores"),
        pytest.param(status(ign="4000", blk="4000"), SigtermFate.BLOCKED, id="ignored-blocked"),
        pytest.param(status(cgt="4000", blk="4000"), SigtermFate.CAUGHT, id="caught-blocked"),
        pytest.param(
            status(nspid="4242\t1", cgt="2000"),
            SigtermFate.DROPPED_BY_INIT,
            id="init-catches-sigpipe-only",
        ),
        pytest.param(
            status(nspid="4242\t1", cgt="8000"),
            SigtermFate.DROPPED_BY_INIT,
            id="init-catches-sigstkflt-only",
        ),
    ],
)
def test_what_sigterm_does_follows_the_kernels_order(text: str, fate: SigtermFate) -> None:
    assert sigterm_fate(parse_signal_state(text)) is fate


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param(status().replace("NSpid:\t4242\n", ""), id="no-nspid"),
        pytest.param(status(nspid=""), id="empty-nspid"),
        pytest.param(status(nspid="4242\tx"), id="nspid-not-a-number"),
        pytest.param(status(nspid="٤٢"), id="nspid-non-ascii-digits"),
        pytest.param(status().replace("SigCgt", "SigCgX"), id="no-sigcgt"),
        pytest.param(status(cgt="0x4000"), id="mask-0x"),
        pytest.param(status(ign="+4000"), id="mask-plus"),
        pytest.param(status(blk="40_00"), id="mask-underscore"),
        pytest.param(status(cgt="1" * 17), id="mask-over-64-bits"),
    ],
)
def test_a_status_not_in_the_kernels_form_is_unknown_never_guessed(text: str) -> None:
    assert parse_signal_state(text) is None
    assert sigterm_fate(None) is SigtermFate.UNKNOWN


def test_the_first_line_of_a_key_counts_and_lines_split_on_newline_only() -> None:
    text = status(nspid="4242\t1", cgt="4000") + "SigCgt:\t0000000000000000\n"
    assert sigterm_fate(parse_signal_state(text)) is SigtermFate.CAUGHT
    # A name with a line separator the kernel allows in comm is not a line of its own.
    forged = "Name:\tx\u2028SigCgt:\t0000000000004000\n" + status(nspid="4242\t1")
    assert sigterm_fate(parse_signal_state(forged)) is SigtermFate.DROPPED_BY_INIT


def test_alone_a_pid_1_that_drops_sigterm_gets_sigkill_at_the_sigterm_step() -> None:
    stops = plan_stop(StopSignal.TERM, {1: SigtermFate.DROPPED_BY_INIT})
    assert stops == {
        1: MemberStop(
            pid=1,
            signal=StopSignal.KILL,
            fate=SigtermFate.DROPPED_BY_INIT,
            detail=(
                "PID 1 of its PID namespace with no SIGTERM handler: SIGTERM would be dropped, "
                "and no process of the container catches SIGTERM, so none would use the "
                "termination timeout"
            ),
        )
    }


@pytest.mark.parametrize("beside", sorted(CAN_WAIT), ids=str)
def test_a_lost_sigterm_waits_beside_a_member_that_may_use_the_timeout(
    beside: SigtermFate,
) -> None:
    fates = {
        5: SigtermFate.TERMINATES,
        7: beside,
        1: SigtermFate.DROPPED_BY_INIT,
        9: SigtermFate.IGNORED,
    }
    stops = plan_stop(StopSignal.TERM, fates)
    assert set(stops) == {1, 9}
    assert all(s.signal is StopSignal.TERM for s in stops.values())
    assert "as PID 7 " in stops[1].detail
    assert "would end every process of its PID namespace" in stops[1].detail
    assert "namespace" not in stops[9].detail


def test_the_sigkill_step_is_sigkill_to_every_member() -> None:
    assert plan_stop(StopSignal.KILL, dict.fromkeys(range(5), SigtermFate.DROPPED_BY_INIT)) == {}


@given(
    step=st.sampled_from(StopSignal),
    fates=st.dictionaries(st.integers(1, 50), st.sampled_from(SigtermFate), max_size=8),
)
def test_sigkill_comes_early_only_to_a_lost_sigterm_and_only_when_nothing_can_wait(
    step: StopSignal, fates: dict[int, SigtermFate]
) -> None:
    stops = plan_stop(step, fates)
    nothing_waits = not any(f in CAN_WAIT for f in fates.values())
    for pid, fate in fates.items():
        signal = stops[pid].signal if pid in stops else step
        if step is StopSignal.KILL or (fate in LOST and nothing_waits):
            assert signal is StopSignal.KILL
        else:
            assert signal is StopSignal.TERM  # never an early SIGKILL to anyone else
        assert (pid in stops) == (step is StopSignal.TERM and fate in LOST)
    assert all(s.pid in fates and s.fate is fates[s.pid] and s.detail for s in stops.values())


def _report(pids: list[int], stops: tuple[MemberStop, ...] = ()) -> SignalReport:
    return SignalReport(
        signal=StopSignal.TERM,
        delivered=tuple(ProcessIdentity(pid=p, start_ticks=1) for p in pids),
        stops=stops,
    )


def test_describe_names_each_pid_with_its_signal_sigkill_first() -> None:
    stop = MemberStop(pid=4242, signal=StopSignal.KILL, fate=SigtermFate.IGNORED, detail="why")
    assert describe_delivery(_report([4250], ())) == "SIGTERM to PID 4250"
    assert (
        describe_delivery(_report([4250, 4242, 4251], (stop,)))
        == "SIGKILL to PID 4242 (why) and SIGTERM to 2 processes (PIDs 4250, 4251)"
    )
    many = describe_delivery(_report(list(range(100, 120))))
    assert (
        many == "SIGTERM to 20 processes (PIDs 100, 101, 102, 103, 104, 105, 106, 107 and 12 more)"
    )
    assert describe_delivery(_report([])) == ""
