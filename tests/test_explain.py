"""``gpuguard explain``: the JSON contract (docs/design.md, CLI outputs), the human text and the
exit codes, over fixture ``/proc`` trees and through the real CLI in a subprocess."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpuguard.commands.dra_reads import POLL_SECONDS, wait_for_dra_reads
from gpuguard.commands.explain import OnlineLookup, explain, render_explain_human, run_explain
from gpuguard.core.model import (
    Attribution,
    Declaration,
    DraShare,
    EnforcementPolicy,
    GpuDevice,
    GpuProcess,
    LimitPolicy,
    LimitSource,
    LimitValue,
    Pod,
)
from gpuguard.errors import KubeError
from rigs.cli_run import run_gpuguard
from tests.fakes import (
    FakeClock,
    FakeGpuSource,
    FakePodDirectory,
    FakeResolver,
    GiB,
    attr,
    gpu,
    pod,
    proc,
)

FIXTURES = Path(__file__).parent / "fixtures" / "proc"
UID = "4b1f4f77-49e6-4e30-98db-e98055c8a54f"
C = "a" * 60 + "c0de"
CONTRACT: dict[str, type | tuple[type, ...]] = {
    "pid": int,
    "is_pod": bool,
    "pod_uid": (str, type(None)),
    "container_id": (str, type(None)),
    "runtime": (str, type(None)),
    "cgroup_version": int,
    "reason": (str, type(None)),
}


def assert_contract(d: Mapping[str, Any]) -> None:
    for key, types in CONTRACT.items():
        assert key in d, key
        assert isinstance(d[key], types), (key, d[key])
    assert d["runtime"] in ("containerd", "cri-o", "docker", None)
    assert d["cgroup_version"] in (1, 2)
    if not d["is_pod"]:
        assert isinstance(d["reason"], str)
        assert d["reason"]
        assert d["pod_uid"] is None
    else:
        assert len(d["pod_uid"]) in (32, 36)
    json.dumps(d)  # serialisable as is


def online_lookup(
    devices: Sequence[GpuDevice],
    processes: Sequence[GpuProcess],
    pods: Sequence[Pod],
    pod_of_pid: Mapping[int, int],
    *,
    sources: tuple[str, ...] | None = None,
    exempt_label: tuple[str, str] | None = None,
    labelled: frozenset[str] | None = None,
) -> OnlineLookup:
    """The lookup ``explain`` makes online, over the fakes: one sample of ``processes`` on
    ``devices``, ``pods`` in the directory, each PID in ``pod_of_pid`` attributed to
    ``pod(n)``'s container, and the limit ``sources`` the policy names (its default when
    ``None``)."""
    clock = FakeClock()
    source = FakeGpuSource(clock=clock, devices=list(devices), processes=list(processes))
    limits = LimitPolicy(exempt_label=exempt_label)
    if sources is not None:
        limits = dataclasses.replace(limits, sources=sources)
    return OnlineLookup(
        directory=FakePodDirectory(clock=clock, pods=list(pods), labelled_namespaces=labelled),
        problem=None,
        policy=EnforcementPolicy(limits=limits),
        sample=source.sample(),
        resolver=FakeResolver({pid: attr(pid, pod_n=n) for pid, n in pod_of_pid.items()}),
    )


def test_a_crio_crun_pod_process_meets_the_contract() -> None:
    d = explain(1001, proc_root=FIXTURES, offline=True)
    assert_contract(d)
    assert d["pid"] == 1001
    assert d["is_pod"] is True
    assert d["pod_uid"] == UID
    assert d["container_id"] == C
    assert d["runtime"] == "cri-o"
    assert d["cgroup_version"] == 2
    assert d["reason"] is None
    assert d["start_ticks"] == 88001
    assert d["cgroup_lines"][0].startswith("0::/kubepods.slice/")
    assert d["cgroup"].endswith(f"crio-{C}.scope")


def test_crio_conmon_is_not_a_pod() -> None:
    d = explain(1006, proc_root=FIXTURES, offline=True)
    assert_contract(d)
    assert d["is_pod"] is False
    assert "conmon" in d["reason"]


def test_a_static_pod_reports_its_config_hash() -> None:
    d = explain(1004, proc_root=FIXTURES)
    assert_contract(d)
    assert d["pod_uid"] == "6a1a0f3c2b9e4d8f9a7b6c5d4e3f2a1b"


def test_a_pid_not_in_proc_is_not_a_pod_with_a_reason() -> None:
    d = explain(4_000_000, proc_root=Path("/proc"), offline=True)
    assert_contract(d)
    assert d["reason"] == "not in /proc"
    assert d["in_proc"] is False


def test_offline_never_calls_the_pod_lookup() -> None:
    def lookup(_: Attribution) -> Mapping[str, Any] | None:
        raise AssertionError("called offline")

    d = explain(1001, proc_root=FIXTURES, offline=True, pod_lookup=lookup)
    assert "pod_found" not in d


def test_online_lookup_fills_the_placeholders() -> None:
    seen: list[Attribution] = []

    def lookup(a: Attribution) -> Mapping[str, Any] | None:
        seen.append(a)
        return {"pod_namespace": "ml", "pod_name": "train-0", "limit_bytes": 8 << 30,
                "limit_source": "annotation", "is_pod": False}  # fmt: skip

    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lookup)
    assert_contract(d)
    assert seen[0].pod_uid == UID
    assert d["pod_found"] is True
    assert (d["pod_namespace"], d["pod_name"], d["limit_bytes"]) == ("ml", "train-0", 8 << 30)
    assert d["is_pod"] is True  # a lookup cannot override the contract keys
    assert d["gpu_used_bytes"] is None
    text = render_explain_human(d)
    assert "ml/train-0" in text
    assert "annotation" in text


def test_an_unknown_pod_and_a_failed_lookup_are_reported() -> None:
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: None)
    assert d["pod_found"] is False
    assert "no such pod" in render_explain_human(d)

    def failing(_: Attribution) -> Mapping[str, Any] | None:
        raise KubeError("connection refused")

    args = argparse.Namespace(pid=1001, proc_root=str(FIXTURES), offline=False, json=True)
    out = io.StringIO()
    assert run_explain(args, stdout=out, pod_lookup=failing) == 1
    assert json.loads(out.getvalue())["pod_lookup_error"] == "connection refused"


def test_human_text_says_why_not_a_pod() -> None:
    text = render_explain_human(explain(1007, proc_root=FIXTURES))
    assert "not a pod process: no kubepods cgroup" in text
    assert "0::/system.slice/nvidia-persistenced.service" in text


@pytest.mark.parametrize(
    ("pid", "proc_root", "code"),
    [(1001, FIXTURES, 0), (4_000_000, FIXTURES, 0), (2**22, FIXTURES, 0), (0, FIXTURES, 2),
     (-3, FIXTURES, 2), (2**22 + 1, FIXTURES, 2), (10**23, FIXTURES, 2),
     (1001, FIXTURES / "nope", 1)],
)  # fmt: skip
def test_exit_codes(pid: int, proc_root: Path, code: int) -> None:
    args = argparse.Namespace(pid=pid, proc_root=str(proc_root), offline=True, json=False)
    assert run_explain(args, stdout=io.StringIO(), stderr=io.StringIO()) == code


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return run_gpuguard(
        "explain",
        *argv,
        timeout=60,
        memory_bytes=None,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )


def test_the_cli_prints_one_json_document_meeting_the_contract() -> None:
    done = _cli("1001", "--proc-root", str(FIXTURES), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert_contract(d)
    assert (d["pod_uid"], d["container_id"], d["runtime"]) == (UID, C, "cri-o")


def test_the_cli_explains_itself_as_a_real_process() -> None:
    done = _cli(str(os.getpid()), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)
    assert_contract(d)
    assert d["pid"] == os.getpid()
    assert d["in_proc"] is True


def test_the_cli_rejects_a_non_numeric_pid_as_a_usage_error() -> None:
    assert _cli("abc").returncode == 2


@pytest.mark.parametrize(
    "pid", ["١", "１", "+1", " 1", "1_0", "0", "-3", "4194305", "1" + "0" * 23]
)
def test_the_cli_rejects_a_pid_that_is_not_1_to_pid_max_in_ascii_digits(pid: str) -> None:
    # int() accepts Arabic-Indic and full-width digits, signs, spaces and underscores; a PID is
    # ASCII digits, 1..2**22 (the kernel's PID_MAX_LIMIT): anything else is a usage error.
    done = _cli(pid, "--offline", "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "argument PID" in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def _write_proc(root: Path, pid: int, cgroup: str, start_ticks: int = 7) -> Path:
    """A fixture ``<root>/<pid>`` with ``stat`` (starttime = ``start_ticks``) and ``cgroup``."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", *["0"] * 18, str(start_ticks), *["0"] * 30]
    (d / "stat").write_text(f"{pid} (x) {' '.join(fields)}\n")
    (d / "cgroup").write_text(cgroup)
    return d


