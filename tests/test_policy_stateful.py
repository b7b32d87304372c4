"""Hypothesis stateful test: random interleavings never produce a signal that breaks docs/design.md,
Safety invariants.

The model is a node with a tiny cyclic PID space (so PIDs are reused constantly), processes that
start, grow, exit and leak their memory to a ghost entry NVML keeps listing, pods added, updated,
deleted and recreated with the same name (new UID), and an API server that goes up and down.
After every ``decide()`` the oracle checks each signal against the *ground truth* (who really
owns each byte NVML lists), not against what ``decide()`` could see:

- the pod is in the synced, fresh pod snapshot, on this node, not exempt, not gpuguard's own;
- every listing the sample carries is fresh, the signalled device's and the others' (change-driven
  sampling lists devices one by one and carries the others' listings over; a sample is as old
  as its oldest listing);
- the pod's true usage on that device, in the device's last two listings (there must be two),
  is known and over its limit, however full the device is (pressure skips only the grace
  period; a SIGTERM it triggered needs the device really under pressure when the violation is
  confirmed, and the escalation's signals keep that trigger);
- the targeted container belongs to that pod, and a SIGKILL goes only to a container this
  enforcer sent SIGTERM in an earlier cycle (a container restarted mid-escalation gets its own);
- the limit it exceeds is the one the tenant's declarations *mean* (oracle tables written
  independently of the parsers: invalid, non-string, tiny and oversized values mean no limit),
  combined by the rule of docs/design.md, Limit sources, also written out independently here: every
  applicable declaration caps and the smallest binds; a pin scopes a declaration to the GPU it
  names (elsewhere it grants nothing but still caps); the namespace default only without a
  declaration; the namespace max caps all.

Pods of one namespace may name one ResourceClaim (``CLAIMS``: a DRA share of one GPU, which the
scheduler accounted once for all of them): each is held to the whole share (a cap like every
declaration, on that GPU only), and together to it (docs/dra.md, A claim shared by several pods).
A signal for such a group (``KillTarget.shared``) is checked as the group's, not the pod's: the
pod is a member, every member holds a share there and none is exempt or of unknown usage, the
limit and usage signalled are the group's budget (every distinct share its members hold) and
sum; what the claims' holders truly use there is over the budget in the device's last two
listings; and a SIGTERM goes to one of the largest users (the largest until what the others use
fits: ``largest_users``, written out independently), by the truth, or by what the enforcer may
charge where it sees less than a member truly holds (never more).

After every ``decide()`` each pod's limit on each device (``Decision.usages``) must be exactly
that limit: never above the smallest that applies, and never "unlimited" where the admin set a
default or a maximum, whatever pin a tenant wrote. And a pod the enforcer sees over that limit on
a device, through a steady stretch of fresh listings, is stopped (never refused because its
scheduler's pin names another GPU), as are the pods of a claim it sees over its share together.

Tenants are hostile: each pod is built from JSON by the real translation
(``pod_from_json``) with whatever annotation the tenant likes (any of ``HOSTILE_LIMITS``, an
unquoted number, and copies of a kube-system static pod's ``config.hash`` and ``config.mirror``),
and the snapshot is indexed by the real ``index_pods``. Tenants also write every annotation a
scheduler writes, with any value, at creation and any time after: KAI's
``gpu-memory`` / ``gpu-fraction``, HAMi's pin ``hami.io/vgpu-devices-allocated``, gpushare's pin
``ALIYUN_COM_GPU_MEM_IDX``, Volcano's names as annotations (never read), and gpuguard's own; and
at creation any container limits HAMi, gpushare and Volcano read (``limits.sources`` lists all).
A static pod's processes carry its hash in their cgroups; their memory must never be charged to
a tenant that copied it.

Processes may close their GPU files and keep their memory: the fd check then says
"no GPU open", and they still own what NVML lists under their PID. Each process carries its start
time, just after the poll before it started, so the start-time rule (an occupant that started
after its PID was first listed owns none of it) meets ghost PIDs handed to new processes.

The enforcer restarts (a fresh ``EnforcerState``): its history of each listed PID is gone. The
one charge the ground truth does not justify and the oracle accepts is the residual risk of
docs/safety.md: memory listed under a PID charged to the pod of a live occupant that started
before the restarted enforcer's first listing of that PID (a dead process's PID handed over
before the restart), at once when it holds a GPU file open and after ``owner_settle_seconds``
without one, never sooner, and never without the restart (the taint rule).

Some sequences the rules can compose are also each one step (the rules under "scenarios"),
so that most examples contain them: ``scripts/mutations.py`` switches each safety rule of
``decide()`` off in turn, and this test alone must fail every time (docs/safety.md, Measured),
but for the re-reads of DRA claims: every claim here was read after any moment the model reaches
(``CLAIM_READ_AT``), and ``tests/test_policy_dra.py`` holds those rules.

Modelled assumption (documented in docs/safety.md): a PID freed after the last GPU sample is not
handed to a new process before the next one. The kernel allocates PIDs cyclically (idr_alloc_cyclic
up to ``pid_max``, 4194304 on 64-bit systemd hosts), so a reuse needs ``pid_max`` forks; the model
keeps a six-PID space but lets a PID come back only after a poll has seen its owner go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpuguard.core.dra_shares import share_order
from gpuguard.core.model import (
    Attribution,
    ContainerId,
    Declaration,
    DeviceKey,
    DeviceMemory,
    DraShare,
    EnforcementPolicy,
    GpuProcess,
    KillTarget,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Listing,
    Mode,
    NamespacePolicy,
    NodeFacts,
    Pod,
    PodRef,
    PodSnapshot,
    PodUid,
    ProcessIdentity,
    RefusalReason,
    Runtime,
    StopSignal,
    Trigger,
    index_pods,
)
from gpuguard.core.policy import (
    SHARED_TRACK_PREFIX,
    Decision,
    EnforcerState,
    Phase,
    PodUsage,
    SignalAction,
    UsageState,
    decide,
)
from gpuguard.kubemodel.translate import pod_from_json
from tests.fakes import GiB, cgroup_of, gpu, sample

PIDS = list(range(300, 306))  # six PIDs: reuse is the norm, not the exception
DEVICES = [gpu(0, total=16 * GiB), gpu(1, total=16 * GiB)]
NODE = NodeFacts(name="node-1")
STALENESS = 3.0
POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE,
    grace_seconds=1.0,
    termination_timeout_seconds=1.0,
    staleness_seconds=STALENESS,
    limits=LimitPolicy(
        exempt_namespaces=frozenset({"kube-system"}),
        sources=("gpuguard", "kai", "hami", "gpushare", "volcano", "dra"),
        namespaces={
            "team": NamespacePolicy(
                default_limit=LimitValue(limit_bytes=6 * GiB),
                max_limit=LimitValue(limit_bytes=8 * GiB),
            )
        },
    ),
    self_pod_uid=PodUid("gpuguard-self-0000-0000-000000000000"),
)
ADMIN: dict[str, tuple[int | None, int | None]] = {"team": (6 * GiB, 8 * GiB)}
"""(default, max) per namespace, as ``POLICY`` says: ``default`` and ``kube-system`` have none."""
DEVICE_BYTES = 16 * GiB
ALLOC = st.sampled_from([0, 1 * GiB, 3 * GiB, 6 * GiB, None])
FREE = st.sampled_from([None, 0, 100 * 2**20, 1 * GiB, 8 * GiB])
"""Free memory the fast read reports (None: not read): 0 and 100 MiB are pressure on 16 GiB."""
STATIC_HASH = "5c1b0e6a9d2f4e3b8a7c6d5e4f3a2b1c"
LIMIT_KEY = "gpuguard.io/gpu-memory-limit"

HOSTILE_LIMITS: dict[object, int | None] = {
    # What each annotation value means on a 16 GiB device, written without the parser.
    "1Gi": 1 * GiB,
    "4Gi": 4 * GiB,
    "8Gi": 8 * GiB,
    "25%": 4 * GiB,
    "4294967296": 4 * GiB,
    "16": None,  # 16 bytes: below 1 MiB, never a limit
    "1023Ki": None,
    "0": None,
    "-1Gi": None,
    "8GB": None,
    "8 Gi": None,
    " 1Gi": None,
    "1Gi\n": None,
    "\uff11Gi": None,  # a full-width digit
    "0.0000000001%": None,  # resolves to 17 bytes
    "150%": None,
    "1" * 65: None,  # longer than 64 characters
    "1" * 4096 + "x": None,
    8: None,  # unquoted YAML: not a string
    1.5: None,
    None: None,  # annotation absent
}
COPY_HASH = st.sampled_from(["none", "hash", "mirror"])

# What each scheduler's value means on a 16 GiB device, written without the parsers (None:
# invalid or below 1 MiB, never a limit). Keys are what the tenant writes.
KAI: dict[tuple[tuple[str, object], ...], int | None] = {
    (): None,  # no KAI annotation
    (("gpu-memory", "2048"),): 2 * GiB,
    (("gpu-memory", "20000"),): 20000 * 2**20,  # above the device
    (("gpu-memory", "0"),): None,
    (("gpu-memory", "2Gi"),): None,  # bytes where MiB are meant
    (("gpu-memory", 4096),): None,  # not a string
    (("gpu-fraction", "0.25"),): 4 * GiB,
    (("gpu-fraction", "0.125"),): 2 * GiB,
    (("gpu-fraction", "1"),): 16 * GiB,
    (("gpu-fraction", "1.5"),): None,
    (("gpu-fraction", "50%"),): None,
    (("gpu-fraction", "0.00000001"),): None,  # 171 bytes
    (("gpu-fraction", "0.5"), ("gpu-memory", "1024")): None,  # both: KAI takes one
}
HAMI_MEMORY: dict[tuple[str, str] | None, int | None] = {
    None: None,  # no HAMi container limit
    ("nvidia.com/gpumem", "1024"): 1 * GiB,
    ("nvidia.com/gpumem", "3k"): 3000 * 2**20,
    ("nvidia.com/gpumem", "20000"): 20000 * 2**20,
    ("nvidia.com/gpumem", "0"): None,
    ("nvidia.com/gpumem", "2Gi"): None,
    ("nvidia.com/gpumem-percentage", "25"): 4 * GiB,
    ("nvidia.com/gpumem-percentage", "150"): None,
}
U0, U1 = DEVICES[0].uuid, DEVICES[1].uuid
_M, _S, _G = (
    "nvidia.com/container.main.",
    "nvidia.com/container.side.",
    "nvidia.com/container.ghost.",
)
KAI_CONTAINERS: dict[tuple[tuple[str, object], ...], tuple[int | None, frozenset[int] | None]] = {
    # KAI's per-container keys (the pod's containers are ``main``, whose processes the model
    # runs, and ``side``): (the smallest valid value, or None: invalid or none; the GPU indices
    # the binder's pin names, or None: no pin). A key for a container the pod lacks (``ghost``)
    # declares nothing; a key per container never adds up: each caps the pod.
    (): (None, None),
    ((_M + "gpu-memory.limit", "3Gi"),): (3 * GiB, None),
    ((_M + "gpu-memory.request", "2Gi"),): (2 * GiB, None),
    ((_M + "gpu-memory.request", "2Gi"), (_M + "gpu-memory.limit", "5Gi")): (5 * GiB, None),
    ((_M + "gpu-memory.request", "9Gi"), (_M + "gpu-memory.limit", "5Gi")): (5 * GiB, None),
    ((_M + "gpu-memory.limit", "1024M"),): (977 * 2**20, None),  # rounded up to whole MiB
    ((_M + "gpu-memory.limit", "0"),): (None, None),
    ((_M + "gpu-memory.limit", "4GB"),): (None, None),
    ((_M + "gpu-memory.limit", "512Ki"),): (None, None),  # below 1 MiB
    ((_M + "gpu-memory.limit", 4096),): (None, None),  # not a string
    ((_M + "gpu-memory.limit", "100Gi"),): (100 * GiB, None),  # above the device
    ((_M + "gpu-memory.limit", "3Gi"), (_M + "gpus.devices", U1)): (3 * GiB, frozenset({1})),
    ((_M + "gpu-memory.limit", "12Gi"), (_M + "gpus.devices", U0)): (12 * GiB, frozenset({0})),
    ((_M + "gpu-memory.limit", "12Gi"), (_M + "gpus.devices", f"{U0},{U1}"),
     ("gpu-fraction-num-devices", "2")): (12 * GiB, frozenset({0, 1})),
    ((_M + "gpu-memory.limit", "3Gi"), (_M + "gpus.devices", "junk")): (3 * GiB, None),
    ((_G + "gpu-memory.limit", "15Gi"),): (None, None),
    ((_M + "gpu-memory.limit", "3Gi"), (_S + "gpu-memory.limit", "3Gi")): (3 * GiB, None),
    ((_M + "gpu-memory.limit", "5Gi"), (_S + "gpu-memory.limit", "2Gi")): (2 * GiB, None),
    ((_M + "gpu-memory.limit", "5Gi"), (_S + "gpu-memory.limit", "0")): (5 * GiB, None),
    ((_S + "gpu-memory.request", "7Gi"),): (7 * GiB, None),
    ((_M + "gpu-memory.limit", "3Gi"), (_G + "gpu-memory.limit", "15Gi"),
     ("gpu-fraction-num-devices", "99999")): (3 * GiB, None),
}  # fmt: skip
HAMI_PINS: dict[object, frozenset[int] | None] = {
    # GPU indices on this node the pin names; frozenset(): pinned to none here; None: no pin.
    None: None,
    f"{U0},NVIDIA,3000,0:;": frozenset({0}),
    f"{U1},NVIDIA,3000,0:;": frozenset({1}),
    f"{U0},NVIDIA,3000,0:{U1},NVIDIA,3000,0:;": frozenset({0, 1}),
    "GPU-ffffffff-0000-0000-0000-000000000000,NVIDIA,1,0:;": frozenset(),
    "all of them": None,
    7: None,  # not a string
}
GPUSHARE_MEMORY: dict[str | None, int | None] = {
    None: None, "1": 1 * GiB, "3": 3 * GiB, "0": None, "x": None,
}  # fmt: skip
GPUSHARE_PINS: dict[object, frozenset[int] | None] = {
    None: None,
    "0": frozenset({0}),
    "1": frozenset({1}),
    "01": frozenset({1}),
    "7": frozenset(),
    "x": None,
    "-1": None,
    1: None,  # not a string
}
VOLCANO_MEMORY: dict[str | None, int | None] = {None: None, "2048": 2 * GiB, "0": None}
VOLCANO_ANNOTATIONS = [None, "1", "99999"]
"""Volcano's container-limit names written as annotations: never read (the limits are)."""
CLAIMS: dict[str, tuple[int, int]] = {"shared": (0, 4 * GiB), "pool": (1, 4 * GiB)}
"""ResourceClaims a pod may name (``resourceClaimName``): the GPU DRA allocated each one's share
on, and the share's memory. A claim lives in one namespace, so the pods of one namespace naming
it share one share, which the scheduler accounted once for all of them (docs/dra.md, A claim
shared by several pods); the allocation is the scheduler's, never the tenant's to change."""
CLAIM_READ_AT = 1e9
"""When the directory last read every claim: after any moment the model reaches, so a violation
never waits for a read (the re-read rule is ``tests/test_policy_dra.py``'s)."""


