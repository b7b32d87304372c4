"""``gpuguard inspect``: verdicts per GPU process, the JSON report and the human table.

Mostly over the fakes (``tests/fakes.py``); one case runs the real chain: NVML stand-in → real
``NvmlGpuSource`` → real ``ProcfsProcessResolver`` over this machine's ``/proc``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuguard.adapters.nvml import NvmlGpuSource
from gpuguard.adapters.procfs import ProcfsProcessResolver
from gpuguard.commands.inspect import inspect_node, render_inspect, run_inspect
from gpuguard.core.model import (
    DeviceMemory,
    EnforcementPolicy,
    LimitPolicy,
    LimitValue,
    NamespacePolicy,
    ProcessIdentity,
)
from gpuguard.core.policy import EnforcerState, decide
from gpuguard.errors import GpuSourceError
from rigs.nvml_stub import build_stub
from tests.fakes import (
    FakeClock,
    FakeGpuSource,
    FakePodDirectory,
    FakeResolver,
    GiB,
    attr,
    gpu,
    mig_gpu,
    pod,
    proc,
)


def by_pid(report: dict[str, object]) -> dict[int, dict[str, object]]:
    processes = report["processes"]
    assert isinstance(processes, list)
    return {p["pid"]: p for p in processes}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_every_gpu_process_gets_its_pod_limit_and_verdict(clock: FakeClock) -> None:
    g0, g1 = gpu(0, total=80 * GiB), gpu(1, total=80 * GiB)
    source = FakeGpuSource(
        clock=clock,
        devices=[g0, g1],
        processes=[
            proc(100, g0, 6 * GiB),  # pod 1, container c0
            proc(101, g0, 5 * GiB),  # pod 1, container c1: pod total 11 GiB > 10 GiB
            proc(102, g1, 2 * GiB),  # pod 1 on the other GPU: 2 GiB, ok there
            proc(200, g0, None),  # pod 2: N/A
            proc(300, g0, 1 * GiB),  # host process
            proc(400, g1, 3 * GiB),  # ghost
            proc(500, g1, 1 * GiB),  # pod the directory does not know
            proc(600, g1, 1 * GiB),  # kube-system
        ],
    )
    resolver = FakeResolver(
        {
            100: attr(100, pod_n=1, container=0),
            101: attr(101, pod_n=1, container=1),
            102: attr(102, pod_n=1, container=0),
            200: attr(200, pod_n=2),
            300: attr(300, pod_n=None),
            500: attr(500, pod_n=5),
            600: attr(600, pod_n=6),
        }
    )
    pods = FakePodDirectory(
        clock=clock,
        pods=[
            pod(1, limit=10 * GiB, containers=2),
            pod(2, limit=10 * GiB),
            pod(6, namespace="kube-system", limit=1),
        ],
    )
    report = inspect_node(source, resolver, pods, EnforcementPolicy())
    rows = by_pid(report)

    assert {pid: r["verdict"] for pid, r in rows.items()} == {
        100: "over limit",
        101: "over limit",
        102: "ok",
        200: "unknown usage",
        300: "not a pod",
        400: "ghost",
        500: "pod unknown",
        600: "exempt",
    }
    assert (rows[101]["namespace"], rows[101]["pod"], rows[101]["container"]) == (
        "team",
        "pod-1",
        "c1",
    )
    assert (rows[100]["pod_used_bytes"], rows[100]["limit_bytes"]) == (11 * GiB, 10 * GiB)
    assert rows[100]["limit_source"] == "annotation"
    assert rows[102]["pod_used_bytes"] == 2 * GiB
    assert rows[200]["used_bytes"] is None
    devices = {d["gpu"]: d for d in report["devices"]}
    assert devices[0]["unattributed_bytes"] == 1 * GiB
    # The ghost and the unknown pod's memory: charged to nobody, as enforce's metric counts it.
    assert devices[1]["unattributed_bytes"] == 4 * GiB
    json.dumps(report)  # the --json document is serialisable as is


@pytest.mark.parametrize(
    ("labelled", "verdict", "reason"),
    [
        (None, "over limit", "the namespace's exempt label is not known yet: not signalled"),
        (frozenset({"gpu-operator"}), "exempt", "namespace gpu-operator is exempt"),
        (frozenset(), "over limit", ""),
    ],
)
def test_inspect_shows_a_namespace_exempt_by_the_admins_label_as_enforce_judges_it(
    clock: FakeClock, labelled: frozenset[str] | None, verdict: str, reason: str
) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(100, g0, 3 * GiB)])
    resolver = FakeResolver({100: attr(100, pod_n=1)})
    pods = FakePodDirectory(
        clock=clock,
        pods=[pod(1, namespace="gpu-operator", limit=1 * GiB)],
        labelled_namespaces=labelled,
    )
    label = ("gpuguard.io/exempt", "true")
    policy = EnforcementPolicy(limits=LimitPolicy(exempt_label=label))
    row = by_pid(inspect_node(source, resolver, pods, policy))[100]
    assert (row["verdict"], row["reason"]) == (verdict, reason)


def test_a_reused_pid_that_does_not_hold_the_gpu_is_a_ghost(clock: FakeClock) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(100, g0, 50 * GiB)])
    resolver = FakeResolver({100: attr(100, pod_n=1, holds_gpu=False)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=1 * GiB)])
    row = by_pid(inspect_node(source, resolver, pods, EnforcementPolicy()))[100]
    assert row["verdict"] == "ghost"
    assert row["pod_used_bytes"] is None


@pytest.mark.parametrize("declared", [False, True])
def test_an_mps_client_is_shown_spared_only_where_the_admin_declared_mps(
    clock: FakeClock, declared: bool
) -> None:
    g0 = gpu(0, mps=True)
    source = FakeGpuSource(
        clock=clock,
        devices=[g0],
        processes=[proc(100, g0, 12 * GiB, mps=True), proc(200, g0, 12 * GiB)],
    )
    resolver = FakeResolver({100: attr(100, pod_n=1), 200: attr(200, pod_n=2)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=1 * GiB), pod(2, limit=1 * GiB)])
    policy = EnforcementPolicy(mps_gpus=frozenset({"all"} if declared else set()))
    report = inspect_node(source, resolver, pods, policy)
    rows = by_pid(report)
    assert rows[100]["verdict"] == rows[200]["verdict"] == "over limit"
    assert rows[200]["reason"] == ""
    assert rows[100]["reason"] == ("MPS client: not signalled" if declared else "")
    out = io.StringIO()
    render_inspect(report, out)
    assert ("pods with an MPS client are not signalled" in out.getvalue()) is declared
    assert ("MPS not declared: enforced like any process" in out.getvalue()) is not declared


def test_limits_come_from_admin_defaults_and_per_mig_instance_size(clock: FakeClock) -> None:
    small, big = mig_gpu(0, gi=1, total=10 * GiB), mig_gpu(0, gi=2, total=40 * GiB)
    source = FakeGpuSource(
        clock=clock,
        devices=[small, big],
        processes=[proc(1, small, 6 * GiB), proc(2, big, 6 * GiB)],
    )
    resolver = FakeResolver({1: attr(1, pod_n=1), 2: attr(2, pod_n=2)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1), pod(2)])
    policy = EnforcementPolicy(
        limits=LimitPolicy(
            namespaces={"team": NamespacePolicy(default_limit=LimitValue(percent=50))}
        )
    )
    rows = by_pid(inspect_node(source, resolver, pods, policy))
    assert (rows[1]["limit_bytes"], rows[1]["verdict"], rows[1]["gpu_instance_id"]) == (
        5 * GiB,
        "over limit",
        1,
    )
    assert (rows[2]["limit_bytes"], rows[2]["verdict"]) == (20 * GiB, "ok")
    assert rows[1]["limit_source"] == "namespace-default"


def test_offline_shows_pod_uids_without_limits(clock: FakeClock) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(7, g0, 1 * GiB)])
    row = by_pid(
        inspect_node(source, FakeResolver({7: attr(7, pod_n=3)}), None, EnforcementPolicy())
    )[7]
    assert (row["verdict"], row["pod"], row["limit_bytes"]) == ("pod unknown", None, None)
    assert row["pod_uid"] is not None


def test_the_table_names_pods_gpus_and_verdicts(clock: FakeClock) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(
        clock=clock, devices=[g0], processes=[proc(100, g0, 12 * GiB), proc(300, g0, None)]
    )
    resolver = FakeResolver({100: attr(100, pod_n=1), 300: attr(300, pod_n=None)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=10 * GiB)])
    out = io.StringIO()
    render_inspect(inspect_node(source, resolver, pods, EnforcementPolicy()), out, width=200)
    text = out.getvalue()
    assert "team/pod-1" in text
    assert "over limit" in text
    assert "not a pod" in text
    assert "n/a" in text


@pytest.mark.parametrize(
    ("free_fraction", "pressure"), [(0.01, True), (0.049, True), (0.05, False), (0.5, False)]
)
def test_each_device_shows_its_free_memory_and_whether_it_is_under_pressure(
    clock: FakeClock, free_fraction: float, pressure: bool
) -> None:
    g0 = gpu(0)
    free = int(g0.total_bytes * free_fraction)
    source = FakeGpuSource(
        clock=clock,
        devices=[g0],
        processes=[proc(100, g0, 12 * GiB)],
        memory={
            g0.key: DeviceMemory(
                total_bytes=g0.total_bytes, used_bytes=g0.total_bytes - free, free_bytes=free
            )
        },
    )
    report = inspect_node(
        source, FakeResolver({100: attr(100, pod_n=1)}), None, EnforcementPolicy()
    )
    (device,) = report["devices"]
    assert (device["free_bytes"], device["under_pressure"]) == (free, pressure)
    assert device["memory_used_bytes"] == g0.total_bytes - free
    assert device["listing_age_seconds"] == 0.0  # inspect lists now
    out = io.StringIO()
    render_inspect(report, out, width=200)
    assert ("under memory pressure" in out.getvalue()) is pressure
    assert " free" in out.getvalue()


def test_each_process_is_shown_with_its_name_and_an_unknown_name_is_a_dash(
    clock: FakeClock,
) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(
        clock=clock,
        devices=[g0],
        processes=[proc(100, g0, 1 * GiB), proc(101, g0, 1 * GiB), proc(400, g0, 1 * GiB)],
    )
    resolver = FakeResolver({100: attr(100, pod_n=1), 101: attr(101, pod_n=1)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=10 * GiB)])
    names = {100: "trainer", 101: None}  # 101: gone or reused since NVML listed it
    asked: list[ProcessIdentity] = []

    def process_names(identity: ProcessIdentity) -> str | None:
        asked.append(identity)
        return names[identity.pid]

    report = inspect_node(source, resolver, pods, EnforcementPolicy(), process_names)
    out = io.StringIO()
    render_inspect(report, out, width=200)

    rows = by_pid(report)
    assert {pid: r["name"] for pid, r in rows.items()} == {100: "trainer", 101: None, 400: None}
    assert sorted(i.pid for i in asked) == [100, 101]  # the ghost has no identity to ask about
    lines = {line.split()[1]: line for line in out.getvalue().splitlines() if "│" in line}
    assert "trainer" in lines["100"]
    assert lines["101"].split("│")[2].strip() == "-"
    assert "NAME" in out.getvalue()


def test_a_name_the_process_chose_cannot_drive_the_terminal_or_the_table_markup(
    clock: FakeClock,
) -> None:
    g0 = gpu(0)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(100, g0, 1 * GiB)])
    resolver = FakeResolver({100: attr(100, pod_n=None)})
    evil = "\x1b]0;pwned\x07[bold]x"

    report = inspect_node(source, resolver, None, EnforcementPolicy(), lambda _: evil)
    out = io.StringIO()
    render_inspect(report, out, width=200)

    assert by_pid(report)[100]["name"] == evil  # the JSON is exact
    text = out.getvalue()
    assert "\x1b" not in text
    assert "\\x1b]0;pwned\\x07[bold]x" in text


def test_run_inspect_exits_1_with_a_message_when_nvml_cannot_be_read(clock: FakeClock) -> None:
    source = FakeGpuSource(clock=clock, devices=[], error=GpuSourceError("nvml hung"))
    out, err = io.StringIO(), io.StringIO()
    code = run_inspect(
        gpu_source=source,
        resolver=FakeResolver(),
        pod_lookup=None,
        policy=EnforcementPolicy(),
        as_json=True,
        stdout=out,
        stderr=err,
    )
    assert code == 1
    assert "nvml hung" in err.getvalue()
    assert out.getvalue() == ""


# ---------------------------------------------------------------------------------------------
# The real chain


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc_ = subprocess.Popen(["sleep", "60"])
    try:
        yield proc_.pid
    finally:
        proc_.kill()
        proc_.wait()


@pytest.mark.nvml_stub
def test_inspect_over_the_nvml_stand_in_and_real_proc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeper: int
) -> None:
    lib = build_stub()
    dead = subprocess.Popen(["true"])
    dead.wait()
    scenario = tmp_path / "s.json"
    scenario.write_text(
        json.dumps(
            {
                "devices": [
                    {
                        "uuid": "GPU-1",
                        "total_bytes": 80 * GiB,
                        "processes": [
                            {"pid": sleeper, "used_bytes": 1 * GiB},
                            {"pid": dead.pid, "used_bytes": 2 * GiB},
                        ],
                    }
                ]
            }
        )
    )
    monkeypatch.setenv("NVML_STUB_SCENARIO", str(scenario))
    source = NvmlGpuSource(library_path=lib)
    try:
        out, err = io.StringIO(), io.StringIO()
        code = run_inspect(
            gpu_source=source,
            resolver=ProcfsProcessResolver(Path("/proc")),
            pod_lookup=None,
            policy=EnforcementPolicy(),
            as_json=True,
            stdout=out,
            stderr=err,
        )
    finally:
        source.close()
    assert code == 0, err.getvalue()
    rows = by_pid(json.loads(out.getvalue()))
    # This test process is not in a kubepods cgroup; the reaped child is not in /proc.
    assert rows[sleeper]["verdict"] == "not a pod"
    assert rows[dead.pid]["verdict"] == "ghost"
    assert os.path.exists(f"/proc/{sleeper}")


def test_inspect_says_what_enforce_decides_for_a_pod_with_an_unknown_usage(
    clock: FakeClock,
) -> None:
    """One 12 GiB process and one N/A process, limit 10 GiB: ``decide()`` refuses it as
    ``usage_unknown``; inspect said "over limit". Both now read ``core.assess``."""
    g0 = gpu(0, total=80 * GiB)
    source = FakeGpuSource(
        clock=clock, devices=[g0], processes=[proc(1, g0, 12 * GiB), proc(2, g0, None)]
    )
    resolver = FakeResolver({1: attr(1, pod_n=1), 2: attr(2, pod_n=1)})
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=10 * GiB)])
    rows = by_pid(inspect_node(source, resolver, pods, EnforcementPolicy()))
    assert {pid: r["verdict"] for pid, r in rows.items()} == {
        1: "unknown usage",
        2: "unknown usage",
    }

    decision = decide(
        sample=source.sample(),
        attributions={1: attr(1, pod_n=1), 2: attr(2, pod_n=1)},
        pods=pods.snapshot(),
        node=pods.node(),
        policy=EnforcementPolicy(),
        state=EnforcerState(),
        now=clock.monotonic(),
    )
    [usage] = decision.usages
    assert usage.state.value == "usage_unknown"


def test_inspect_never_acts_on_gpuguards_own_pod_either(clock: FakeClock) -> None:
    g0 = gpu(0, total=80 * GiB)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(1, g0, 12 * GiB)])
    pods = FakePodDirectory(clock=clock, pods=[pod(1, limit=10 * GiB)])
    policy = EnforcementPolicy(self_pod_uid=pod(1).uid)
    rows = by_pid(inspect_node(source, FakeResolver({1: attr(1, pod_n=1)}), pods, policy))
    assert rows[1]["verdict"] == "exempt"


def test_a_limit_from_another_scheduler_is_shown_with_its_source(clock: FakeClock) -> None:
    import dataclasses

    from gpuguard.core.model import Declaration, LimitPolicy, LimitSource

    g0 = gpu(0)
    source = FakeGpuSource(clock=clock, devices=[g0], processes=[proc(100, g0, 3 * GiB)])
    declared = {LimitSource.KAI: Declaration(amount=2048, where="annotation gpu-memory")}
    pods = FakePodDirectory(clock=clock, pods=[dataclasses.replace(pod(1), declared=declared)])
    policy = EnforcementPolicy(limits=LimitPolicy(sources=("gpuguard", "kai")))
    row = by_pid(inspect_node(source, FakeResolver({100: attr(100, pod_n=1)}), pods, policy))[100]
    assert (row["limit_bytes"], row["limit_source"], row["verdict"]) == (
        2 * GiB,
        "kai",
        "over limit",
    )
    # Not listed in limits.sources: not a limit.
    row = by_pid(
        inspect_node(source, FakeResolver({100: attr(100, pod_n=1)}), pods, EnforcementPolicy())
    )[100]
    assert row["limit_source"] is None


def test_every_declaration_weighed_is_shown_with_the_one_that_bound(clock: FakeClock) -> None:
    """The pod's own 100 % and KAI's 2 GiB are both caps; KAI's binds, and inspect
    says so. On a GPU gpushare did not assign the pod, its declaration grants nothing but
    still caps (a pin is tenant-writable)."""
    import dataclasses

    from gpuguard.core.model import Declaration, LimitPolicy, LimitSource, LimitValue

    g0, g1 = gpu(0), gpu(1)
    source = FakeGpuSource(
        clock=clock, devices=[g0, g1], processes=[proc(100, g0, 3 * GiB), proc(200, g0, 1 * GiB)]
    )
    kai = dataclasses.replace(
        pod(1),
        annotation_limit=LimitValue(percent=100),
        declared={LimitSource.KAI: Declaration(amount=2048, where="annotation gpu-memory")},
    )
    pinned = dataclasses.replace(
        pod(2),
        declared={
            LimitSource.GPUSHARE: Declaration(
                amount=4, where="limits aliyun.com/gpu-mem", pinned=frozenset({"index:1"})
            )
        },
    )
    pods = FakePodDirectory(clock=clock, pods=[kai, pinned])
    policy = EnforcementPolicy(limits=LimitPolicy(sources=("gpuguard", "kai", "gpushare")))
    resolver = FakeResolver({100: attr(100, pod_n=1), 200: attr(200, pod_n=2)})
    report = inspect_node(source, resolver, pods, policy)
    rows = by_pid(report)
    assert (rows[100]["limit_bytes"], rows[100]["limit_source"]) == (2 * GiB, "kai")
    declared = rows[100]["limit_declarations"]
    assert isinstance(declared, list)
    assert [(d["source"], d["value"], d["bound"]) for d in declared] == [
        ("annotation", "100%", False),
        ("kai", "2Gi", True),
    ]
    assert (rows[200]["limit_bytes"], rows[200]["limit_source"]) == (4 * GiB, "gpushare")
    pinned_row = rows[200]["limit_declarations"]
    assert isinstance(pinned_row, list)
    (share,) = pinned_row
    assert (share["pinned"], share["assigned"]) == (["index:1"], False)
    out = io.StringIO()
    render_inspect(report, out, width=200)
    assert "2Gi (kai)" in out.getvalue()


def test_a_dra_limit_is_shown_with_the_claims_and_shares_behind_it(clock: FakeClock) -> None:
    """Each process of a pod with DRA shares on its GPU names them (``dra_shares``, only those
    on that GPU, by claim namespace, name and request); the table is followed by one line per
    pod and GPU naming them; a pod without DRA gets ``[]`` and no line."""
    import dataclasses

    from gpuguard.core.model import Declaration, DraShare, LimitPolicy, LimitSource

    g0, g1 = gpu(0), gpu(1)

    def share(claim: str, on: str, device: str, memory: int) -> DraShare:
        return DraShare(
            claim_namespace="team", claim_name=claim, request="gpu", driver="gpu.nvidia.com",
            pool="node-1", device=device, share_id="s1", memory_bytes=memory,
            uuid=on,  # type: ignore[arg-type]
        )  # fmt: skip

    claims = (
        share("gpu-xyz", g1.uuid, "gpu-1", 2 * GiB),
        share("gpu-abc", g0.uuid, "gpu-0", 4 * GiB),
    )
    dra = dataclasses.replace(
        pod(1, containers=2),
        declared={LimitSource.DRA: Declaration(where="resourceClaims", shares=claims)},
    )
    source = FakeGpuSource(
        clock=clock,
        devices=[g0, g1],
        processes=[
            proc(100, g0, 3 * GiB),
            proc(101, g0, 2 * GiB),
            proc(102, g1, 1 * GiB),
            proc(200, g0, 1 * GiB),
        ],
    )
    resolver = FakeResolver(
        {
            100: attr(100, pod_n=1, container=0),
            101: attr(101, pod_n=1, container=1),
            102: attr(102, pod_n=1, container=0),
            200: attr(200, pod_n=2),
        }
    )
    pods = FakePodDirectory(clock=clock, pods=[dra, pod(2, limit=8 * GiB)])
    policy = EnforcementPolicy(limits=LimitPolicy(sources=("gpuguard", "dra")))
    report = inspect_node(source, resolver, pods, policy)
    rows = by_pid(report)
    on_g0 = {
        "claim": "team/gpu-abc",
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "node-1",
        "device": "gpu-0",
        "share_id": "s1",
        "memory_bytes": 4 * GiB,
    }
    assert (rows[100]["limit_bytes"], rows[100]["limit_source"], rows[100]["verdict"]) == (
        4 * GiB,
        "dra",
        "over limit",
    )
    assert rows[100]["dra_shares"] == rows[101]["dra_shares"] == [on_g0]
    on_g1 = {**on_g0, "claim": "team/gpu-xyz", "device": "gpu-1", "memory_bytes": 2 * GiB}
    assert rows[102]["dra_shares"] == [on_g1], "the share on the GPU of the row, no other"
    assert rows[200]["dra_shares"] == []
    assert json.loads(json.dumps(report))["processes"] == report["processes"]

    out = io.StringIO()
    render_inspect(report, out, width=200)
    lines = out.getvalue().splitlines()
    assert [line for line in lines if "from dra" in line] == [
        "team/pod-1 on GPU 0: limit 4Gi from dra: claim team/gpu-abc request gpu on "
        "gpu.nvidia.com/node-1/gpu-0, share 4Gi",
        "team/pod-1 on GPU 1: limit 2Gi from dra: claim team/gpu-xyz request gpu on "
        "gpu.nvidia.com/node-1/gpu-1, share 2Gi",
    ]


def test_each_process_says_what_bounds_its_pods_memory_as_the_metric_does(
    clock: FakeClock,
) -> None:
    """``bound_by``, in the JSON and the table: the declaration that bound the pod's limit (the
    namespace maximum where it capped one), ``none`` for a pod without a limit or an exempt
    one, ``unattributed`` for memory no pod is charged with."""
    g0 = gpu(0, total=80 * GiB)
    owners = {100: 1, 200: 2, 300: 3, 400: None, 500: 5}
    source = FakeGpuSource(
        clock=clock,
        devices=[g0],
        processes=[proc(pid, g0, 1 * GiB) for pid in owners] + [proc(600, g0, 1 * GiB)],
    )
    resolver = FakeResolver({pid: attr(pid, pod_n=n) for pid, n in owners.items()})
    pods = FakePodDirectory(
        clock=clock,
        pods=[
            pod(1, limit=4 * GiB),
            pod(2, namespace="capped", limit=40 * GiB),
            pod(3),
            pod(5, namespace="kube-system", limit=4 * GiB),
        ],
    )
    policy = EnforcementPolicy(
        limits=LimitPolicy(
            namespaces={"capped": NamespacePolicy(max_limit=LimitValue(limit_bytes=8 * GiB))}
        )
    )
    report = inspect_node(source, resolver, pods, policy)
    rows = by_pid(report)
    assert {pid: r["bound_by"] for pid, r in rows.items()} == {
        100: "annotation",
        200: "namespace_max",
        300: "none",
        400: "unattributed",  # a host process
        500: "none",  # exempt
        600: "unattributed",  # a ghost
    }
    assert rows[200]["limit_source"] == "annotation", "the source it capped, as before"
    out = io.StringIO()
    render_inspect(report, out, width=200)
    lines = out.getvalue().splitlines()
    assert "BOUND BY" in next(line for line in lines if "PID" in line)
    assert "namespace_max" in next(line for line in lines if line.lstrip("│ ").startswith("200"))
