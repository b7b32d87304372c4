"""A scripted timeline for ``decide()``: one GPU sample per step, the state carried from one
call to the next as the runtime carries it, with the devices, node and policy the policy tests
share (tests/test_policy.py, tests/test_policy_dra.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from gpuguard.core.allocation import UNKNOWN_ALLOCATIONS, NodeAllocations
from gpuguard.core.model import (
    Attribution,
    DeviceKey,
    DeviceMemory,
    EnforcementPolicy,
    GpuDevice,
    GpuProcess,
    LimitPolicy,
    Listing,
    Mode,
    NodeFacts,
    Pod,
    PodSnapshot,
    PodUid,
    RefusalReason,
    StopSignal,
)
from gpuguard.core.policy import Decision, EnforcerState, decide
from tests.fakes import gpu, sample, snapshot

G0 = gpu(0)
G1 = gpu(1)
NODE = NodeFacts(name="node-1")

POLICY = EnforcementPolicy(
    mode=Mode.ENFORCE,
    grace_seconds=2.0,
    termination_timeout_seconds=3.0,
    staleness_seconds=5.0,
    limits=LimitPolicy(exempt_namespaces=frozenset({"kube-system", "platform"})),
)


@dataclass
class Timeline:
    """Feeds decide() one sample per step, carrying the state, like the runtime does."""

    devices: list[GpuDevice]
    pods: list[Pod]
    attributions: dict[int, Attribution]
    policy: EnforcementPolicy = POLICY
    state: EnforcerState = field(default_factory=EnforcerState)
    seq: int = 0
    now: float = 100.0
    decisions: list[Decision] = field(default_factory=list)
    listings: dict[DeviceKey, Listing] = field(default_factory=dict)
    allocations: NodeAllocations = UNKNOWN_ALLOCATIONS
    """The kubelet's pod resources each step decides on (set ``read_at`` as a test needs)."""
    frozen: dict[tuple[PodUid, DeviceKey], float] = field(default_factory=dict)
    """``decide()``'s ``frozen``: the allocation guard's frozen callers (``core.freeze``)."""

    def step(
        self,
        procs: list[GpuProcess],
        *,
        dt: float = 1.0,
        pods: PodSnapshot | None = None,
        new_sample: bool = True,
        sample_age: float = 0.0,
        memory: Mapping[DeviceKey, DeviceMemory] | None = None,
        carried: tuple[GpuDevice, ...] = (),
    ) -> Decision:
        """``memory``: the fast read of each device; ``carried``: devices change-driven
        sampling did not list again (their last listing is carried over)."""
        self.now += dt
        if new_sample:
            self.seq += 1
            for device in self.devices:
                if device not in carried or device.key not in self.listings:
                    self.listings[device.key] = Listing(
                        seq=self.seq, taken_at=self.now - sample_age
                    )
        s = replace(
            sample(self.seq, self.now - sample_age, self.devices, procs),
            listings=dict(self.listings),
            memory=memory or {},
        )
        d = decide(
            sample=s,
            attributions=self.attributions,
            pods=pods if pods is not None else snapshot(self.pods, contact=self.now),
            node=NODE,
            policy=self.policy,
            state=self.state,
            now=self.now,
            allocations=self.allocations,
            frozen=self.frozen,
        )
        self.state = d.state
        self.decisions.append(d)
        return d

    def signals(self) -> list[tuple[str, StopSignal]]:
        return [(a.target.pod.name, a.signal) for d in self.decisions for a in d.signals]

    def refusals(self) -> list[RefusalReason]:
        return [r.reason for d in self.decisions for r in d.refusals]