POD_LINE = f"0::/kubepods/besteffort/pod{UID}/{C}\n"


def test_human_text_escapes_terminal_control_sequences_and_json_keeps_them_exact(
    tmp_path: Path,
) -> None:
    evil = "/system.slice/a\x1b[2J\x1b]0;owned\x07b\rc\u202ed\u2028é.service"
    _write_proc(tmp_path, 70, f"0::{evil}\n")
    d = explain(70, proc_root=tmp_path)
    assert d["cgroup_lines"] == [f"0::{evil}"]  # the data itself is unchanged
    text = render_explain_human(d)
    assert not any(not ch.isprintable() for ch in text.replace("\n", "")), repr(text)
    assert "a\\x1b[2J\\x1b]0;owned\\x07b\\rc\\u202ed\\u2028é.service" in text

    online = {**d, "pod_found": True, "pod_namespace": "ns\x1b[31m", "pod_name": "p\x07",
              "pod_lookup_error": None, "verdict": "v\x1b[0m"}  # fmt: skip
    text = render_explain_human(online)
    assert "\x1b" not in text
    assert "\x07" not in text
    assert "ns\\x1b[31m/p\\x07" in text

    done = _cli("70", "--proc-root", str(tmp_path), "--offline")
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout
    assert "\\x1b[2J" in done.stdout
    done = _cli("70", "--proc-root", str(tmp_path), "--offline", "--json")
    assert json.loads(done.stdout)["cgroup_lines"] == [f"0::{evil}"]
    assert "\x1b" not in done.stdout  # json.dumps escapes it