def claim_share(namespace: str, claim: str) -> DraShare:
    """The share of ``namespace``'s claim ``claim``, as ``adapters.kube.dra_claims`` reads it."""
    gpu_i, memory = CLAIMS[claim]
    return DraShare(
        claim_namespace=namespace,
        claim_name=claim,
        request="gpu",
        driver="gpu.nvidia.com",
        pool="node-1",
        device=f"gpu-{gpu_i}",
        share_id="s1",
        memory_bytes=memory,
        uuid=DEVICES[gpu_i].uuid,
        pods_sharing=3,
    )


@dataclass(frozen=True)
class Tenant:
    """What a tenant wrote on its pod: annotations (any time) and container limits (at
    creation, immutable after)."""

    limit: object = None
    kai: tuple[tuple[str, object], ...] = ()
    kai_containers: tuple[tuple[str, object], ...] = ()
    hami_pin: object = None
    share_pin: object = None
    volcano_note: str | None = None
    copy_hash: str = "none"
    hami: tuple[str, str] | None = None
    share: str | None = None
    volcano: str | None = None
    claim: str | None = None
    """The ResourceClaim of ``CLAIMS`` the pod names (in its own namespace), set at creation."""

    def annotations(self) -> dict[str, object]:
        out: dict[str, object] = {} if self.limit is None else {LIMIT_KEY: self.limit}
        out.update(self.kai)
        out.update(self.kai_containers)
        if self.hami_pin is not None:
            out["hami.io/vgpu-devices-allocated"] = self.hami_pin
        if self.share_pin is not None:
            out["ALIYUN_COM_GPU_MEM_IDX"] = self.share_pin
        if self.volcano_note is not None:
            out["volcano.sh/vgpu-memory"] = self.volcano_note
            out["volcano.sh/vgpu-memory-percentage"] = self.volcano_note
        if self.copy_hash in ("hash", "mirror"):
            out["kubernetes.io/config.hash"] = STATIC_HASH
        if self.copy_hash == "mirror":
            out["kubernetes.io/config.mirror"] = STATIC_HASH
        return out

    def container_limits(self) -> dict[str, str]:
        out = {"nvidia.com/gpu": "1"}
        if self.hami is not None:
            out[self.hami[0]] = self.hami[1]
        if self.share is not None:
            out["aliyun.com/gpu-mem"] = self.share
        if self.volcano is not None:
            out["volcano.sh/vgpu-memory"] = self.volcano
        return out

    def declarations(self) -> list[tuple[int, frozenset[int] | None]]:
        """(bytes, the GPUs its pin names or None) of each valid declaration."""
        own, kai_pins = KAI_CONTAINERS[self.kai_containers]
        found = [
            (HOSTILE_LIMITS[self.limit], None),
            (KAI[self.kai], kai_pins),  # the binder's pin places KAI's pod-wide value too
            (own, kai_pins),
            (HAMI_MEMORY[self.hami], HAMI_PINS[self.hami_pin]),
            (GPUSHARE_MEMORY[self.share], GPUSHARE_PINS[self.share_pin]),
            (VOLCANO_MEMORY[self.volcano], None),
        ]
        return [(value, pins) for value, pins in found if value is not None]

    def pinned_elsewhere(self, gpu: int) -> bool:
        return any(pins is not None and gpu not in pins for _, pins in self.declarations())


