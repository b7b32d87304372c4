"""Tables over ``core.reconcile``: the agent's MIG safety rules (docs/design.md, Sharing config)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from dataclasses import replace

import pytest

from gpuguard.core.reconcile import (
    CORDONED_BY_AGENT,
    CORDONED_BY_ANNOTATION,
    DRAIN_DEADLINE_SECONDS,
    MIG_CONFIG_STATE_LABEL,
    MIG_PICKUP_SECONDS,
    REVERT_WINDOW_SECONDS,
    WRITE_SETTLE_SECONDS,
    AgentDecision,
    AgentState,
    CordonAction,
    NodeEventReason,
    NodeView,
    ReconcileError,
    WaitReason,
    reconcile,
)
from gpuguard.core.sharing import (
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    HeldLabel,
    MigChangePolicy,
)

DP = DEVICE_PLUGIN_CONFIG_LABEL
MIG = MIG_CONFIG_LABEL
OLD, NEW = "all-disabled", "all-1g.10gb"
WANT: dict[str, str | None] = {DP: "slice-4", MIG: NEW}
T0 = 1000.0
STATES = (None, "pending", "rebooting", "success", "failed")
POLICIES = tuple(MigChangePolicy)


def node(
    *,
    mig: str | None = OLD,
    state: str | None = "success",
    dp: str | None = "slice-4",
    cordon: str | None = None,
) -> NodeView:
    """A Node; ``cordon``: ``None`` (schedulable), ``"agent"`` or ``"admin"`` (no annotation)."""
    labels = {k: v for k, v in {MIG: mig, MIG_CONFIG_STATE_LABEL: state, DP: dp}.items() if v}
    annotations = {CORDONED_BY_ANNOTATION: CORDONED_BY_AGENT} if cordon == "agent" else {}
    return NodeView(
        name="gpu-1",
        labels=labels,
        annotations=annotations,
        unschedulable=cordon is not None,
        unschedulable_by_gpuguard=cordon == "agent",
    )


def turn(
    n: NodeView,
    *,
    desired: Mapping[str, str | None] = WANT,
    pods: int = 0,
    policy: MigChangePolicy = MigChangePolicy.WHEN_IDLE,
    allow_eviction: bool = False,
    state: AgentState | None = None,
    now: float = T0,
    keep_cordon_on_failure: bool = False,
    held: Mapping[str, HeldLabel] | None = None,
) -> AgentDecision:
    return reconcile(
        desired=desired,
        node=n,
        gpu_pods=pods,
        policy=policy,
        allow_eviction=allow_eviction,
        state=state if state is not None else AgentState(),
        now=now,
        keep_cordon_on_failure=keep_cordon_on_failure,
        held=held,
    )


def applied(n: NodeView, d: AgentDecision) -> NodeView:
    """The Node after the runtime executed ``d`` (what the next watch event shows)."""
    labels = {**n.labels, **d.patch_labels}
    annotations = dict(n.annotations)
    unschedulable, ours = n.unschedulable, n.unschedulable_by_gpuguard
    if d.cordon is CordonAction.CORDON:
        unschedulable, annotations[CORDONED_BY_ANNOTATION] = True, CORDONED_BY_AGENT
        ours = True
    elif d.cordon is CordonAction.UNCORDON:
        unschedulable = ours = False
        annotations.pop(CORDONED_BY_ANNOTATION, None)
    elif d.cordon is CordonAction.FORGET:
        annotations.pop(CORDONED_BY_ANNOTATION, None)
    return replace(
        n,
        labels=labels,
        annotations=annotations,
        unschedulable=unschedulable,
        unschedulable_by_gpuguard=ours,
    )


def with_state(n: NodeView, state: str | None) -> NodeView:
    labels = {k: v for k, v in n.labels.items() if k != MIG_CONFIG_STATE_LABEL}
    if state is not None:
        labels[MIG_CONFIG_STATE_LABEL] = state
    return replace(n, labels=labels)


def reasons(d: AgentDecision) -> list[NodeEventReason]:
    return [e.reason for e in d.events]


# ---------------------------------------------------------------------------------------------
# Policy × GPU pods × mig state, for a MIG change that is due


def expected_first_turn(
    policy: MigChangePolicy, pods: int, state: str | None, cordon: str | None
) -> tuple[bool, CordonAction | None, WaitReason | None]:
    """(mig label patched, cordon action, waiting) — written from docs/design.md, Sharing config,
    not the code."""
    if state in ("pending", "rebooting"):
        return False, None, WaitReason.MIG_STATE_BUSY
    if policy is MigChangePolicy.FORCE:
        return True, None, None
    needs_cordon = policy in (MigChangePolicy.CORDON, MigChangePolicy.DRAIN)
    if needs_cordon and cordon is None:
        return False, CordonAction.CORDON, WaitReason.CORDON
    if pods:
        return False, None, WaitReason.GPU_PODS
    return True, None, None


@pytest.mark.parametrize("cordon", [None, "agent", "admin"])
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("pods", [0, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_due_mig_change_follows_its_policy(
    policy: MigChangePolicy, pods: int, state: str | None, cordon: str | None
) -> None:
    d = turn(node(state=state, cordon=cordon), pods=pods, policy=policy)
    patched, action, waiting = expected_first_turn(policy, pods, state, cordon)
    assert (MIG in d.patch_labels, d.cordon, d.waiting) == (patched, action, waiting)
    if patched:
        assert d.patch_labels[MIG] == NEW
        assert NodeEventReason.LABELS_APPLIED in reasons(d)
    if waiting is not None:
        assert NodeEventReason.MIG_CHANGE_WAITING in reasons(d)


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("pods", [0, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_the_mig_label_never_changes_while_pending_or_rebooting_nor_with_gpu_pods_unless_forced(
    policy: MigChangePolicy, pods: int, state: str | None
) -> None:
    for cordon in (None, "agent", "admin"):
        d = turn(node(state=state, cordon=cordon), pods=pods, policy=policy, allow_eviction=True)
        if state in ("pending", "rebooting"):
            assert MIG not in d.patch_labels
        if pods and policy is not MigChangePolicy.FORCE:
            assert MIG not in d.patch_labels


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_mig_label_already_desired_is_not_written(
    policy: MigChangePolicy, state: str | None
) -> None:
    d = turn(node(mig=NEW, state=state), pods=1, policy=policy)
    assert d.patch_labels == {}
    assert d.cordon is None


def test_the_time_slicing_label_is_applied_at_once_whatever_mig_is_doing() -> None:
    for state in STATES:
        d = turn(node(dp="slice-2", state=state), pods=3, policy=MigChangePolicy.CORDON)
        assert d.patch_labels.get(DP) == "slice-4"


def test_only_the_two_labels_and_only_differences_are_written() -> None:
    desired = {DP: "slice-4", MIG: None, "nvidia.com/gpu.product": "x"}
    assert turn(node(dp="slice-4"), desired=desired).patch_labels == {}
    assert turn(node(dp=None), desired=desired).patch_labels == {DP: "slice-4"}
    assert turn(node(mig=OLD), desired={}).patch_labels == {}


# ---------------------------------------------------------------------------------------------
# A whole change, step by step


def run_change(
    policy: MigChangePolicy, *, restart_at: int | None = None, outcome: str = "success"
) -> list[AgentDecision]:
    """Cordon → idle → apply → pending → outcome (step 5), with a restart before a step."""
    n = node(dp="slice-4")
    state = AgentState()
    decisions: list[AgentDecision] = []
    pods = 1
    for step in range(9):
        if restart_at == step:
            state = AgentState()
        if step == 2:
            pods = 0
        # The last turn comes later: a restarted agent waits MIG_PICKUP_SECONDS before it takes
        # a success it did not see arrive as the outcome.
        now = T0 + step + (MIG_PICKUP_SECONDS if step == 8 else 0)
        d = turn(n, pods=pods, policy=policy, allow_eviction=True, state=state, now=now)
        decisions.append(d)
        state = d.state
        n = applied(n, d)
        if MIG in d.patch_labels:
            n = with_state(n, "pending")
        elif step == 5:
            n = with_state(n, outcome)
    return decisions


@pytest.mark.parametrize("restart_at", [None, 1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("policy", [MigChangePolicy.CORDON, MigChangePolicy.DRAIN])
def test_cordon_wait_apply_wait_uncordon_even_across_a_restart(
    policy: MigChangePolicy, restart_at: int | None
) -> None:
    decisions = run_change(policy, restart_at=restart_at)
    actions = [d.cordon for d in decisions]
    assert actions.count(CordonAction.CORDON) == 1
    assert actions[0] is CordonAction.CORDON
    assert actions.count(CordonAction.UNCORDON) == 1
    assert actions.index(CordonAction.UNCORDON) > 5  # only after mig-manager's success
    patched = [i for i, d in enumerate(decisions) if MIG in d.patch_labels]
    assert patched == [2]  # once, when idle, after the cordon
    assert decisions[-1].waiting is None


def test_drain_evicts_only_with_allow_eviction_and_only_once_cordoned() -> None:
    drain = MigChangePolicy.DRAIN
    assert not turn(node(), pods=2, policy=drain, allow_eviction=True).evict_gpu_pods
    cordoned = node(cordon="agent")
    assert turn(cordoned, pods=2, policy=drain, allow_eviction=True).evict_gpu_pods
    assert turn(node(cordon="admin"), pods=2, policy=drain, allow_eviction=True).evict_gpu_pods
    refused = turn(cordoned, pods=2, policy=drain, allow_eviction=False)
    assert not refused.evict_gpu_pods
    assert refused.errors == (ReconcileError.EVICTION_NOT_ALLOWED,)
    again = turn(cordoned, pods=2, policy=drain, state=refused.state, now=T0 + 1)
    assert (again.errors, again.events) == ((), ())  # reported once per episode
    assert again.waiting is WaitReason.GPU_PODS
    for policy in (MigChangePolicy.WHEN_IDLE, MigChangePolicy.CORDON, MigChangePolicy.FORCE):
        assert not turn(cordoned, pods=2, policy=policy, allow_eviction=True).evict_gpu_pods


def test_a_blocked_eviction_is_requested_again_next_turn() -> None:
    n = node(cordon="agent")
    d1 = turn(n, pods=2, policy=MigChangePolicy.DRAIN, allow_eviction=True)
    d2 = turn(n, pods=2, policy=MigChangePolicy.DRAIN, allow_eviction=True, state=d1.state)
    assert d1.evict_gpu_pods
    assert d2.evict_gpu_pods


# ---------------------------------------------------------------------------------------------
# Cordon ownership


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_cordon_someone_else_set_is_never_lifted(
    policy: MigChangePolicy, state: str | None
) -> None:
    for mig in (OLD, NEW):
        for pods in (0, 1):
            started = AgentState(started=True)
            for s in (AgentState(), started):
                d = turn(node(mig=mig, state=state, cordon="admin"), pods=pods, state=s)
                assert d.cordon is None


def test_a_cordon_is_never_sent_twice_while_the_node_view_lags() -> None:
    n = node()
    d1 = turn(n, policy=MigChangePolicy.CORDON)
    assert d1.cordon is CordonAction.CORDON
    d2 = turn(n, policy=MigChangePolicy.CORDON, state=d1.state, now=T0 + 1)
    assert d2.cordon is None
    assert d2.waiting is WaitReason.CORDON
    # Never seen after the settle time: the cordon was lost, send it again.
    late = T0 + WRITE_SETTLE_SECONDS
    assert turn(n, policy=MigChangePolicy.CORDON, state=d2.state, now=late).cordon is (
        CordonAction.CORDON
    )


def test_the_agent_lifts_its_own_cordon_once_mig_manager_is_done() -> None:
    done = AgentState(started=True)
    for state in ("success", "failed", None):
        d = turn(node(mig=NEW, state=state, cordon="agent"), state=done)
        assert d.cordon is CordonAction.UNCORDON
    for state in ("pending", "rebooting"):
        d = turn(node(mig=NEW, state=state, cordon="agent"), state=done)
        assert (d.cordon, d.waiting) == (None, WaitReason.MIG_APPLYING)


def test_its_own_cordon_is_lifted_when_no_mig_change_is_wanted_any_more() -> None:
    d = turn(node(cordon="agent"), desired={DP: "slice-4"}, state=AgentState(started=True))
    assert d.cordon is CordonAction.UNCORDON


def test_a_failed_change_is_reported_once_and_its_cordon_lifted_unless_configured() -> None:
    n = node(mig=NEW, state="failed", cordon="agent")
    d = turn(n, state=AgentState(started=True))
    assert reasons(d) == [NodeEventReason.MIG_CHANGE_FAILED]
    assert d.events[0].warning
    assert d.errors == (ReconcileError.MIG_CHANGE_FAILED,)
    assert d.cordon is CordonAction.UNCORDON
    kept = turn(n, state=AgentState(started=True), keep_cordon_on_failure=True)
    assert kept.cordon is None
    again = turn(n, state=kept.state, now=T0 + 1, keep_cordon_on_failure=True)
    assert (again.events, again.errors, again.cordon) == ((), (), None)


def test_a_stale_annotation_on_a_schedulable_node_is_forgotten() -> None:
    n = replace(node(mig=NEW), annotations={CORDONED_BY_ANNOTATION: CORDONED_BY_AGENT})
    assert turn(n, state=AgentState(started=True)).cordon is CordonAction.FORGET


def test_after_writing_a_stale_success_is_not_taken_as_the_outcome() -> None:
    n = node(cordon="agent")
    d1 = turn(n, policy=MigChangePolicy.CORDON)
    assert d1.patch_labels.get(MIG) == NEW
    n = applied(n, d1)  # mig-manager has not reacted yet: the state still says success
    d2 = turn(n, policy=MigChangePolicy.CORDON, state=d1.state, now=T0 + 1)
    assert (d2.cordon, d2.waiting) == (None, WaitReason.MIG_APPLYING)
    late = T0 + MIG_PICKUP_SECONDS
    d3 = turn(n, policy=MigChangePolicy.CORDON, state=d2.state, now=late)
    assert d3.cordon is CordonAction.UNCORDON


def test_a_restarted_agent_waits_for_pickup_before_lifting_its_cordon() -> None:
    n = node(mig=NEW, state="success", cordon="agent")
    d1 = turn(n, policy=MigChangePolicy.CORDON)
    assert (d1.cordon, d1.waiting) == (None, WaitReason.MIG_APPLYING)
    d2 = turn(n, policy=MigChangePolicy.CORDON, state=d1.state, now=T0 + MIG_PICKUP_SECONDS)
    assert d2.cordon is CordonAction.UNCORDON
    assert AgentState.from_node(n, now=T0).mig_applied_at == T0


# ---------------------------------------------------------------------------------------------
# Another writer reverting a label


def revert_loop(label: str, value: str, gaps: list[float]) -> list[AgentDecision]:
    """The agent writes, sees its value, another writer reverts it after each gap."""
    other = "slice-1" if label == DP else OLD
    n = node(dp=other if label == DP else "slice-4", mig=other if label == MIG else NEW)
    state = AgentState()
    now = T0
    decisions = []
    for gap in gaps:
        d = turn(n, policy=MigChangePolicy.FORCE, state=state, now=now)
        decisions.append(d)
        state = d.state
        n = applied(n, d)
        now += 1
        seen = turn(n, policy=MigChangePolicy.FORCE, state=state, now=now)
        decisions.append(seen)
        state = seen.state
        n = replace(n, labels={**n.labels, label: other})  # reverted
        now += gap
    return decisions


@pytest.mark.parametrize(("label", "value"), [(DP, "slice-4"), (MIG, NEW)])
def test_a_label_reverted_three_times_in_ten_minutes_is_left_alone_and_reported(
    label: str, value: str
) -> None:
    decisions = revert_loop(label, value, [60.0] * 6)
    writes = [d for d in decisions if label in d.patch_labels]
    assert len(writes) == 3  # the first write and two rewrites; the third revert stands
    conflicts = [d for d in decisions if label in d.conflicts]
    assert conflicts
    events = [e for d in decisions for e in d.events]
    assert [e.reason for e in events].count(NodeEventReason.LABEL_CONFLICT) == 1
    errors = [e for d in decisions for e in d.errors]
    assert errors.count(ReconcileError.LABEL_CONFLICT) == 1


def test_reverts_spread_over_more_than_ten_minutes_are_corrected_each_time() -> None:
    gap = REVERT_WINDOW_SECONDS / 2 + 1
    decisions = revert_loop(DP, "slice-4", [gap] * 6)
    assert len([d for d in decisions if DP in d.patch_labels]) == 6
    assert not any(d.conflicts for d in decisions)


def test_a_new_desired_value_ends_a_conflict() -> None:
    decisions = revert_loop(DP, "slice-4", [60.0] * 4)
    state = decisions[-1].state
    n = node(dp="slice-1", mig=NEW)
    assert turn(n, state=state, now=T0 + 300).patch_labels == {}
    fresh = turn(n, desired={DP: "slice-8"}, state=state, now=T0 + 301)
    assert fresh.patch_labels == {DP: "slice-8"}


def test_a_slow_watch_is_not_a_revert() -> None:
    n = node(dp="slice-1", mig=NEW)
    state = AgentState()
    writes = 0
    for i in range(10):
        d = turn(n, state=state, now=T0 + i)  # the Node view has not caught up yet
        writes += DP in d.patch_labels
        state = d.state
    assert writes == 1
    assert not state.labels[DP].reverts
    # Still not there after the settle time: written again (and counted, a lost write).
    late = turn(n, state=state, now=T0 + WRITE_SETTLE_SECONDS)
    assert late.patch_labels == {DP: "slice-4"}
    assert len(late.state.labels[DP].reverts) == 1


# ---------------------------------------------------------------------------------------------
# A label that flips: the rule changes with the labels it sets (a chain validation cannot see)


FLIP = {DP: ("slice-2", "slice-4"), MIG: (OLD, NEW)}
CHANGE_LIMIT = 4
"""docs/design.md, Sharing config: a label the agent changed 4 times in 10 minutes is held."""


def flip_loop(
    label: str, turns: int, *, gap: float = 1.0, generation: Callable[[int], int] | None = None
) -> tuple[list[AgentDecision], list[float]]:
    """Each turn the node's rule wants the other value of ``label`` than the Node carries (as
    when a rule selects on a label another controller derives from this one); mig-manager
    reports ``success`` on the turn after each mig write. Returns the decisions and the times
    of the label's writes. ``generation``: turn → the config generation in force, or None
    (not given to ``reconcile``)."""
    first, second = FLIP[label]
    n = node(dp="slice-2", mig=OLD)
    state = AgentState()
    decisions: list[AgentDecision] = []
    writes: list[float] = []
    now = T0
    for i in range(turns):
        other = second if n.labels.get(label) == first else first
        decide = functools.partial(
            reconcile,
            desired={label: other},
            node=n,
            gpu_pods=0,
            policy=MigChangePolicy.FORCE,
            allow_eviction=False,
            state=state,
            now=now,
        )
        d = decide() if generation is None else decide(config_generation=generation(i))
        decisions.append(d)
        if label in d.patch_labels:
            writes.append(now)
        state = d.state
        n = applied(n, d)
        n = with_state(n, "pending" if MIG in d.patch_labels else "success")
        now += gap
    return decisions, writes


@pytest.mark.parametrize("label", [DP, MIG])
def test_a_label_that_flips_every_turn_is_held_after_the_change_limit_and_reported(
    label: str,
) -> None:
    """A rule over a label that changes with the one it sets flipped the label (and, for the
    mig label, re-partitioned the GPUs) every turn for ever: 29 writes in 30 turns."""
    decisions, writes = flip_loop(label, 30)
    assert len(writes) == CHANGE_LIMIT, writes
    assert label in decisions[-1].conflicts
    events = [e for d in decisions for e in d.events if e.reason is NodeEventReason.LABEL_CONFLICT]
    assert len(events) == 1
    assert events[0].warning
    assert label in events[0].message
    assert f"written {CHANGE_LIMIT} times" in events[0].message
    errors = [e for d in decisions for e in d.errors]
    assert errors.count(ReconcileError.LABEL_FLAPPING) == 1


@pytest.mark.parametrize("label", [DP, MIG])
def test_no_window_ever_holds_more_than_the_change_limit_of_one_labels_writes(
    label: str,
) -> None:
    decisions, writes = flip_loop(label, 200, gap=37.0)  # 7400 s: over twelve windows
    assert len(writes) > CHANGE_LIMIT, "the hold ends once the writes leave the window"
    for start in writes:
        within = [t for t in writes if start <= t < start + REVERT_WINDOW_SECONDS]
        assert len(within) <= CHANGE_LIMIT, (start, writes)
    # Each hold is one episode: one Event and one error, not one per turn.
    holds = sum(
        1
        for before, after in itertools.pairwise(decisions)
        if label in after.conflicts and label not in before.conflicts
    )
    errors = [e for d in decisions for e in d.errors]
    assert errors.count(ReconcileError.LABEL_FLAPPING) == holds > 1


def test_a_new_sharing_config_lifts_the_hold_at_once() -> None:
    decisions, writes = flip_loop(DP, 10, generation=lambda i: 0 if i < 8 else 1)
    assert writes[CHANGE_LIMIT - 1] == T0 + CHANGE_LIMIT - 1
    assert writes[CHANGE_LIMIT] == T0 + 8, "written on the first turn under the new config"
    assert DP not in decisions[8].conflicts


def test_deliberate_changes_spread_over_the_window_are_all_written() -> None:
    """Node relabelled by an admin, each time to a pool with another profile: one write each,
    far from the limit; the fourth one within ten minutes is still written."""
    n = node(dp="slice-2", mig=NEW)
    state = AgentState()
    for i, value in enumerate(("slice-4", "slice-8", "slice-2", "slice-4")):
        d = turn(n, desired={DP: value}, state=state, now=T0 + 100 * i)
        assert d.patch_labels == {DP: value}
        assert d.conflicts == ()
        n, state = applied(n, d), d.state


def test_a_fresh_state_keeps_the_count_of_writes_it_is_given() -> None:
    """The runtime forgets what it believed after a write whose answer was lost, but keeps the
    count: such a write may have landed, and failing writes must not lift the hold."""
    decisions, _ = flip_loop(DP, 10)
    kept = AgentState(label_writes=decisions[-1].state.label_writes)
    n = node(dp="slice-4", mig=OLD)
    d = turn(n, desired={DP: "slice-2"}, state=kept, now=T0 + 11)
    assert d.patch_labels == {}
    assert d.conflicts == (DP,)


# ---------------------------------------------------------------------------------------------
# Events once per episode


def test_waiting_is_reported_once_per_episode_not_per_turn() -> None:
    n = node()
    state = AgentState()
    events: list[NodeEventReason] = []
    for i in range(5):
        d = turn(n, pods=1, state=state, now=T0 + i)
        assert d.waiting is WaitReason.GPU_PODS
        events += reasons(d)
        state = d.state
    assert events == [NodeEventReason.MIG_CHANGE_WAITING]
    d = turn(n, pods=0, state=state, now=T0 + 10)
    assert reasons(d) == [NodeEventReason.LABELS_APPLIED]
    # A later change that waits again is a new episode.
    n = with_state(applied(n, d), "success")
    d = turn(n, desired={DP: "slice-4", MIG: OLD}, pods=1, state=d.state, now=T0 + 100)
    assert reasons(d) == [NodeEventReason.MIG_CHANGE_WAITING]


def test_event_types_follow_the_design() -> None:
    warnings = {
        r for r in NodeEventReason if r.value in ("MigChangeFailed", "SharingLabelConflict")
    }
    d = turn(node(state="failed", mig=NEW, cordon="agent"), state=AgentState(started=True))
    assert all(e.warning == (e.reason in warnings) for e in d.events)
    assert not turn(node(dp=None)).events[0].warning


def test_a_conflict_ends_when_the_other_writer_comes_round_to_the_desired_value() -> None:
    decisions = revert_loop(DP, "slice-4", [60.0] * 4)
    state = decisions[-1].state
    assert state.labels[DP].conflict
    agreed = turn(node(dp="slice-4", mig=NEW), state=state, now=T0 + 300)
    assert agreed.conflicts == ()
    assert not agreed.state.labels[DP].conflict


def test_a_node_without_the_agents_cordon_starts_with_nothing_in_progress() -> None:
    for n in (node(), node(cordon="admin"), node(mig=NEW, state="pending")):
        assert AgentState.from_node(n, now=T0) == AgentState(started=True)
    busy = AgentState.from_node(node(mig=NEW, state="rebooting", cordon="agent"), now=T0)
    assert (busy.mig_applied_at, busy.mig_seen_busy) == (T0, True)


@pytest.mark.parametrize(
    "later",
    [
        pytest.param({}, id="the rule stops matching"),
        pytest.param({MIG: "all-3g.40gb"}, id="a newer desired value"),
        pytest.param({MIG: None}, id="the rule no longer sets mig"),
    ],
)
def test_a_written_mig_change_is_awaited_even_when_the_desired_value_goes_away(
    later: dict[str, str | None],
) -> None:
    """Review finding: with the desired value gone right after the write, the agent used to
    lift its cordon at once while mig-manager had not even started (state still success)."""
    n = node(cordon="agent")
    d = turn(n, policy=MigChangePolicy.CORDON, state=AgentState(started=True))
    assert d.patch_labels.get(MIG) == NEW
    n, state = applied(n, d), d.state
    for i in range(1, 10):  # within mig-manager's pick-up window, the old success is stale
        d = turn(n, desired=later, policy=MigChangePolicy.CORDON, state=state, now=T0 + i)
        assert d.cordon is None, "cordon lifted before mig-manager picked the change up"
        assert MIG not in d.patch_labels, "a new value written before the last one settled"
        assert d.waiting is WaitReason.MIG_APPLYING
        state = d.state
    n = with_state(n, "pending")
    d = turn(n, desired=later, policy=MigChangePolicy.CORDON, state=state, now=T0 + 11)
    assert d.cordon is None
    n, state = with_state(n, "failed"), d.state
    d = turn(n, desired=later, policy=MigChangePolicy.CORDON, state=state, now=T0 + 12)
    assert reasons(d).count(NodeEventReason.MIG_CHANGE_FAILED) == 1
    assert d.errors.count(ReconcileError.MIG_CHANGE_FAILED) == 1
    if later.get(MIG) == "all-3g.40gb":
        # The newer change starts under the cordon already there (failed is not busy).
        assert d.patch_labels.get(MIG) == "all-3g.40gb"
        assert d.cordon is None
    else:
        assert d.cordon is CordonAction.UNCORDON


# -- a label whose NVIDIA ConfigMap cannot be read -------------------------------------------------

HELD = HeldLabel(value=NEW, reason="rule 'a100' sets mig 'all-1g.10gb', but … (config_map_missing)")


@pytest.mark.parametrize("policy", POLICIES)
def test_a_held_label_is_never_written_reported_once_and_the_other_label_still_applies(
    policy: MigChangePolicy,
) -> None:
    n = node(dp="slice-2")
    state = AgentState()
    reports = []
    for i in range(4):
        d = turn(
            n,
            desired={DP: "slice-4"},
            held={MIG: HELD},
            policy=policy,
            allow_eviction=True,
            state=state,
            now=T0 + i * WRITE_SETTLE_SECONDS,
        )
        assert MIG not in d.patch_labels
        assert d.cordon is None
        assert not d.evict_gpu_pods
        assert d.waiting is WaitReason.NVIDIA_CONFIG_MISSING
        reports.append(d)
        n, state = applied(n, d), d.state
    assert reports[0].patch_labels == {DP: "slice-4"}
    held = [e for d in reports for e in d.events if e.reason is NodeEventReason.CONFIG_INVALID]
    assert len(held) == 1
    assert held[0].warning
    assert held[0].message.startswith(
        f"{MIG} left at '{OLD}', not set to '{NEW}': rule 'a100' sets mig"
    )
    assert [e for d in reports for e in d.errors] == [ReconcileError.NVIDIA_CONFIG_MISSING]


def test_a_held_label_the_node_already_has_needs_nothing() -> None:
    d = turn(node(mig=NEW), desired={DP: "slice-4"}, held={MIG: HELD}, policy=MigChangePolicy.FORCE)
    assert d.patch_labels == {}
    assert d.events == ()
    assert d.errors == ()
    assert d.waiting is None


def test_a_mig_change_in_wait_keeps_its_reason_over_a_held_time_slicing_label() -> None:
    d = turn(node(), desired={MIG: NEW}, held={DP: replace(HELD, value="slice-8")}, pods=1)
    assert d.patch_labels == {}
    assert d.waiting is WaitReason.GPU_PODS
    assert d.errors == (ReconcileError.NVIDIA_CONFIG_MISSING,)
    assert {e.reason for e in d.events} == {
        NodeEventReason.MIG_CHANGE_WAITING,
        NodeEventReason.CONFIG_INVALID,
    }


# ---------------------------------------------------------------------------------------------
# An admin's uncordon and cordon during a change; a drain's deadline and what it never evicts


def _applying() -> tuple[NodeView, AgentState]:
    """The agent cordoned, wrote the mig label, and mig-manager is applying it."""
    n = node(mig=NEW, state="pending", cordon="agent")
    state = AgentState(started=True, mig_applied_at=T0, mig_applied_value=NEW, mig_seen_busy=True)
    return n, state


@pytest.mark.parametrize("admin", ["uncordon", "uncordon_then_cordon", "take_over"])
def test_an_admin_cordon_mid_change_is_never_lifted_and_the_marker_goes_at_once(
    admin: str,
) -> None:
    n, state = _applying()
    if admin == "uncordon":
        n = replace(n, unschedulable=False, unschedulable_by_gpuguard=False)
    else:  # the marker is left; spec.unschedulable is another manager's (or shared)
        n = replace(n, unschedulable_by_gpuguard=False)
    d = turn(n, policy=MigChangePolicy.CORDON, state=state, now=T0 + 5)
    assert d.cordon is CordonAction.FORGET, "the marker goes mid-change"
    assert d.waiting is WaitReason.MIG_APPLYING
    told = [e.message for e in d.events if "will lift no cordon" in e.message]
    assert len(told) == 1
    n = applied(n, d)
    again = turn(n, policy=MigChangePolicy.CORDON, state=d.state, now=T0 + 6)
    assert again.cordon is None, "not cordoned again once mig-manager applies"
    assert again.events == ()
    done = turn(
        with_state(n, "success"), policy=MigChangePolicy.CORDON, state=again.state, now=T0 + 7
    )
    assert done.cordon is None, "nothing of the agent's to lift"


def test_an_uncordon_before_the_change_is_written_is_cordoned_again_and_reported() -> None:
    n = node(cordon="agent")
    waiting = turn(n, pods=1, policy=MigChangePolicy.CORDON)
    assert waiting.waiting is WaitReason.GPU_PODS
    lifted = replace(n, unschedulable=False, unschedulable_by_gpuguard=False)  # kubectl uncordon
    d = turn(lifted, pods=1, policy=MigChangePolicy.CORDON, state=waiting.state, now=T0 + 1)
    assert d.cordon is CordonAction.CORDON
    assert [e.message for e in d.events if "cordoning again" in e.message]
    assert MIG not in d.patch_labels


def test_a_drain_evicts_until_its_deadline_then_reports_once_and_waits() -> None:
    n = node(cordon="agent")
    drain = MigChangePolicy.DRAIN
    first = turn(n, pods=1, policy=drain, allow_eviction=True)
    assert first.evict_gpu_pods
    before = turn(
        n,
        pods=1,
        policy=drain,
        allow_eviction=True,
        state=first.state,
        now=T0 + DRAIN_DEADLINE_SECONDS - 1,
    )
    assert before.evict_gpu_pods
    past = turn(
        n,
        pods=1,
        policy=drain,
        allow_eviction=True,
        state=before.state,
        now=T0 + DRAIN_DEADLINE_SECONDS,
    )
    assert not past.evict_gpu_pods
    assert past.errors == (ReconcileError.DRAIN_TIMEOUT,)
    assert past.waiting is WaitReason.GPU_PODS
    later = turn(
        n,
        pods=1,
        policy=drain,
        allow_eviction=True,
        state=past.state,
        now=T0 + 2 * DRAIN_DEADLINE_SECONDS,
    )
    assert (later.evict_gpu_pods, later.errors) == (False, ())
    # Another desired value is another change: a drain of its own.
    other = turn(
        n,
        desired={MIG: "all-3g.40gb"},
        pods=1,
        policy=drain,
        allow_eviction=True,
        state=later.state,
        now=T0 + 2 * DRAIN_DEADLINE_SECONDS + 1,
    )
    assert other.evict_gpu_pods


def test_pods_a_drain_never_evicts_are_named_once_as_what_the_change_waits_for() -> None:
    n = node(cordon="agent")
    names = ("DaemonSet team/dcgm (pod team/dcgm-1)",)
    d1 = reconcile(
        desired=WANT,
        node=n,
        gpu_pods=1,
        policy=MigChangePolicy.DRAIN,
        allow_eviction=True,
        state=AgentState(),
        now=T0,
        unevictable=names,
    )
    d2 = reconcile(
        desired=WANT,
        node=n,
        gpu_pods=1,
        policy=MigChangePolicy.DRAIN,
        allow_eviction=True,
        state=d1.state,
        now=T0 + 1,
        unevictable=names,
    )
    told = [e.message for e in d1.events if "never evicts" in e.message]
    assert len(told) == 1
    assert names[0] in told[0]
    assert not [e for e in d2.events if "never evicts" in e.message]
    assert d1.waiting is d2.waiting is WaitReason.GPU_PODS
    assert MIG not in d2.patch_labels
