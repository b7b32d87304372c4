"""Hypothesis stateful test: random interleavings never produce a signal that breaks DESIGN §4.

The model is a node with a tiny cyclic PID space (so PIDs are reused constantly), processes that
start, grow, exit and leak their memory to a ghost entry NVML keeps listing, pods added, updated,
deleted and recreated with the same name (new UID), and an API server that goes up and down.
After every ``decide()`` the oracle checks each signal against the *ground truth* (who really
owns each byte NVML lists), not against what ``decide()`` could see:

- the pod is in the synced, fresh pod snapshot, on this node, not exempt, not gpuguard's own;
- the GPU sample is fresh;
- the pod's true usage on that device, in this sample and the previous fresh one, is known and
  over its limit;
- the targeted container belongs to that pod.

Modelled assumption (documented in docs/safety.md): a PID freed after the last GPU sample is not
handed to a new process before the next one. The kernel allocates PIDs cyclically (idr_alloc_cyclic
up to ``pid_max``, 4194304 on 64-bit systemd hosts), so a reuse needs ``pid_max`` forks; the model
keeps a six-PID space but lets a PID come back only after a poll has seen its owner go.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpuguard.core.model import (
    Attribution,
    ContainerId,
    EnforcementPolicy,
    GpuProcess,
    LimitPolicy,
    LimitValue,
    Mode,
    Pod,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    Runtime,
)
from gpuguard.core.policy import Decision, EnforcerState, decide
from tests.fakes import GiB, cgroup_of, gpu, sample

PIDS = list(range(300, 306))  # six PIDs: reuse is the norm, not the exception
DEVICES = [gpu(0, total=16 * GiB), gpu(1, total=16 * GiB)]
STALENESS = 3.0
POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE,
    grace_seconds=1.0,
    termination_timeout_seconds=1.0,
    staleness_seconds=STALENESS,
    limits=LimitPolicy(exempt_namespaces=frozenset({"kube-system"})),
    self_pod_uid=PodUid("gpuguard-self-0000-0000-000000000000"),
)
ALLOC = st.sampled_from([0, 1 * GiB, 3 * GiB, 6 * GiB, None])


@dataclass
class Proc:
    pid: int
    start: int
    pod_uid: PodUid | None
    container: ContainerId | None
    gpu: int
    alloc: int | None  # 0: GPU not open; None: NVML says N/A
    alive: bool = True


@dataclass
class Ghost:
    pid: int
    owner_pod: PodUid | None
    gpu: int
    used: int | None


@dataclass
class World:
    procs: list[Proc] = field(default_factory=list)
    ghosts: list[Ghost] = field(default_factory=list)
    pods: dict[str, Pod] = field(default_factory=dict)  # by name
    generation: int = 0
    next_pid: int = 0
    ticks: int = 1000
    now: float = 0.0
    api_up: bool = True
    synced: bool = False
    last_contact: float | None = None
    died_since_sample: set[int] = field(default_factory=set)


class EnforcerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World()
        self.state = EnforcerState()
        self.seq = 0
        self.last_sample_at = 0.0
        self.last_entries: list[tuple[int, int, int | None, PodUid | None]] = []
        self.history: list[dict[tuple[PodUid, int], int | None]] = []
        self.signals = 0

    @initialize(greedy=ALLOC, synced=st.booleans())
    def start(self, greedy: int | None, synced: bool) -> None:
        """Three pods; often a synced cache and a process of pod a that may be over its limit,
        so that signals (and the paths after them) are common, not rare."""
        for name in ("a", "b", "c"):
            self._put_pod(name, "team", 4 * GiB)
        self.w.synced = synced
        self.start_process("a", 0, greedy)

    # -- pods and the API server ------------------------------------------------------------

    def _put_pod(self, name: str, namespace: str, limit: int | None) -> None:
        self.w.generation += 1
        uid = PodUid(f"{self.w.generation:08d}-0000-4000-8000-{abs(hash(name)) % 10**12:012d}")
        self.w.pods[name] = Pod(
            uid=uid,
            namespace=namespace,
            name=name,
            containers={ContainerId(f"{self.w.generation:064x}"): "main"},
            annotation_limit=None if limit is None else LimitValue(limit_bytes=limit),
        )

    @rule(
        name=st.sampled_from(["a", "b", "c", "d"]),
        namespace=st.sampled_from(["team", "team", "kube-system"]),
        limit=st.sampled_from([1 * GiB, 4 * GiB, 8 * GiB, None]),
    )
    def recreate_pod(self, name: str, namespace: str, limit: int | None) -> None:
        """Delete and recreate with the same name: a new UID, never confused with the old."""
        self._put_pod(name, namespace, limit)

    @rule(name=st.sampled_from(["a", "b", "c"]), limit=st.sampled_from([1 * GiB, 8 * GiB]))
    def update_limit(self, name: str, limit: int) -> None:
        pod = self.w.pods.get(name)
        if pod is not None:
            self.w.pods[name] = Pod(
                uid=pod.uid,
                namespace=pod.namespace,
                name=pod.name,
                containers=pod.containers,
                annotation_limit=LimitValue(limit_bytes=limit),
            )

    @rule(name=st.sampled_from(["a", "b", "c", "d"]))
    def delete_pod(self, name: str) -> None:
        self.w.pods.pop(name, None)

    @rule(up=st.booleans())
    def api(self, up: bool) -> None:
        self.w.api_up = up

    # -- processes --------------------------------------------------------------------------

    def _free_pid(self) -> int | None:
        live = {p.pid for p in self.w.procs if p.alive} | self.w.died_since_sample
        for _ in PIDS:
            pid = PIDS[self.w.next_pid % len(PIDS)]
            self.w.next_pid += 1
            if pid not in live:
                return pid
        return None

    @rule(
        pod=st.sampled_from(["a", "b", "c", "d", None]), gpu_i=st.sampled_from([0, 1]), alloc=ALLOC
    )
    def start_process(self, pod: str | None, gpu_i: int, alloc: int | None) -> None:
        pid = self._free_pid()
        if pid is None:
            return
        p = self.w.pods.get(pod) if pod else None
        self.w.ticks += 1
        self.w.procs.append(
            Proc(
                pid=pid,
                start=self.w.ticks,
                pod_uid=p.uid if p else None,
                container=next(iter(p.containers)) if p else None,
                gpu=gpu_i,
                alloc=alloc,
            )
        )

    @rule(i=st.integers(0, 20), alloc=ALLOC)
    def change_alloc(self, i: int, alloc: int | None) -> None:
        live = [p for p in self.w.procs if p.alive]
        if live:
            live[i % len(live)].alloc = alloc

    @rule(i=st.integers(0, 20), leak=st.booleans())
    def exit_process(self, i: int, leak: bool) -> None:
        live = [p for p in self.w.procs if p.alive]
        if live:
            p = live[i % len(live)]
            p.alive = False
            self.w.died_since_sample.add(p.pid)
            if leak and p.alloc != 0:
                self.w.ghosts.append(Ghost(pid=p.pid, owner_pod=p.pod_uid, gpu=p.gpu, used=p.alloc))

    @rule(i=st.integers(0, 20))
    def release_ghost(self, i: int) -> None:
        if self.w.ghosts:
            self.w.ghosts.pop(i % len(self.w.ghosts))

    # -- one enforcement cycle ----------------------------------------------------------------

    @rule(dt=st.sampled_from([0.25, 0.5, 1.0, 1.0, 4.0]), fresh=st.booleans(), sync=st.booleans())
    def poll(self, dt: float, fresh: bool, sync: bool) -> None:
        w = self.w
        w.now += dt
        w.synced = w.synced or sync
        if w.api_up:
            w.last_contact = w.now
        if fresh or self.seq == 0:
            self.seq += 1
            self.last_sample_at = w.now
            self.last_entries = self._nvml_entries()
            w.died_since_sample.clear()
            truth = self._truth(self.last_entries)
            self.history.append(truth)
        procs = [
            GpuProcess(pid=pid, device=DEVICES[g].key, used_bytes=used)
            for pid, g, used, _owner in self.last_entries
        ]
        s = sample(self.seq, self.last_sample_at, DEVICES, procs)
        attributions = {pid: self._attribute(pid) for pid, *_ in self.last_entries}
        snap = PodSnapshot(
            synced=w.synced,
            last_contact_at=w.last_contact,
            pods={p.uid: p for p in w.pods.values()},
        )
        d = decide(
            sample=s,
            attributions=attributions,
            pods=snap,
            node=_node(),
            policy=POLICY,
            state=self.state,
            now=w.now,
        )
        self.state = d.state
        self._check(d, snap)

    @rule()
    def poll_steadily(self) -> None:
        """The common case, weighted up: a fresh sample half a second later, API healthy."""
        self.poll(0.5, fresh=True, sync=True)

    @rule()
    def poll_steadily_again(self) -> None:
        self.poll(0.5, fresh=True, sync=True)

    def _nvml_entries(self) -> list[tuple[int, int, int | None, PodUid | None]]:
        entries = [
            (p.pid, p.gpu, p.alloc, p.pod_uid) for p in self.w.procs if p.alive and p.alloc != 0
        ]
        entries += [(g.pid, g.gpu, g.used, g.owner_pod) for g in self.w.ghosts]
        return entries

    def _truth(
        self, entries: list[tuple[int, int, int | None, PodUid | None]]
    ) -> dict[tuple[PodUid, int], int | None]:
        """Per (pod, GPU): the bytes it truly holds that NVML reports (N/A entries count 0: the
        pod holds at least this much). A pod with no entry at all maps to nothing."""
        truth: dict[tuple[PodUid, int], int | None] = {}
        for _pid, g, used, owner in entries:
            if owner is None:
                continue
            truth[(owner, g)] = (truth.get((owner, g)) or 0) + (used or 0)
        return truth

    def _attribute(self, pid: int) -> Attribution:
        occupant = next((p for p in self.w.procs if p.alive and p.pid == pid), None)
        if occupant is None:
            return Attribution.unknown(pid, "ghost")
        cgroup = (
            cgroup_of(occupant.pod_uid, occupant.container)
            if occupant.pod_uid and occupant.container
            else None
        )
        return Attribution(
            pid=pid,
            identity=ProcessIdentity(pid=pid, start_ticks=occupant.start),
            pod_uid=occupant.pod_uid,
            container_id=occupant.container,
            runtime=Runtime.CONTAINERD if occupant.container else None,
            cgroup=cgroup,
            cgroup_version=2,
            reason=None if occupant.pod_uid else "host",
            holds_gpu=occupant.alloc != 0,
        )

    def _check(self, d: Decision, snap: PodSnapshot) -> None:
        for action in d.signals:
            self.signals += 1
            event(f"signal {action.signal.value}")
            if action.target.pod.uid in {a.pod_uid for a in self.remembered_ghosts(d)}:
                event("signal charged through a ghost PID's remembered attribution")
            t = action.target
            pod = snap.pods.get(t.pod.uid)
            assert pod is not None, "signal to a pod not in the directory"
            assert snap.synced
            assert snap.last_contact_at is not None
            assert self.w.now - snap.last_contact_at <= STALENESS, "signal on a stale pod cache"
            assert self.w.now - self.last_sample_at <= STALENESS, "signal on stale GPU data"
            assert pod.namespace != "kube-system"
            assert pod.uid != POLICY.self_pod_uid
            assert t.container_id in pod.containers, "container of another pod"
            assert pod.annotation_limit is not None
            limit = pod.annotation_limit.limit_bytes
            assert limit is not None
            for truth in self.history[-2:]:
                used = truth.get((t.pod.uid, t.gpu_index))
                assert used is not None, "signal to a pod that holds no memory on that GPU"
                assert used > limit, f"wrong kill: true usage {used} <= limit {limit}"

    def remembered_ghosts(self, d: Decision) -> list[Attribution]:
        live = {p.pid for p in self.w.procs if p.alive}
        return [a for pid, a in d.state.remembered.items() if pid not in live]

    @invariant()
    def state_is_bounded(self) -> None:
        assert len(self.state.noted) <= 200


def _node():  # type: ignore[no-untyped-def]
    from gpuguard.core.model import NodeFacts

    return NodeFacts(name="node-1")


EnforcerModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEnforcerNeverSignalsWrongly = EnforcerModel.TestCase