def test_an_unparsable_stat_is_reported_as_such_not_as_not_in_proc(tmp_path: Path) -> None:
    d = _write_proc(tmp_path, 71, POD_LINE)
    (d / "stat").write_text("71 (x) S 1 2\n")
    got = explain(71, proc_root=tmp_path)
    assert_contract({**got, "cgroup_version": 2})  # no host cgroup line in this tree
    assert got["is_pod"] is False
    assert got["reason"] != "not in /proc"
    assert "stat" in got["reason"]
    assert "unparsable" in got["reason"]
    assert "not in /proc" not in render_explain_human(got)


def _cli_within(seconds: float, *argv: str) -> subprocess.CompletedProcess[str]:
    """``_cli`` that fails the test, instead of hanging it, when the command blocks."""
    try:
        return run_gpuguard("explain", *argv, timeout=seconds, memory_bytes=None)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpuguard explain {' '.join(argv)} did not finish in {seconds}s")


@pytest.mark.parametrize("name", ["stat", "cgroup"])
def test_the_cli_does_not_block_on_a_fifo_in_the_proc_root(tmp_path: Path, name: str) -> None:
    d = _write_proc(tmp_path, 72, POD_LINE)
    (d / name).unlink()
    os.mkfifo(d / name)
    done = _cli_within(20, "72", "--proc-root", str(tmp_path), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["is_pod"] is False
    assert "not a regular file" in got["reason"]


def test_the_cli_never_follows_a_symlink_out_of_the_proc_root(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$SECRET-HASH:19000:0:99999:7:::\n")
    root = tmp_path / "proc"
    d = _write_proc(root, 73, POD_LINE)
    (d / "cgroup").unlink()
    (d / "cgroup").symlink_to(secret)
    outside = _write_proc(tmp_path / "elsewhere", 74, POD_LINE)
    (root / "74").symlink_to(outside)
    for pid in ("73", "74"):
        for fmt in ((), ("--json",)):
            done = _cli_within(60, pid, "--proc-root", str(root), "--offline", *fmt)
            assert done.returncode == 0, done.stderr
            assert "SECRET" not in done.stdout
            assert UID not in done.stdout  # 74's pod line is outside the tree
            assert "symbolic link" in done.stdout


def _cgroup_of_size(size: int) -> str:
    """A hybrid-host cgroup text of exactly ``size`` bytes, the pod's line last."""
    head = "1:name=systemd:/"
    return f"{head}{'x' * (size - len(POD_LINE) - len(head) - 1)}\n{POD_LINE}"


def test_the_cli_reads_a_cgroup_file_over_64_kib_whole_and_rejects_one_over_1_mib(
    tmp_path: Path,
) -> None:
    _write_proc(tmp_path, 75, _cgroup_of_size(100_000))
    _write_proc(tmp_path, 76, _cgroup_of_size((1 << 20) + 1))
    done = _cli_within(60, "75", "--proc-root", str(tmp_path), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert (got["is_pod"], got["pod_uid"], got["container_id"]) == (True, UID, C)
    done = _cli_within(60, "76", "--proc-root", str(tmp_path), "--offline", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["is_pod"] is False
    assert "larger than" in got["reason"]  # said so, not a verdict on a truncated prefix
    assert got["cgroup_lines"] == []


def test_offline_explain_uses_the_config_file_it_is_given(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'version = 1\n[node]\nproc_root = "{FIXTURES}"\n')
    done = _cli("1001", "--offline", "--json", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pod_uid"] == UID  # read from the config's proc_root
    done = _cli("1001", "--offline", "--json", "--proc-root", "tests/fixtures/proc")
    assert done.returncode == 0, done.stderr  # a relative --proc-root still works
    assert json.loads(done.stdout)["pod_uid"] == UID


def test_online_explain_judges_each_device_by_its_own_size() -> None:
    """A 50 % limit on a PID listed on a 16 GiB and an 80 GiB device: explain resolved the
    percentage against the first device only (8 GiB) and called 30 GiB on the 80 GiB device
    "over its limit". It now reads ``core.assess``, as enforce does."""
    small, large = gpu(0, total=16 * GiB), gpu(1, total=80 * GiB)
    percent = dataclasses.replace(pod(1), annotation_limit=LimitValue(percent=50))
    lookup = online_lookup(
        [small, large], [proc(7, small, GiB), proc(7, large, 30 * GiB)], [percent], {7: 1}
    )
    facts = lookup(attr(7, pod_n=1))
    assert facts is not None
    assert facts["verdict"].startswith("within its limit"), facts["verdict"]
    assert facts["limit_bytes"] == 40 * GiB  # the device it uses most, sized as itself


@pytest.mark.parametrize(
    ("labelled", "exempt", "verdict"),
    [
        (None, None, "exemption unknown"),
        (frozenset({"team"}), True, "exempt"),
        (frozenset(), False, "over its limit"),
    ],
)
def test_online_explain_judges_the_admins_exempt_label_as_enforce_does(
    labelled: frozenset[str] | None, exempt: bool | None, verdict: str
) -> None:
    g0 = gpu(0)
    lookup = online_lookup(
        [g0],
        [proc(7, g0, 3 * GiB)],
        [pod(1, limit=GiB)],
        {7: 1},
        exempt_label=("gpuguard.io/exempt", "true"),
        labelled=labelled,
    )
    facts = lookup(attr(7, pod_n=1))
    assert facts is not None
    assert facts["exempt"] is exempt
    assert verdict in facts["verdict"], facts["verdict"]


def test_online_explain_lists_each_declaration_and_the_one_that_bound() -> None:
    """``explain`` says which declarations were seen and which one bound."""
    device = gpu(0, total=80 * GiB)
    tenant = dataclasses.replace(
        pod(1),
        annotation_limit=LimitValue(percent=100),
        declared={LimitSource.KAI: Declaration(percent=10.0, where="annotation gpu-fraction")},
    )
    lookup = online_lookup(
        [device], [proc(7, device, 9 * GiB)], [tenant], {7: 1}, sources=("gpuguard", "kai")
    )
    facts = lookup(attr(7, pod_n=1))
    assert facts is not None
    assert (facts["limit_bytes"], facts["limit_source"]) == (8 * GiB, "kai")
    assert facts["verdict"].startswith("over its limit")
    assert [(d["source"], d["limit_bytes"], d["bound"]) for d in facts["limit_declarations"]] == [
        ("annotation", 80 * GiB, False),
        ("kai", 8 * GiB, True),
    ]
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: facts)
    assert d["limit_declarations"] == facts["limit_declarations"]
    text = render_explain_human(d)
    assert (
        f"declared:        kai declaration (annotation gpu-fraction) 10% = {8 * GiB} bytes" in text
    )
    assert "<- binds" in text.split("kai declaration", 1)[1].splitlines()[0]


def test_online_explain_names_the_containers_own_limit_and_its_declaration() -> None:
    """A PID of a container with its own KAI declaration: ``container_limits`` names the
    container, its limit and the annotation; the bound declaration names its container; the
    human text says so."""
    from gpuguard.kubemodel.declared import declarations

    device = gpu(0, total=80 * GiB)
    manifest = {
        "metadata": {"annotations": {"nvidia.com/container.c0.gpu-memory.limit": "4Gi"}},
        "spec": {"containers": [{"name": "c0"}, {"name": "c1"}]},
    }
    tenant = dataclasses.replace(pod(1, containers=2), declared=declarations(manifest))
    lookup = online_lookup(
        [device], [proc(7, device, 5 * GiB)], [tenant], {7: 1}, sources=("gpuguard", "kai")
    )
    facts = lookup(attr(7, pod_n=1))
    assert facts is not None
    assert facts["container_limits"] == [
        {
            "container": "c0",
            "limit_bytes": 4 * GiB,
            "what": "kai declaration of container c0 "
            "(annotation nvidia.com/container.c0.gpu-memory.limit)",
            "value": "4Gi",
        }
    ]
    assert [(d["container"], d["bound"]) for d in facts["limit_declarations"]] == [("c0", True)]
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: facts)
    text = render_explain_human(d)
    assert f"container limit: container c0: 4Gi = {4 * GiB} bytes (kai declaration" in text


def test_online_explain_names_the_claims_and_shares_behind_a_dra_limit() -> None:
    """A PID of a pod with two DRA shares on its GPU (claims read in no order) and one on
    another GPU: ``dra_shares`` lists the two on the GPU judged, by claim namespace, name and
    request, and the human text names each claim and share; a pod without DRA gets ``[]``."""
    g0, g1 = gpu(0, total=80 * GiB), gpu(1, total=80 * GiB)

    def share(claim: str, on: str, memory: int | None, device: str = "gpu-0") -> DraShare:
        return DraShare(
            claim_namespace="team", claim_name=claim, request="gpu", driver="gpu.nvidia.com",
            pool="node-1", device=device, share_id=f"{claim}-1", memory_bytes=memory,
            uuid=on,  # type: ignore[arg-type]
        )  # fmt: skip

    shares = (
        share("gpu-xyz", g0.uuid, 2 * GiB),
        share("other", g1.uuid, 8 * GiB, device="gpu-1"),
        share("gpu-abc", g0.uuid, 4 * GiB),
    )
    dra = dataclasses.replace(
        pod(1), declared={LimitSource.DRA: Declaration(where="resourceClaims", shares=shares)}
    )
    lookup = online_lookup(
        [g0, g1],
        [proc(7, g0, 7 * GiB), proc(8, g0, GiB)],
        [dra, pod(2, limit=4 * GiB)],
        {7: 1, 8: 2},
        sources=("gpuguard", "dra"),
    )
    facts = lookup(attr(7, pod_n=1))
    assert facts is not None
    assert (facts["limit_bytes"], facts["limit_source"]) == (6 * GiB, "dra")
    assert facts["dra_shares"] == [
        {
            "claim": "team/gpu-abc",
            "request": "gpu",
            "driver": "gpu.nvidia.com",
            "pool": "node-1",
            "device": "gpu-0",
            "share_id": "gpu-abc-1",
            "memory_bytes": 4 * GiB,
        },
        {
            "claim": "team/gpu-xyz",
            "request": "gpu",
            "driver": "gpu.nvidia.com",
            "pool": "node-1",
            "device": "gpu-0",
            "share_id": "gpu-xyz-1",
            "memory_bytes": 2 * GiB,
        },
    ]
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: facts)
    assert_contract(d)
    assert d["dra_shares"] == facts["dra_shares"]
    assert json.loads(json.dumps(d))["dra_shares"] == facts["dra_shares"]
    text = render_explain_human(d)
    assert (
        "dra shares:      limit 6Gi from dra: claim team/gpu-abc request gpu on "
        "gpu.nvidia.com/node-1/gpu-0, share 4Gi; claim team/gpu-xyz request gpu on "
        "gpu.nvidia.com/node-1/gpu-0, share 2Gi\n"
    ) in text

    plain = lookup(attr(8, pod_n=2))
    assert plain is not None
    assert (plain["limit_source"], plain["dra_shares"]) == ("annotation", [])
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: plain)
    assert d["dra_shares"] == []
    assert "dra shares" not in render_explain_human(d)
    assert "dra_shares" not in explain(1001, proc_root=FIXTURES, offline=True)


def test_a_whole_gpu_dra_share_and_a_hostile_claim_name_are_shown_safely() -> None:
    """A device allocated whole has no memory share (``memory_bytes`` null): the text says
    so. Names are the cluster's: a control character in one never reaches the terminal."""
    share = {
        "claim": "team/evil\x1b[2J",
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "node-1",
        "device": "gpu-0",
        "share_id": None,
        "memory_bytes": None,
    }
    facts = {"pod_namespace": "team", "pod_name": "p", "dra_shares": [share]}
    d = explain(1001, proc_root=FIXTURES, offline=False, pod_lookup=lambda a: facts)
    text = render_explain_human(d)
    assert "\x1b" not in text
    assert (
        "limit the whole GPU from dra: claim team/evil\\x1b[2J request gpu on "
        "gpu.nvidia.com/node-1/gpu-0, share the whole GPU"
    ) in text


def test_a_one_shot_lookup_waits_for_the_dra_reads_of_its_pod_and_no_longer_than_told() -> None:
    """``explain`` and ``inspect`` read the directory once: a pod whose claims are not read yet
    would show no limit. They wait for those reads (``dra_reads``), up to a bound: a claim
    that cannot be read keeps its pod unresolved, and then the bound ends the wait."""

    def dra(n: int, unresolved: str | None) -> Any:
        declared = Declaration(where="resourceClaims", unresolved=unresolved)
        return dataclasses.replace(pod(n), declared={LimitSource.DRA: declared})

    clock = FakeClock()
    directory = FakePodDirectory(
        clock=clock, pods=[dra(1, "ResourceClaim team/c is not read yet"), dra(2, None), pod(3)]
    )
    slept: list[float] = []
    answered = [False]

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)
        if len(slept) == 3 and not answered[0]:  # the claim answered while the command waited
            answered[0] = True
            directory.pods = [dra(1, None), dra(2, None), pod(3)]

    uids = [pod(n).uid for n in (1, 2, 3)]
    assert wait_for_dra_reads(directory, uids, 5.0, clock=clock.monotonic, sleep=sleep)
    assert slept == [POLL_SECONDS] * 3

    directory.pods = [dra(1, "ResourceClaim team/c could not be read: forbidden"), pod(3)]
    slept.clear()
    started = clock.now
    assert not wait_for_dra_reads(directory, uids, 2.0, clock=clock.monotonic, sleep=sleep)
    assert 2.0 <= clock.now - started < 2.0 + 2 * POLL_SECONDS
    slept.clear()
    assert wait_for_dra_reads(directory, [pod(3).uid], 2.0, clock=clock.monotonic, sleep=sleep)
    assert slept == [], "pod-1 is not among the pods waited for"
