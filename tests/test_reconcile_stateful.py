"""Hypothesis stateful test: random worlds never make the agent's ``reconcile()`` break
docs/design.md, Sharing config.

The model is one Node: the two sharing labels, a fake mig-manager that turns
``nvidia.com/mig.config.state`` to ``pending`` whenever ``nvidia.com/mig.config`` changes and
later to ``rebooting``, ``success`` or ``failed``; GPU pods that come (only while the node is
schedulable) and go; an admin who cordons and uncordons (``kubectl uncordon`` leaves the agent's
annotation behind); another writer that reverts the labels; a sharing config whose desired values
change; PodDisruptionBudgets that block evictions; and agent restarts that throw ``AgentState``
away. The agent's decisions are executed against the model, and checked against its *ground
truth* (who really set the cordon) at the moment they are made:

- the mig label is never written while the state is ``pending``/``rebooting``;
- with ``WhenIdle``, ``Cordon`` and ``Drain`` never while a pod holds a GPU, and with ``Cordon``/
  ``Drain`` never on a schedulable node;
- the agent never uncordons a cordon it did not set, and never cordons a cordoned node (at most one
  outstanding cordon);
- evictions only under ``Drain`` with ``allowEviction``;
- once the world is quiet (no pods, no other writer, mig-manager finishing), the node carries the
  desired labels (except a label the agent reports as fought over) and no cordon of the agent's;
- a label's writes per window are bounded, whatever the rules: with self-selecting rules (the
  node's rule wants another value of a label each time it is applied, as rules over a label
  another controller derives from the agent's own do) and writers reverting it, no
  ``REVERT_WINDOW_SECONDS`` hold more than ``CHANGE_LIMIT`` changes of one label by the agent
  under one config (an agent restart starts the count afresh), and only a few rewrites of the
  same value.

Modelled assumptions: the agent's Node view is current when it decides (the adapter must patch
with the Node's resourceVersion, so a decision made on a stale view fails with a conflict and is
retried next turn).

Pods the scheduler does not place (they come even on a cordoned node) and the admin's own
cordon: a DaemonSet's GPU pod and a mirror pod (eviction only starts them again), pods that ask
for ``nvidia.com/gpu: 0``; the admin cordons a node still carrying the agent's marker (``kubectl
cordon`` after ``kubectl uncordon``) or takes the agent's cordon over (a server-side apply of
``spec.unschedulable``): ``spec.unschedulable``'s field manager is the ground truth the Node view
reports (``unschedulable_by_gpuguard``). The pods reach ``reconcile()`` through the real
translation of their manifests (``kubemodel.translate``) and evictions through the runtime's
choice (``core.agent.evictable_pods``). Further invariants:

- a DaemonSet's pod or a mirror pod is never evicted, and a pod asking for no GPU neither is
  evicted nor holds a change up (the quiet world keeps such pods and still converges);
- the agent's marker never outlives its cordon past a turn: on a schedulable node, or on a
  cordon someone else set, the turn cordons or drops the marker.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpuguard.core.agent import PodOwner, SharingInputs, evictable_pods, unevictable_pods
from gpuguard.core.model import PodRef, PodUid
from gpuguard.core.reconcile import (
    CHANGE_LIMIT,
    CORDONED_BY_AGENT,
    CORDONED_BY_ANNOTATION,
    MIG_CONFIG_STATE_LABEL,
    REVERT_LIMIT,
    REVERT_WINDOW_SECONDS,
    AgentDecision,
    AgentState,
    CordonAction,
    NodeView,
    reconcile,
)
from gpuguard.core.sharing import DEVICE_PLUGIN_CONFIG_LABEL, MIG_CONFIG_LABEL, MigChangePolicy
from gpuguard.kubemodel.translate import gpu_pod_from_json, gpu_pod_owner_from_json

DP = DEVICE_PLUGIN_CONFIG_LABEL
MIG = MIG_CONFIG_LABEL
BUSY = ("pending", "rebooting")
DP_VALUES = ("slice-2", "slice-4", "slice-8")
MIG_VALUES = ("all-disabled", "all-1g.10gb", "all-balanced")
IDLE_FIRST = (MigChangePolicy.WHEN_IDLE, MigChangePolicy.CORDON, MigChangePolicy.DRAIN)
BOUND = (CHANGE_LIMIT + 1) * REVERT_LIMIT
"""Most writes of one label in a window under one config and agent, same-value rewrites
included: each value the label changes to may be rewritten until the revert guard holds it."""


class AgentWorld(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[str, str] = {}
        self.annotations: dict[str, str] = {}
        self.unschedulable = False
        self.cordoned_by: str | None = None
        """Ground truth: who set the current cordon ("agent", "admin"), None if schedulable."""
        self.pods = 0
        self.desired: dict[str, str | None] = {}
        self.policy = MigChangePolicy.WHEN_IDLE
        self.allow_eviction = False
        self.keep_cordon_on_failure = False
        self.pdb_blocks = False
        self.other_writer = True
        self.state = AgentState()
        self.now = 1000.0
        self.last: AgentDecision | None = None
        self.daemon_pods = 0
        """GPU pods of a DaemonSet (they tolerate the cordon)."""
        self.mirror_pods = 0
        """GPU pods that are mirror pods (the kubelet's static pods)."""
        self.zero_gpu_pods = 0
        """Pods asking for ``nvidia.com/gpu: 0`` (bound by name: they run on a cordoned node)."""
        self.serial = 0
        """A new UID for every pod that (re)starts."""
        self.truths: dict[str, str] = {}
        """What each GPU pod the agent saw at its last turn really is, by name."""
        self.evictable: tuple[PodRef, ...] = ()
        """The pods the runtime would evict at the last turn."""
        self.flipping: set[str] = set()
        """Labels a self-selecting rule sets: it wants another value than the Node carries."""
        self.generation = 0
        """The sharing config in force (``reconcile``'s ``config_generation``)."""
        self.changes: dict[str, list[tuple[float, str]]] = {}
        """Per label, the agent's writes of another value than its last one, under this config
        and since its last restart."""
        self.writes: dict[str, list[float]] = {}
        """Per label, every write by the agent (same-value rewrites included), under this config
        and since its last restart."""

    @initialize(
        policy=st.sampled_from(list(MigChangePolicy)),
        allow_eviction=st.booleans(),
        keep=st.booleans(),
        dp=st.sampled_from((None, *DP_VALUES)),
        mig=st.sampled_from((None, *MIG_VALUES)),
        want_dp=st.sampled_from((None, *DP_VALUES)),
        want_mig=st.sampled_from((None, *MIG_VALUES)),
        state=st.sampled_from((None, "success", "failed", "pending")),
    )
    def setup(
        self,
        policy: MigChangePolicy,
        allow_eviction: bool,
        keep: bool,
        dp: str | None,
        mig: str | None,
        want_dp: str | None,
        want_mig: str | None,
        state: str | None,
    ) -> None:
        self.policy, self.allow_eviction = policy, allow_eviction
        self.keep_cordon_on_failure = keep
        for label, value in ((DP, dp), (MIG, mig), (MIG_CONFIG_STATE_LABEL, state)):
            if value is not None:
                self.labels[label] = value
        self.desired = {DP: want_dp, MIG: want_mig}

    # -----------------------------------------------------------------------------------------
    # The world

    def view(self) -> NodeView:
        return NodeView(
            name="gpu-1",
            labels=dict(self.labels),
            annotations=dict(self.annotations),
            unschedulable=self.unschedulable,
            unschedulable_by_gpuguard=self.unschedulable and self.cordoned_by == "agent",
        )

    def manifests(self) -> list[tuple[str, dict[str, object]]]:
        """Every pod on the node as the API server holds it, with what it really is."""
        pods: list[tuple[str, dict[str, object]]] = []
        for truth, n, gpus in (
            ("plain", self.pods, "1"),
            ("daemon", self.daemon_pods, "1"),
            ("mirror", self.mirror_pods, "1"),
            ("zero", self.zero_gpu_pods, "0"),
        ):
            for i in range(n):
                meta: dict[str, object] = {
                    "uid": f"{truth}-{i}-{self.serial}",
                    "name": f"{truth}-{i}",
                    "namespace": "team",
                }
                if truth == "daemon":
                    meta["ownerReferences"] = [
                        {"kind": "DaemonSet", "name": "dcgm", "controller": True}
                    ]
                if truth == "mirror":
                    meta["annotations"] = {"kubernetes.io/config.mirror": "x"}
                limits = {"limits": {"nvidia.com/gpu": gpus}}
                spec = {"containers": [{"name": "c", "resources": limits}]}
                pods.append((truth, {"metadata": meta, "spec": spec, "status": {}}))
        return pods

    def pod_inputs(self) -> tuple[SharingInputs, dict[str, str]]:
        """The agent's view of the pods (through the real translation), and each GPU pod's
        ground truth by name."""
        refs: list[PodRef] = []
        owners: dict[PodUid, PodOwner] = {}
        truths: dict[str, str] = {}
        for truth, manifest in self.manifests():
            ref = gpu_pod_from_json(manifest)
            if ref is not None:
                refs.append(ref)
                owners[ref.uid] = gpu_pod_owner_from_json(manifest)
                truths[ref.name] = truth
        inputs = SharingInputs(
            synced=True,
            node=self.view(),
            gpu_pods=tuple(refs),
            owners=owners,
        )
        return inputs, truths

    def set_mig(self, value: str) -> None:
        """Any writer changes the mig label: mig-manager starts (or restarts) a change."""
        if self.labels.get(MIG) != value:
            self.labels[MIG] = value
            self.labels[MIG_CONFIG_STATE_LABEL] = "pending"

    @rule(n=st.integers(1, 3))
    def gpu_pods_arrive(self, n: int) -> None:
        if not self.unschedulable:  # the scheduler honours the cordon
            self.pods += n

    @rule()
    def a_gpu_pod_finishes(self) -> None:
        self.pods = max(0, self.pods - 1)

    @rule(outcome=st.sampled_from(("rebooting", "success", "success", "failed")))
    def mig_manager_progresses(self, outcome: str) -> None:
        if self.labels.get(MIG_CONFIG_STATE_LABEL) in BUSY:
            self.labels[MIG_CONFIG_STATE_LABEL] = outcome

    @rule(label=st.sampled_from((DP, MIG)), value=st.integers(0, 2))
    def another_writer_reverts(self, label: str, value: int) -> None:
        if not self.other_writer:
            return
        if label == MIG:
            self.set_mig(MIG_VALUES[value])
        else:
            self.labels[DP] = DP_VALUES[value]

    @rule()
    def another_writer_toggles(self) -> None:
        self.other_writer = not self.other_writer

    @rule()
    def admin_cordons(self) -> None:
        if not self.unschedulable and CORDONED_BY_ANNOTATION not in self.annotations:
            self.unschedulable, self.cordoned_by = True, "admin"

    @rule()
    def admin_uncordons(self) -> None:
        """``kubectl uncordon``: any cordon, annotations left as they are."""
        self.unschedulable, self.cordoned_by = False, None

    @rule(label=st.sampled_from((DP, MIG)), value=st.sampled_from((None, 0, 1, 2)))
    def the_sharing_config_changes(self, label: str, value: int | None) -> None:
        values = DP_VALUES if label == DP else MIG_VALUES
        self.desired[label] = None if value is None else values[value]
        self.new_config()

    @rule(blocks=st.booleans())
    def a_pod_disruption_budget_changes(self, blocks: bool) -> None:
        self.pdb_blocks = blocks

    @rule()
    def the_agent_restarts(self) -> None:
        self.state = AgentState()
        self.changes, self.writes = {}, {}

    @rule(label=st.sampled_from((DP, MIG)))
    def a_self_selecting_rule_comes_in_force(self, label: str) -> None:
        """A config whose rules select on a label that changes with the one they set: every
        value applied moves the node to a rule that wants another."""
        self.flipping.add(label)
        self.new_config()

    @rule()
    def the_self_selecting_rules_are_fixed(self) -> None:
        if self.flipping:
            self.flipping.clear()
            self.new_config()

    def new_config(self) -> None:
        self.generation += 1
        self.changes, self.writes = {}, {}

    def flip(self) -> None:
        """The self-selecting rules: each wants the next value after the Node's."""
        for label in self.flipping:
            values = DP_VALUES if label == DP else MIG_VALUES
            current = self.labels.get(label)
            index = values.index(current) + 1 if current in values else 0
            self.desired[label] = values[index % len(values)]

    @rule(kind=st.sampled_from(("daemon", "mirror", "zero")))
    def a_pod_the_cordon_does_not_stop_starts(self, kind: str) -> None:
        """A DaemonSet's pod, a static pod, a pod bound by name with no GPU: even cordoned."""
        self.serial += 1
        if kind == "daemon":
            self.daemon_pods = min(2, self.daemon_pods + 1)
        elif kind == "mirror":
            self.mirror_pods = 1
        else:
            self.zero_gpu_pods = min(3, self.zero_gpu_pods + 1)

    @rule(kind=st.sampled_from(("daemon", "mirror", "zero")))
    def such_a_pod_goes(self, kind: str) -> None:
        """The admin keeps the DaemonSet off the node, removes the static pod; a pod ends."""
        if kind == "daemon":
            self.daemon_pods = 0
        elif kind == "mirror":
            self.mirror_pods = 0
        else:
            self.zero_gpu_pods = max(0, self.zero_gpu_pods - 1)

    @rule()
    def admin_cordons_over_the_agents_marker(self) -> None:
        """``kubectl cordon`` on a schedulable node that still carries the agent's marker (left
        by a ``kubectl uncordon`` the agent has not seen yet)."""
        if not self.unschedulable:
            self.unschedulable, self.cordoned_by = True, "admin"

    @rule()
    def admin_takes_the_cordon_over(self) -> None:
        """A server-side apply of ``spec.unschedulable: true``: the admin co-owns the cordon,
        which is no longer the agent's alone to lift."""
        if self.unschedulable:
            self.cordoned_by = "admin"

    # -----------------------------------------------------------------------------------------
    # The agent

    @rule(dt=st.sampled_from((1.0, 10.0, 45.0, 400.0)))
    def agent_turn(self, dt: float) -> None:
        self.now += dt
        inputs, truths = self.pod_inputs()
        self.truths = truths
        self.evictable = evictable_pods(inputs)
        self.flip()
        d = reconcile(
            desired=self.desired,
            node=self.view(),
            gpu_pods=len(inputs.gpu_pods),
            unevictable=unevictable_pods(inputs, limit=5),
            policy=self.policy,
            allow_eviction=self.allow_eviction,
            state=self.state,
            now=self.now,
            keep_cordon_on_failure=self.keep_cordon_on_failure,
            config_generation=self.generation,
        )
        self.check(d)
        self.check_bounded_writes(d)
        self.execute(d)

    def check(self, d: AgentDecision) -> None:
        """Each action against the world as it is when the agent decides."""
        assert set(d.patch_labels) <= {DP, MIG}
        for label, value in d.patch_labels.items():
            assert self.labels.get(label) != value, "writes only differences"
            assert self.desired.get(label) == value
        if MIG in d.patch_labels:
            assert self.labels.get(MIG_CONFIG_STATE_LABEL) not in BUSY
            if self.policy in IDLE_FIRST:
                assert self.pods == 0
            if self.policy in (MigChangePolicy.CORDON, MigChangePolicy.DRAIN):
                assert self.unschedulable
        if d.cordon is CordonAction.CORDON:
            assert not self.unschedulable, "never a second cordon"
        if d.cordon is CordonAction.UNCORDON:
            assert self.cordoned_by == "agent", "never lifts a cordon it did not set"
        if d.cordon is CordonAction.FORGET:
            assert self.cordoned_by != "agent", "drops only a marker without the agent's cordon"
        if CORDONED_BY_ANNOTATION in self.annotations and self.cordoned_by != "agent":
            assert d.cordon in (CordonAction.CORDON, CordonAction.FORGET), "a stale marker"
        if d.evict_gpu_pods:
            for pod in self.evictable:
                assert self.truths[pod.name] == "plain", "never a DaemonSet's or a mirror pod"
        if MIG in d.patch_labels and self.policy in IDLE_FIRST:
            assert self.pods == self.daemon_pods == self.mirror_pods == 0
        if d.evict_gpu_pods:
            assert self.policy is MigChangePolicy.DRAIN
            assert self.allow_eviction
            assert self.unschedulable

    @rule(turns=st.integers(2, 8))
    def the_agent_turns_every_second(self, turns: int) -> None:
        """The agent's own pace (a turn a second), where a flip shows within one window."""
        for _ in range(turns):
            self.agent_turn(1.0)

    def check_bounded_writes(self, d: AgentDecision) -> None:
        """A label's writes per window are bounded: at most ``CHANGE_LIMIT`` changes, and a
        few same-value rewrites (the revert guard's) on top."""
        since = self.now - REVERT_WINDOW_SECONDS
        for label, value in d.patch_labels.items():
            changes = [c for c in self.changes.get(label, []) if c[0] > since]
            if not changes or changes[-1][1] != value:
                assert len(changes) < CHANGE_LIMIT, (label, changes, value)
                changes.append((self.now, value))
            self.changes[label] = changes
            writes = [t for t in self.writes.get(label, []) if t > since] + [self.now]
            self.writes[label] = writes
            assert len(writes) <= BOUND, (label, writes)

    def execute(self, d: AgentDecision) -> None:
        self.state = d.state
        self.last = d
        for label, value in d.patch_labels.items():
            if label == MIG:
                self.set_mig(value)
            else:
                self.labels[label] = value
        if d.cordon is CordonAction.CORDON:
            self.unschedulable, self.cordoned_by = True, "agent"
            self.annotations[CORDONED_BY_ANNOTATION] = CORDONED_BY_AGENT
        elif d.cordon is CordonAction.UNCORDON:
            self.unschedulable, self.cordoned_by = False, None
            self.annotations.pop(CORDONED_BY_ANNOTATION, None)
        elif d.cordon is CordonAction.FORGET:
            self.annotations.pop(CORDONED_BY_ANNOTATION, None)
        if d.evict_gpu_pods and not self.pdb_blocks:
            self.pods = 0

    # -----------------------------------------------------------------------------------------
    # Quiet: the world settles, the agent converges

    @rule()
    def the_world_goes_quiet(self) -> None:
        self.other_writer = False
        if self.flipping:
            self.the_self_selecting_rules_are_fixed()
        self.pods = 0
        self.daemon_pods = self.mirror_pods = 0  # zero-GPU pods stay: they must not block
        for _ in range(30):
            self.agent_turn(20.0)
            if self.labels.get(MIG_CONFIG_STATE_LABEL) in BUSY:
                self.labels[MIG_CONFIG_STATE_LABEL] = "success"
        assert self.last is not None
        for label, value in self.desired.items():
            if value is not None and label not in self.last.conflicts:
                assert self.labels.get(label) == value, (label, self.labels)
        failed = self.labels.get(MIG_CONFIG_STATE_LABEL) == "failed"
        assert self.cordoned_by != "agent" or (self.keep_cordon_on_failure and failed)
        assert self.last.waiting is None or self.last.conflicts

    @invariant()
    def an_agent_annotation_only_with_or_after_its_cordon(self) -> None:
        if self.cordoned_by == "agent":
            assert self.annotations.get(CORDONED_BY_ANNOTATION) == CORDONED_BY_AGENT


TestAgentWorld = AgentWorld.TestCase
TestAgentWorld.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