def expected_limit(tenant: Tenant, namespace: str, gpu: int) -> int | None:
    """docs/design.md, Limit sources, written out without ``core.limits``: the pod's limit on
    ``gpu``. A DRA share caps like every declaration on the GPU it was allocated on, and grants
    and caps nothing on another (an allocation is not pod metadata)."""
    here = [v for v, pins in tenant.declarations() if pins is None or gpu in pins]
    if tenant.claim is not None and CLAIMS[tenant.claim][0] == gpu:
        here.append(CLAIMS[tenant.claim][1])
    elsewhere = [v for v, pins in tenant.declarations() if pins is not None and gpu not in pins]
    default, maximum = ADMIN.get(namespace, (None, None))
    caps = [min(here) if here else default, *elsewhere, maximum]
    limit = min((c for c in caps if c is not None), default=None)
    return None if limit is not None and limit > DEVICE_BYTES else limit


def track_key(t: KillTarget) -> tuple[PodUid, DeviceKey]:
    """Where ``decide()`` tracks the violation ``t`` stops: its pod's, or its share group's
    (``SHARED_TRACK_PREFIX`` and the first shared share)."""
    if t.shared is None:
        return (t.pod.uid, t.device)
    return (PodUid(SHARED_TRACK_PREFIX + "/".join(share_order(t.dra_shares[0]))), t.device)


def largest_users(pods: Iterable[PodRef], used: Mapping[PodUid, int], budget: int) -> set[PodUid]:
    """docs/dra.md, A claim shared by several pods, written out without ``core.dra_shares``: of
    pods over a budget together, the largest users (ties by namespace, name and UID) until what
    the others use fits it."""
    left = sum(used[p.uid] for p in pods)
    chosen: set[PodUid] = set()
    for p in sorted(pods, key=lambda p: (-used[p.uid], p.namespace, p.name, p.uid)):
        if left <= budget:
            break
        chosen.add(p.uid)
        left -= used[p.uid]
    return chosen


SCHEDULED = st.builds(
    Tenant,
    limit=st.sampled_from(list(HOSTILE_LIMITS)),
    kai=st.sampled_from(list(KAI)),
    kai_containers=st.sampled_from(list(KAI_CONTAINERS)),
    hami_pin=st.sampled_from(list(HAMI_PINS)),
    share_pin=st.sampled_from(list(GPUSHARE_PINS)),
    volcano_note=st.sampled_from(VOLCANO_ANNOTATIONS),
    copy_hash=COPY_HASH,
    hami=st.sampled_from(list(HAMI_MEMORY)),
    share=st.sampled_from(list(GPUSHARE_MEMORY)),
    volcano=st.sampled_from(list(VOLCANO_MEMORY)),
    claim=st.sampled_from([None, None, *CLAIMS]),
)
TENANTS = st.one_of(
    st.builds(Tenant, limit=st.sampled_from(list(HOSTILE_LIMITS)), copy_hash=COPY_HASH),
    SCHEDULED,
)


Entry = tuple[int, int, int | None, PodUid | None]
"""One line of a device's listing: (PID, GPU index, used bytes or None, the pod that truly
holds them)."""


@dataclass
class Proc:
    pid: int
    start: int
    pod_uid: PodUid | None
    """The pod UID its cgroup carries (a static pod's hash for a static pod's process)."""
    owner: PodUid | None
    """The pod that truly holds its memory (``metadata.uid``)."""
    container: ContainerId | None
    gpu: int
    alloc: int | None  # 0: GPU not open; None: NVML says N/A
    alive: bool = True
    started_at: float = 0.0
    """When it started: just after the poll before it was spawned (model time)."""
    closed: bool = False
    """It closed its GPU files and kept its memory, or opened them in a thread with its own
    file table: the fd check says False."""
    mps: bool = False
    """An MPS client of a daemon its own pod started (MPS undeclared: it spares nothing)."""


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
    tenants: dict[PodUid, Tenant] = field(default_factory=dict)
    """What each pod's tenant wrote, by UID (``expected_limit`` says what it means)."""
    namespaces: dict[PodUid, str] = field(default_factory=dict)
    """Each pod's namespace, by UID, deleted pods' too (their processes may run on)."""


class EnforcerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World()
        self.state = EnforcerState()
        self.seq = 0
        # Per GPU (change-driven sampling lists each device on its own): its last listing's
        # entries, when it was taken and by which sample, and the entries of every listing.
        self.entries: dict[int, list[Entry]] = {}
        self.listings: dict[int, Listing] = {}
        self.history: dict[int, list[list[Entry]]] = {0: [], 1: []}
        self.free: dict[int, int | None] = {0: None, 1: None}
        self.signals = 0
        self.last: Decision | None = None
        # What the running enforcer has seen, as the model follows it (a restart forgets it):
        self.first_listed: dict[int, float] = {}
        """Per listed PID, when the enforcer first listed it in the PID's current unbroken run
        of listings (``owner_settle_seconds`` counts from here)."""
        self.residual: dict[int, set[PodUid]] = {}
        """Per listed PID, the pods the residual risk of docs/safety.md lets the enforcer charge
        everything listed under it for: the pod of an occupant that started before the
        enforcer's first listing of the PID (only after a restart can that be a new process
        handed a dead one's PID), once it holds a GPU file or ``owner_settle_seconds`` passed."""
        self.sigterm_sent: set[ContainerId] = set()
        """Containers this enforcer has sent SIGTERM: only they may get SIGKILL."""
        self.last_occupant: dict[int, PodUid] = {}
        """Per listed PID, the pod of its last live occupant that started before the PID's first
        listing: its ghost may be charged to that pod once the PID is settled."""
        self.pod_runs: dict[PodUid, tuple[float, float]] = {}
        """Per pod, (since, last) of the enforcer's run of listings of its processes (gaps of
        at most ``owner_settle_seconds``): a pod listed that long owns its processes' memory."""

    @initialize(
        greedy=ALLOC,
        synced=st.booleans(),
        static=ALLOC,
        free=FREE,
        first=SCHEDULED,
        gpu_i=st.sampled_from([0, 1]),
    )
    def start(
        self,
        greedy: int | None,
        synced: bool,
        static: int | None,
        free: int | None,
        first: Tenant,
        gpu_i: int,
    ) -> None:
        """Three pods; often a synced cache and a process of pod a that may be over its limit,
        so that signals (and the paths after them) are common, not rare. Pod a often carries
        schedulers' fields (and pins) from the start, so that they meet its memory."""
        self._put_pod("a", "team", first)
        for name in ("b", "c"):
            self._put_pod(name, "team", Tenant(limit="4Gi"))
        self._put_static_pod()
        self.w.synced = synced
        self.free[0] = free
        self.start_process("a", gpu_i, greedy, "open")
        self.start_process("etcd", 0, static, "open")

    # -- pods and the API server ------------------------------------------------------------

    def _put_pod(self, name: str, namespace: str, tenant: Tenant) -> None:
        """Create (or recreate: new UID) a pod from JSON through the real translation."""
        self.w.generation += 1
        uid = PodUid(f"{self.w.generation:08d}-0000-4000-8000-{abs(hash(name)) % 10**12:012d}")
        cid = f"{self.w.generation:064x}"
        self._store(uid, name, namespace, tenant, {ContainerId(cid): "main"})

    def _store(
        self,
        uid: PodUid,
        name: str,
        namespace: str,
        tenant: Tenant,
        containers: dict[ContainerId, str],
    ) -> None:
        pod = pod_from_json(
            {
                "metadata": {
                    "uid": uid, "name": name, "namespace": namespace,
                    "annotations": tenant.annotations(),
                },
                "spec": {"containers": [
                    {"name": "main", "resources": {"limits": tenant.container_limits()}},
                    {"name": "side"},
                ]},
                "status": {"containerStatuses": [
                    {"name": n, "containerID": f"containerd://{c}"} for c, n in containers.items()
                ]},
            }
        )  # fmt: skip
        assert pod is not None
        if tenant.claim is not None:
            # What the pod directory adds from the claim (pod_from_json reads no claims).
            claimed = Declaration(
                where=f"resourceClaim {tenant.claim}",
                shares=(claim_share(namespace, tenant.claim),),
                read_at=CLAIM_READ_AT,
            )
            pod = dataclasses.replace(pod, declared={**pod.declared, LimitSource.DRA: claimed})
        self.w.pods[name] = pod
        self.w.tenants[pod.uid] = tenant
        self.w.namespaces[pod.uid] = namespace

    def _put_static_pod(self) -> None:
        """A kube-system static pod: its mirror pod's annotations name the hash its cgroups
        carry (``cgroup_uid``), not its UID."""
        self._put_pod("etcd", "kube-system", Tenant(copy_hash="mirror"))

    @rule(
        name=st.sampled_from(["a", "b", "c", "d"]),
        namespace=st.sampled_from(["team", "team", "default", "kube-system"]),
        tenant=TENANTS,
    )
    def recreate_pod(self, name: str, namespace: str, tenant: Tenant) -> None:
        """Delete and recreate with the same name: a new UID, never confused with the old. The
        tenant picks any annotation, including a static pod's hash and any scheduler's fields
        (container limits are fixed from here on, as the API server keeps them)."""
        self._put_pod(name, namespace, tenant)

    def _rewrite(self, name: str, **annotations: Any) -> None:
        """The tenant patches its running pod's annotations (UID and containers unchanged)."""
        pod = self.w.pods.get(name)
        if pod is not None:
            self.w.generation += 1
            tenant = dataclasses.replace(self.w.tenants[pod.uid], **annotations)
            self._store(pod.uid, pod.name, pod.namespace, tenant, dict(pod.containers))

    @rule(name=st.sampled_from(["a", "b", "c"]), limit=st.sampled_from(list(HOSTILE_LIMITS)))
    def update_limit(self, name: str, limit: object) -> None:
        self._rewrite(name, limit=limit)

    @rule(
        name=st.sampled_from(["a", "b", "c", "d"]),
        kai=st.sampled_from(list(KAI)),
        kai_containers=st.sampled_from(list(KAI_CONTAINERS)),
        hami_pin=st.sampled_from(list(HAMI_PINS)),
        share_pin=st.sampled_from(list(GPUSHARE_PINS)),
        volcano_note=st.sampled_from(VOLCANO_ANNOTATIONS),
    )
    def rewrite_scheduler_annotations(
        self,
        name: str,
        kai: tuple[tuple[str, object], ...],
        kai_containers: tuple[tuple[str, object], ...],
        hami_pin: object,
        share_pin: object,
        volcano_note: str | None,
    ) -> None:
        """After scheduling, the tenant writes what its scheduler writes: any KAI value (its
        per-container keys, for its container or one it does not have, and the binder's pin),
        a pin naming any GPU (or none here), Volcano's names as annotations."""
        self._rewrite(
            name, kai=kai, kai_containers=kai_containers, hami_pin=hami_pin,
            share_pin=share_pin, volcano_note=volcano_note,
        )  # fmt: skip

    @rule(name=st.sampled_from(["a", "b", "c", "d"]))
    def delete_pod(self, name: str) -> None:
        self.w.pods.pop(name, None)

    @rule(up=st.booleans())
    def api(self, up: bool) -> None:
        self.w.api_up = up

    # -- processes --------------------------------------------------------------------------

    def _unlisted_pid(self) -> int | None:
        """A PID no process holds and NVML does not list (a ghost's PID would taint its new
        occupant, which the scenarios below do on purpose only)."""
        taken = {p.pid for p in self.w.procs if p.alive} | self.w.died_since_sample
        taken |= {g.pid for g in self.w.ghosts}
        return next((pid for pid in PIDS if pid not in taken), None)

    def _free_pid(self) -> int | None:
        live = {p.pid for p in self.w.procs if p.alive} | self.w.died_since_sample
        for _ in PIDS:
            pid = PIDS[self.w.next_pid % len(PIDS)]
            self.w.next_pid += 1
            if pid not in live:
                return pid
        return None

    @rule(
        pod=st.sampled_from(["a", "b", "c", "d", "etcd", None]),
        gpu_i=st.sampled_from([0, 1]),
        alloc=ALLOC,
        files=st.sampled_from(["open", "open", "hidden", "mps"]),
    )
    def start_process(self, pod: str | None, gpu_i: int, alloc: int | None, files: str) -> None:
        """A new process; its GPU files open, hidden from the fd check (opened in a thread with
        its own file table), or none at all: an MPS client of a daemon its tenant started."""
        pid = self._free_pid()
        if pid is not None:
            p = self._spawn(pid, self.w.pods.get(pod) if pod else None, gpu_i, alloc)
            p.closed = files != "open"
            p.mps = files == "mps"

    def _spawn(self, pid: int, p: Pod | None, gpu_i: int, alloc: int | None) -> Proc:
        """A new process with ``pid`` in ``p``'s (first) container, or on the host."""
        self.w.ticks += 1
        proc = Proc(
            pid=pid,
            start=self.w.ticks,
            pod_uid=(PodUid(STATIC_HASH) if p.config_hash else p.uid) if p else None,
            owner=p.uid if p else None,
            container=next(iter(p.containers)) if p else None,
            gpu=gpu_i,
            alloc=alloc,
            started_at=self.w.now + 0.001,
        )
        self.w.procs.append(proc)
        return proc

    @rule(i=st.integers(0, 20))
    def close_gpu_files(self, i: int) -> None:
        """A live process closes every GPU file and keeps its memory: it still owns it."""
        live = [p for p in self.w.procs if p.alive and p.alloc != 0]
        if live:
            live[i % len(live)].closed = True

    @rule(i=st.integers(0, 20), alloc=ALLOC)
    def change_alloc(self, i: int, alloc: int | None) -> None:
        live = [p for p in self.w.procs if p.alive]
        if live:
            live[i % len(live)].alloc = alloc

    @rule(i=st.integers(0, 20), leak=st.booleans())
    def exit_process(self, i: int, leak: bool) -> None:
        live = [p for p in self.w.procs if p.alive]
        if live:
            self._exit(live[i % len(live)], leak=leak)

    def _exit(self, p: Proc, *, leak: bool) -> None:
        """``p`` dies; with ``leak`` a forked child keeps its memory, listed under its PID."""
        p.alive = False
        self.w.died_since_sample.add(p.pid)
        if leak and p.alloc != 0:
            self.w.ghosts.append(Ghost(pid=p.pid, owner_pod=p.owner, gpu=p.gpu, used=p.alloc))

    @rule(i=st.integers(0, 20))
    def release_ghost(self, i: int) -> None:
        if self.w.ghosts:
            self.w.ghosts.pop(i % len(self.w.ghosts))

    @rule(i=st.integers(0, 20), pod=st.sampled_from(["a", "b", "c", "d"]), alloc=ALLOC)
    def hand_a_ghosts_pid_to_a_new_process(self, i: int, pod: str, alloc: int | None) -> None:
        """The kernel hands a ghost's PID (its process dead, NVML still listing its memory) to a
        new process of a pod, GPU file open or not. ``start_process`` can do this by chance;
        this rule makes it common, so that a charge of the ghost's memory to the new occupant
        (the taint rule switched off, ``scripts/mutations.py``) shows as a wrong kill."""
        p = self.w.pods.get(pod)
        live = {q.pid for q in self.w.procs if q.alive} | self.w.died_since_sample
        ghosts = [g for g in self.w.ghosts if g.pid not in live]
        if p is None or not ghosts:
            return
        g = ghosts[i % len(ghosts)]
        self._spawn(g.pid, p, g.gpu, alloc)

    # -- the enforcer -------------------------------------------------------------------------

    def _restart_enforcer(self) -> None:
        """A new enforcer process: everything ``decide()`` and the model's view of it kept is
        gone (its listings of PIDs, escalations, SIGTERMs sent)."""
        self.state = EnforcerState()
        self.first_listed = {}
        self.residual = {}
        self.sigterm_sent = set()
        self.last_occupant = {}
        self.pod_runs = {}

    @rule(sync=st.booleans())
    def enforcer_restarts(self, sync: bool) -> None:
        """The enforcer restarts (a rollout, an OOM kill) and its first sample lists every
        device. A PID NVML lists whose occupant started before that listing is charged like
        any process: at once with a GPU file open, after ``owner_settle_seconds`` without one
        (the residual risk of docs/safety.md, which the oracle accepts, and only then)."""
        self._restart_enforcer()
        self.poll(0.5, fresh=(True, True), sync=sync)

    # -- scenarios: whole sequences as one likely step ------------------------------------------
    # Each is a sequence the rules above can compose, made one step so that most examples
    # contain it: without them the model meets each only in some runs (scripts/mutations.py
    # measured it), and a rule it alone exercises could break unnoticed.

    @rule(
        pods=st.sampled_from([("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")]),
        gpu_i=st.sampled_from([0, 1]),
        holds=st.sampled_from(["open", "none", "closed"]),
        restart=st.booleans(),
    )
    def a_ghosts_pid_goes_to_a_new_process(
        self, pods: tuple[str, str], gpu_i: int, holds: str, restart: bool
    ) -> None:
        """A process of pod A dies leaving 6 GiB listed under its PID (a forked child holds
        it), a poll sees it go, and the kernel hands the PID to a new process of pod B (limit
        1 GiB) that holds a GPU file (1 GiB), none (nothing of its own listed) or closed its
        files (1 GiB listed); the enforcer may restart right then. Without the restart the
        taint rule keeps B uncharged; after it, B is charged at once with a GPU file open and
        only after ``owner_settle_seconds`` without one (the ``holds_gpu`` check)."""
        pid = self._unlisted_pid()
        if pid is None:
            return
        a, b = pods
        self._put_pod(a, "default", Tenant())  # no limit: only the ghost's owner
        self._put_pod(b, "team", Tenant(limit="1Gi"))
        self.w.api_up = True
        old = self._spawn(pid, self.w.pods[a], gpu_i, 6 * GiB)
        self.poll_steadily()
        self._exit(old, leak=True)
        self.poll_steadily()  # sees it go: the PID may be handed over
        new = self._spawn(pid, self.w.pods[b], gpu_i, 0 if holds == "none" else 1 * GiB)
        new.closed = holds == "closed"
        event(f"scenario: ghost's PID handed over, GPU file {holds}, restart {restart}")
        if restart:
            self._restart_enforcer()
        for _ in range(4):
            self.poll_steadily()

    def _over_its_limit(self, name: str, namespace: str, gpu_i: int) -> bool:
        """Pod ``name`` created anew (limit 1 GiB) with a 3 GiB process on GPU ``gpu_i``, the
        API server healthy; False when no PID is free."""
        pid = self._unlisted_pid()
        if pid is None:
            return False
        self._put_pod(name, namespace, Tenant(limit="1Gi"))
        self._spawn(pid, self.w.pods[name], gpu_i, 3 * GiB)
        self.w.api_up = True
        return True

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def a_kube_system_pod_over_the_limit_its_tenant_wrote(self, name: str, gpu_i: int) -> None:
        """Exempt namespaces are never stopped, whatever limit their pods carry."""
        if self._over_its_limit(name, "kube-system", gpu_i):
            event("scenario: kube-system pod over its own limit")
            self.hold_steady()

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def a_container_restarts_while_it_is_stopped(self, name: str, gpu_i: int) -> None:
        """A pod over its limit is sent SIGTERM; its container restarts before the termination
        timeout (its processes gone with its cgroup; a new container ID and process, still
        over): the new container gets a SIGTERM of its own, never the escalation's SIGKILL."""
        if not self._over_its_limit(name, "team", gpu_i):
            return
        for _ in range(3):
            self.poll_steadily()  # two listings and the grace period: SIGTERM
        pod = self.w.pods[name]
        old = set(pod.containers)
        for p in self.w.procs:
            if p.alive and p.container in old:
                self._exit(p, leak=False)
        self.w.generation += 1
        fresh = {ContainerId(f"{self.w.generation:064x}"): "main"}
        self._store(pod.uid, pod.name, pod.namespace, self.w.tenants[pod.uid], fresh)
        pid = self._unlisted_pid()
        if pid is None:
            return
        self._spawn(pid, self.w.pods[name], gpu_i, 3 * GiB)
        event("scenario: container restarted mid-escalation")
        for _ in range(3):
            self.poll_steadily()

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def only_the_other_device_is_listed_after_a_violation(self, name: str, gpu_i: int) -> None:
        """A violation shows in one listing of its device; for 1.5 s only the other device's
        memory moves, so only it is listed again: one listing, however many samples carry it,
        confirms nothing."""
        if not self._over_its_limit(name, "team", gpu_i):
            return
        self.poll(0.5, fresh=(True, True), sync=True)
        event("scenario: a violation's listing carried, the other device listed")
        for _ in range(3):
            self.poll(0.5, fresh=(gpu_i == 1, gpu_i == 0), sync=True)

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def the_other_devices_listing_goes_stale_while_a_violation_is_confirmed(
        self, name: str, gpu_i: int
    ) -> None:
        """Both devices listed; then a violation starts on one device, which alone is listed
        again, 1.75 s apart: its second fresh listing and the grace period come when the other
        device's listing, carried over, is 3.5 s old. The sample is as old as its oldest
        listing: past the staleness bound, nothing is confirmed."""
        self.poll(0.5, fresh=(True, True), sync=True)
        if not self._over_its_limit(name, "team", gpu_i):
            return
        event("scenario: the other device's listing carried past the staleness bound")
        for _ in range(2):
            self.poll(1.75, fresh=(gpu_i == 0, gpu_i == 1), sync=True)

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def a_pod_rotates_short_lived_processes_that_hide_their_gpu_files(
        self, name: str, gpu_i: int
    ) -> None:
        """Pod ``name`` (limit 1 GiB) keeps three 1 GiB processes alive, each for 1.5 s (under
        the 5 s settle) and each with its GPU files hidden from the fd check, one started every
        half second: no PID ever settles, yet its processes are listed without a break, so the
        pod is stopped within the scenario (the per-pod settle)."""
        self.poll_steadily()  # a ghost released since the last poll is delisted first
        self._put_pod(name, "team", Tenant(limit="1Gi"))
        self.w.api_up = True
        pod = self.w.pods[name]
        started: list[tuple[Proc, int]] = []
        for step in range(20):
            for p, born in started:
                if p.alive and step - born >= 3:
                    self._exit(p, leak=False)
            pid = self._unlisted_pid()
            if pid is None:
                return
            p = self._spawn(pid, pod, gpu_i, 1 * GiB)
            p.closed = True
            started.append((p, step))
            self.poll_steadily()
            assert self.last is not None
            if any(a.target.pod.uid == pod.uid for a in self.last.signals):
                event("scenario: a pod rotating hidden short-lived processes: stopped")
                return
        raise AssertionError("a pod rotating short-lived processes was never stopped")

    @rule(name=st.sampled_from(["a", "b", "c", "d"]), gpu_i=st.sampled_from([0, 1]))
    def a_process_that_hides_its_gpu_files_forks_and_exits_before_it_settles(
        self, name: str, gpu_i: int
    ) -> None:
        """Pod ``name`` (limit 1 GiB): a 3 GiB process whose GPU files the fd check never sees
        exits after one listing, a forked child keeping its memory listed under its PID. The
        ghost nobody holds is charged to the pod once listed for the settle time, and the pod
        is stopped within the scenario."""
        self.poll_steadily()  # a ghost released since the last poll is delisted first
        if not self._over_its_limit(name, "team", gpu_i):
            return
        pod = self.w.pods[name]
        hider = next(p for p in reversed(self.w.procs) if p.owner == pod.uid)
        hider.closed = True
        self.poll_steadily()
        self._exit(hider, leak=True)
        for _ in range(20):
            self.poll_steadily()
            assert self.last is not None
            if any(a.target.pod.uid == pod.uid for a in self.last.signals):
                event("scenario: a hidden-file process's ghost: stopped")
                return
        raise AssertionError("the ghost of a process that hid its GPU files was never charged")

    @rule(
        tenant=st.sampled_from(["a", "b"]),
        neighbour=st.sampled_from(["c", "d"]),
        gpu_i=st.sampled_from([0, 1]),
    )
    def a_tenant_starts_an_mps_client_of_its_own(
        self, tenant: str, neighbour: str, gpu_i: int
    ) -> None:
        """A tenant's MPS client (100 MiB, a daemon it started: MPS is not declared) beside a
        neighbour over its limit on the same GPU: the neighbour is still stopped."""
        pid = self._unlisted_pid()
        if pid is None:
            return
        self._put_pod(tenant, "default", Tenant())
        client = self._spawn(pid, self.w.pods[tenant], gpu_i, 100 * 2**20)
        client.closed = client.mps = True
        if self._over_its_limit(neighbour, "team", gpu_i):
            event("scenario: a tenant's own MPS client beside a neighbour over its limit")
            self.hold_steady()

    @rule(
        names=st.sampled_from([("a", "b", "c", "d"), ("b", "c", "d", "a"), ("c", "d", "a", "b")]),
        namespace=st.sampled_from(["team", "team", "default", "kube-system"]),
        claim=st.sampled_from(list(CLAIMS)),
        used=st.sampled_from(
            [(3.5, 2, 2), (2, 2, 1), (3, 3, 3), (1, 1, 2), (2, 1, 1), (3.5, 2, None)]
        ),
    )
    def three_pods_share_a_claim(
        self,
        names: tuple[str, str, str, str],
        namespace: str,
        claim: str,
        used: tuple[float, float, float | None],
    ) -> None:
        """Three pods of one namespace name one claim (a 4 GiB share) and each uses at most the
        share (in GiB: ``used``, None: NVML reports N/A), a fourth pod names none. Over the
        share together, the largest users are stopped until what the others use fits, and only
        they, within the scenario; fitting it (exactly the share too), in an exempt namespace
        or with a usage unknown, none of them is signalled."""
        for name in names[:3]:
            self._put_pod(name, namespace, Tenant(claim=claim))
        self._put_pod(names[3], namespace, Tenant())
        self.w.api_up = True
        live = [q for q in self.w.procs if q.alive]
        for q in live[: max(0, len(live) - (len(PIDS) - 3))]:
            self._exit(q, leak=False)  # the oldest make room for three PIDs
        self.w.ghosts.clear()
        self.poll_steadily()  # sees them go (and the claim's group of before, if any, ends)
        gpu_i, share_bytes = CLAIMS[claim]
        pods = [self.w.pods[name] for name in names[:3]]
        for p, gib in zip(pods, used, strict=True):
            pid = self._unlisted_pid()
            assert pid is not None
            self._spawn(pid, p, gpu_i, None if gib is None else int(gib * GiB))
        truth = {p.uid: int((gib or 0) * GiB) for p, gib in zip(pods, used, strict=True)}
        refs = [PodRef(uid=p.uid, namespace=p.namespace, name=p.name) for p in pods]
        if namespace == "kube-system" or None in used or sum(truth.values()) <= share_bytes:
            stopped: set[PodUid] = set()
            why = "exempt" if namespace == "kube-system" else "unknown" if None in used else "fit"
        else:
            stopped, why = largest_users(refs, truth, share_bytes), "over"
        event(f"scenario: three pods share a claim, {why}")
        signalled: set[PodUid] = set()
        for _ in range(4):
            self.poll_steadily()
            assert self.last is not None
            signalled |= {a.target.pod.uid for a in self.last.signals if a.target.pod.uid in truth}
        assert signalled == stopped, f"{why}: stopped {signalled}, the largest are {stopped}"

    # -- one enforcement cycle ----------------------------------------------------------------

    @rule(gpu=st.integers(0, 1), free=FREE)
    def device_fills(self, gpu: int, free: int | None) -> None:
        """The device's memory as the fast read sees it: any level, pressure or none, whatever
        the listings say (other tenants, the driver, a read between two listings)."""
        self.free[gpu] = free

    @rule(
        dt=st.sampled_from([0.05, 0.25, 0.5, 1.0, 1.0, 4.0]),
        fresh=st.sampled_from([(True, True), (True, False), (False, True), (False, False)]),
        sync=st.booleans(),
    )
    def poll(self, dt: float, fresh: tuple[bool, bool], sync: bool) -> None:
        """One cycle; ``fresh`` says which devices are listed again (change-driven sampling
        lists only the devices whose memory moved and carries the others' listings over)."""
        w = self.w
        w.now += dt
        w.synced = w.synced or sync
        if w.api_up:
            w.last_contact = w.now
        listed = [g for g in (0, 1) if fresh[g] or g not in self.listings]
        if listed:
            self.seq += 1
            now_entries = self._nvml_entries()
            for g in listed:
                self.entries[g] = [e for e in now_entries if e[1] == g]
                self.listings[g] = Listing(seq=self.seq, taken_at=w.now)
                self.history[g].append(self.entries[g])
            if len(self.listings) == 2 and len(listed) == 2:
                w.died_since_sample.clear()
        entries = [e for g in (0, 1) for e in self.entries.get(g, [])]
        clients = {p.pid for p in w.procs if p.alive and p.mps}
        procs = [
            GpuProcess(pid=pid, device=DEVICES[g].key, used_bytes=used, mps_client=pid in clients)
            for pid, g, used, _owner in entries
        ]
        served = {p.device for p in procs if p.mps_client}  # NVML lists MPS clients there
        devices = [dataclasses.replace(d, mps=d.key in served) for d in DEVICES]
        s = dataclasses.replace(
            sample(self.seq, w.now, devices, procs),
            listings={DEVICES[g].key: listing for g, listing in self.listings.items()},
            memory={
                DEVICES[g].key: DeviceMemory(
                    total_bytes=16 * GiB, used_bytes=16 * GiB - free, free_bytes=free
                )
                for g, free in self.free.items()
                if free is not None
            },
        )
        attributions = {pid: self._attribute(pid) for pid, *_ in entries}
        snap = PodSnapshot(
            synced=w.synced,
            last_contact_at=w.last_contact,
            pods=index_pods(w.pods.values()),
        )
        d = decide(
            sample=s,
            attributions=attributions,
            pods=snap,
            node=NODE,
            policy=POLICY,
            state=self.state,
            now=w.now,
        )
        before, self.state = self.state, d.state
        self.last = d
        if d.enforcement_active:
            self._follow_listings(entries)
        self._check(d, snap, before)
        self._check_limits(d)

    @rule()
    def poll_steadily(self) -> None:
        """The common case, weighted up: a fresh sample half a second later, API healthy."""
        self.poll(0.5, fresh=(True, True), sync=True)

    @rule()
    def poll_steadily_again(self) -> None:
        self.poll(0.5, fresh=(True, True), sync=True)

    @rule()
    def poll_fast(self) -> None:
        """The fast path: both devices listed again 50 ms later (under pressure this is what
        confirms a violation without the grace period)."""
        self.poll(0.05, fresh=(True, True), sync=True)

    def _nvml_entries(self) -> list[tuple[int, int, int | None, PodUid | None]]:
        entries = [
            (p.pid, p.gpu, p.alloc, p.owner) for p in self.w.procs if p.alive and p.alloc != 0
        ]
        entries += [(g.pid, g.gpu, g.used, g.owner_pod) for g in self.w.ghosts]
        return entries

    def _follow_listings(self, entries: list[Entry]) -> None:
        """After an active cycle: when the enforcer first listed each PID of this sample (the
        earliest listing carrying it; a PID no longer listed starts over), and which pods the
        residual risk now lets it charge for each PID (never a pod whose process started after
        that first listing: the taint rule)."""
        first: dict[int, float] = {}
        for pid, g, _used, _owner in entries:
            taken = self.listings[g].taken_at
            first[pid] = min(first.get(pid, taken), taken)
        self.first_listed = {pid: self.first_listed.get(pid, at) for pid, at in first.items()}
        self.residual = {pid: pods for pid, pods in self.residual.items() if pid in first}
        self.last_occupant = {p: uid for p, uid in self.last_occupant.items() if p in first}
        settle = POLICY.owner_settle_seconds
        owners: dict[int, PodUid] = {}
        for pid, _g, _used, owner in entries:
            occupant = next((p for p in self.w.procs if p.alive and p.pid == pid), None)
            if occupant is not None and occupant.owner is not None:
                if occupant.started_at <= self.first_listed[pid]:
                    owners[pid] = occupant.owner
            elif owner is not None:
                owners[pid] = owner
            elif pid in self.last_occupant:
                owners[pid] = self.last_occupant[pid]
        runs: dict[PodUid, tuple[float, float]] = {}
        for uid in set(owners.values()):
            before = self.pod_runs.get(uid)
            kept = before is not None and self.w.now - before[1] <= settle + 1e-9
            runs[uid] = (before[0] if kept and before else self.w.now, self.w.now)
        runs.update(
            {
                u: r
                for u, r in self.pod_runs.items()
                if u not in runs and self.w.now - r[1] <= settle
            }
        )
        # The enforcer's run starts at the listing that first showed the pod: allow for it.
        self.pod_runs = runs
        for pid, since in self.first_listed.items():
            occupant = next((p for p in self.w.procs if p.alive and p.pid == pid), None)
            if occupant is None or occupant.owner is None or occupant.started_at > since:
                if occupant is None and pid in self.last_occupant and self.w.now - since >= settle:
                    self.residual.setdefault(pid, set()).add(self.last_occupant[pid])
                continue
            self.last_occupant[pid] = occupant.owner
            holds_gpu = occupant.alloc != 0 and not occupant.closed
            run = self.pod_runs.get(occupant.owner)
            pod_settled = run is not None and self.w.now - run[0] >= settle
            if holds_gpu or pod_settled or self.w.now - since >= settle:
                self.residual.setdefault(pid, set()).add(occupant.owner)

    def _usage(self, listing: list[Entry], uid: PodUid) -> int | None:
        """The bytes of ``listing`` pod ``uid`` may be charged for: what it truly holds, and
        what the residual risk lets the enforcer charge it for (N/A entries count 0: the pod
        holds at least this much). None: no entry at all."""
        mine = [
            used
            for pid, _g, used, owner in listing
            if owner == uid or uid in self.residual.get(pid, ())
        ]
        return sum(used or 0 for used in mine) if mine else None

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
            holds_gpu=occupant.alloc != 0 and not occupant.closed,
            started_at=occupant.started_at,
        )

    def _check(self, d: Decision, snap: PodSnapshot, before: EnforcerState) -> None:
        sigterm_before = set(self.sigterm_sent)
        self.sigterm_sent |= {
            a.target.container_id for a in d.signals if a.signal is StopSignal.TERM
        }
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
            g = t.gpu_index
            oldest = min(listing.taken_at for listing in self.listings.values())
            assert self.w.now - oldest <= STALENESS, "signal on stale GPU data (any listing)"
            assert pod.namespace != "kube-system", "signal to a pod of an exempt namespace"
            assert pod.uid != POLICY.self_pod_uid
            assert t.container_id in pod.containers, "container of another pod"
            if action.signal is StopSignal.KILL:
                assert t.container_id in sigterm_before, "SIGKILL to a container not sent SIGTERM"
            assert len(self.history[g]) >= 2, "signal before two listings of the device"
            confirmed = before.tracks.get(track_key(t))
            if confirmed is not None and confirmed.phase in (Phase.TERM_SENT, Phase.KILL_SENT):
                # Pressure confirms a violation; the SIGKILL that follows keeps its trigger
                # whatever the device's fill level is by then, and so does a SIGTERM of the
                # escalation (a container new since, a share group's next largest user).
                if action.trigger is Trigger.PRESSURE and action.signal is StopSignal.TERM:
                    event("a SIGTERM of an escalation keeps the pressure that confirmed it")
            elif action.trigger is Trigger.PRESSURE and action.signal is StopSignal.TERM:
                event("signal under device pressure")
                free = self.free[g]
                assert free is not None, "pressure on a device whose memory was not read"
                assert free < 0.05 * 16 * GiB, "pressure on a device with free memory"
            if t.shared is not None:
                self._check_shared(action, d)
                continue
            tenant = self.w.tenants[pod.uid]
            limit = expected_limit(tenant, pod.namespace, g)
            assert limit is not None, f"signal under a limit nothing sets: {pod}"
            assert t.limit_bytes == limit, "limit differs from what the declarations mean"
            if tenant.pinned_elsewhere(g):
                event("signal on a GPU a scheduler's pin does not name")
            for listing in self.history[g][-2:]:
                used = self._usage(listing, t.pod.uid)
                assert used is not None, "signal to a pod that holds no memory on that GPU"
                assert used > limit, f"wrong kill: true usage {used} <= limit {limit}"

    def _check_shared(self, action: SignalAction, d: Decision) -> None:
        """A stop for a DRA share several pods hold together (``KillTarget.shared``): the pod is
        one of the group, each member holds a claim's share on the device and none is exempt
        or of unknown usage; the limit and usage signalled are the group's budget (every
        distinct share its members hold there) and sum; what the pods holding those claims
        truly use there is over the budget in the device's last two listings; and a SIGTERM
        goes to one of the largest users (largest first, until what the others use fits)."""
        t = action.target
        shared = t.shared
        assert shared is not None
        g = t.gpu_index
        event(f"signal {action.signal.value} for a DRA share pods hold together")
        members = {p.uid: p for p in shared.pods}
        assert t.pod.uid in members, "stopped for a shared share it does not hold"
        assert len(members) >= 2, "a share group of one pod"
        held: set[tuple[str, str]] = set()
        for p in shared.pods:
            claim = self.w.tenants[p.uid].claim
            assert claim is not None, f"{p.name} names no claim"
            assert CLAIMS[claim][0] == g, f"{p.name} holds no share on GPU {g}"
            assert p.namespace != "kube-system", "a share group with an exempt member stopped"
            held.add((p.namespace, claim))
        budget = sum(CLAIMS[claim][1] for _, claim in held)
        assert t.limit_bytes == shared.budget_bytes == budget, "the budget is not the shares'"
        assert shared.claims == tuple(sorted(f"{ns}/{claim}" for ns, claim in held))
        views = {u.pod.uid: u for u in d.usages if u.device.index == g and u.pod.uid in members}
        assert set(views) == set(members), "a member the enforcer charged nothing there"
        assert all(u.unknown_processes == 0 for u in views.values()), "a member's usage unknown"
        assert t.used_bytes == shared.used_bytes == sum(u.used_bytes for u in views.values())
        # Which of the claims' holders are listed may change between the two listings: the
        # group is every pod holding them (deleted pods' processes included), whose true usage
        # is at least what the enforcer's members use.
        holders = [
            uid
            for uid, tenant in self.w.tenants.items()
            if (self.w.namespaces[uid], tenant.claim) in held
        ]
        for listing in self.history[g][-2:]:
            total = sum(self._usage(listing, uid) or 0 for uid in holders)
            assert total > budget, f"wrong stop: the sharers truly use {total} <= {budget}"
        if action.signal is StopSignal.KILL:
            return  # to a container sent SIGTERM (checked above), whoever is largest now
        truth = {uid: self._usage(self.history[g][-1], uid) or 0 for uid in members}
        if t.pod.uid in largest_users(shared.pods, truth, budget):
            return
        # The enforcer charges a process only once it may (the taint and settle rules), so it
        # can see less than a member truly holds, and rank the members by what it sees.
        seen = {uid: u.used_bytes for uid, u in views.items()}
        assert seen != truth, "SIGTERM to a sharer that is not among the largest users"
        assert all(seen[uid] <= truth[uid] for uid in members), f"charged past the truth: {seen}"
        assert t.pod.uid in largest_users(shared.pods, seen, budget), "not among the largest"
        event("shared-share SIGTERM ranked on usage not all chargeable yet")

    def _shared_over(self, d: Decision) -> set[tuple[str, str]]:
        """(namespace, claim) of each claim whose holders the enforcer sees over its share
        together, none of them exempt, over its own limit or of unknown usage: a group it must
        stop."""
        holders: dict[tuple[str, str], list[PodUsage]] = {}
        for u in d.usages:
            claim = self.w.tenants[u.pod.uid].claim
            if claim is not None and CLAIMS[claim][0] == u.device.index:
                holders.setdefault((u.pod.namespace, claim), []).append(u)
        return {
            (namespace, claim)
            for (namespace, claim), usages in holders.items()
            if len(usages) >= 2
            and namespace != "kube-system"
            and sum(u.used_bytes for u in usages) > CLAIMS[claim][1]
            and all(
                u.unknown_processes == 0 and u.state not in (UsageState.OVER, UsageState.STOPPING)
                for u in usages
            )
        }

    def _check_limits(self, d: Decision) -> None:
        """Each pod's limit on each device is exactly what its declarations mean: never above
        the smallest that applies, never "unlimited" where the admin set a default or a max,
        whatever a tenant pinned."""
        for u in d.usages:
            tenant = self.w.tenants[u.pod.uid]
            want = expected_limit(tenant, u.pod.namespace, u.device.index)
            assert u.limit.limit_bytes == want, (
                f"{u.pod.name} on GPU {u.device.index}: limit {u.limit.limit_bytes}, the "
                f"declarations mean {want}: {tenant}"
            )
            if tenant.pinned_elsewhere(u.device.index) and want is not None:
                event("a pod held to a limit on a GPU its pin does not name")

    @rule()
    def hold_steady(self) -> None:
        """Liveness: the API healthy and both devices listed every half second, nothing else
        changing. A non-exempt pod the enforcer sees over its limit on a device in every one of
        these cycles is stopped by their end (a forged pin never leaves it refused), and so are
        the pods holding a claim's share together that it sees over it in every cycle (none of
        them exempt, over its own limit or of unknown usage): their group's track, under
        ``SHARED_TRACK_PREFIX``, was confirmed."""
        self.w.api_up = True
        over: dict[tuple[PodUid, int], int] = {}
        shared_over: dict[tuple[str, str], int] = {}
        for _ in range(4):
            self.poll(0.5, fresh=(True, True), sync=True)
            assert self.last is not None
            for u in self.last.usages:
                if u.state in (UsageState.OVER, UsageState.STOPPING):
                    key = (u.pod.uid, u.device.index)
                    over[key] = over.get(key, 0) + 1
            for claimed in self._shared_over(self.last):
                shared_over[claimed] = shared_over.get(claimed, 0) + 1
        for (uid, g), times in over.items():
            if times < 4:
                continue
            track = self.state.tracks.get((uid, DEVICES[g].key))
            assert track is not None, "over its limit in four cycles, and no violation tracked"
            assert track.phase is not Phase.OBSERVING, "over its limit, never confirmed"
            if track.phase is Phase.REFUSED:
                # Only a refusal that is about the memory, never about a pin.
                assert track.refused <= {RefusalReason.NO_CONTAINER}, track.refused
            else:
                event("held steady over a limit: stopped")
                if self.w.tenants[uid].pinned_elsewhere(g):
                    event("held steady over a limit on a GPU its pin does not name: stopped")
        for (namespace, claim), times in shared_over.items():
            if times < 4:
                continue
            group = SHARED_TRACK_PREFIX + "/".join(share_order(claim_share(namespace, claim)))
            track = self.state.tracks.get((PodUid(group), DEVICES[CLAIMS[claim][0]].key))
            assert track is not None, "over a shared share in four cycles, no violation tracked"
            assert track.phase is not Phase.OBSERVING, "over a shared share, never confirmed"
            if track.phase is Phase.REFUSED:
                assert track.refused <= {RefusalReason.NO_CONTAINER}, track.refused
            else:
                event("held steady over a shared DRA share: stopped")

    def remembered_ghosts(self, d: Decision) -> list[Attribution]:
        live = {p.pid for p in self.w.procs if p.alive}
        return [a for pid, a in d.state.remembered.items() if pid not in live]

    @invariant()
    def state_is_bounded(self) -> None:
        assert len(self.state.reported_once) <= 200


EnforcerModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEnforcerNeverSignalsWrongly = EnforcerModel.TestCase
